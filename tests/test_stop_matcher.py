"""The Aho-Corasick stop matcher against a brute-force reference, and its cost bound."""

from __future__ import annotations

import random
import time

import pytest

from bastion.core.stop_matcher import StopAutomaton, StopMatcher


def reference(stops: list[str], text: str) -> tuple[str, int] | None:
    """The first stop string to complete in ``text`` (the longest among those completing at
    the same character), with its end; and the longest tail that begins a stop string."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return max(done, key=len), end
    return None


def pending(stops: list[str], text: str) -> int:
    return max((n for s in stops for n in range(1, len(s) + 1) if text.endswith(s[:n])),
               default=0)


@pytest.mark.parametrize("seed", range(40))
def test_matches_reference_in_any_split(seed):
    rng = random.Random(seed)
    alphabet = "abé😀"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
             for _ in range(rng.randint(1, 6))]
    text = "".join(rng.choice(alphabet) for _ in range(40))
    expected = reference(stops, text)
    matcher = StopMatcher(stops)
    pos, got = 0, None
    while pos < len(text) and got is None:
        piece = text[pos:pos + rng.randint(1, 4)]
        got = matcher.feed(piece)
        pos += len(piece)
        if got is None:
            assert matcher.num_pending_chars == pending(stops, text[:pos])
    assert (None if got is None else (got.stop, got.end)) == expected


def test_overlapping_and_nested_stops():
    matcher = StopMatcher(["abcd", "bc"])
    # "bc" completes first (at 'c'), although "abcd" starts earlier
    assert matcher.feed("xabcd") == ("bc", 4)
    matcher = StopMatcher(["she", "he", "hers"])
    assert matcher.feed("ushers") == ("she", 4)  # "he" ends there too; the longer wins


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopAutomaton(["ok", ""])


def test_cost_per_character_does_not_grow_with_the_list():
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(20_000))

    def seconds(num_stops: int, length: int) -> float:
        # Stop strings that share long prefixes with the text: the worst case for a naive scan.
        stops = [text[i:i + length - 1] + "!" for i in range(0, num_stops * 7, 7)]
        matcher = StopMatcher(stops)
        start = time.perf_counter()
        assert matcher.feed(text) is None
        return time.perf_counter() - start

    small, large = seconds(1, 8), seconds(64, 256)
    assert large < max(10 * small, 0.05), (small, large)
