"""Stop-string matching whose cost per character does not grow with the number of stop strings.

One Aho-Corasick automaton per stop list (built once, shared by every sequence that uses the
list, cached across requests) and one integer of state per sequence. Feeding a character is a
dictionary lookup or two, amortized, whether the list holds one string or hundreds, and the
state says at once how much of the text's tail could still begin a stop string (its depth), so
the detokenizer never rescans the tail.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

# Transitions live in one dict keyed by (node << _CHAR_BITS) | code point: far less memory than
# a dict per node, and int keys hash fast.
_CHAR_BITS = 21  # every code point is < 0x110000 < 2**21


class StopMatch(NamedTuple):
    """A stop string that ends at ``end`` (an index into the fed text, exclusive)."""

    stop: str
    end: int


class StopAutomaton:
    """Aho-Corasick over ``stops``; immutable once built, so sequences share one.

    ``step`` returns the next state; ``depth[state]`` is the length of the longest tail of the
    text fed so far that is a prefix of some stop string; ``match[state]`` is the index of the
    longest stop string that ends at the last character fed, or -1.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._goto: dict[int, int] = {}
        self.depth: list[int] = [0]
        self.match: list[int] = [-1]
        for index, stop in enumerate(self.stops):
            node = 0
            for char in stop:
                key = (node << _CHAR_BITS) | ord(char)
                child = self._goto.get(key)
                if child is None:
                    child = len(self.depth)
                    self._goto[key] = child
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(-1)
                node = child
            if self.match[node] == -1:  # a repeated stop string keeps its first index
                self.match[node] = index
        self._fail = [0] * len(self.depth)
        self._build_failure_links()

    def _build_failure_links(self) -> None:
        """fail[n]: the node of the longest proper suffix of n's string that is in the trie;
        also lets ``match`` inherit the longest stop string that is such a suffix."""
        children: list[list[tuple[int, int]]] = [[] for _ in self.depth]
        for key, child in self._goto.items():
            children[key >> _CHAR_BITS].append((key & ((1 << _CHAR_BITS) - 1), child))
        fail = self._fail
        queue = deque(child for _, child in children[0])
        while queue:
            node = queue.popleft()
            for code, child in children[node]:
                # NOTE: fail[node] is shallower than node, so it is final already (BFS order).
                fail[child] = self._next(fail[node], code)
                if self.match[child] == -1:
                    self.match[child] = self.match[fail[child]]
                queue.append(child)

    def _next(self, state: int, code: int) -> int:
        goto = self._goto
        while True:
            child = goto.get((state << _CHAR_BITS) | code)
            if child is not None:
                return child
            if state == 0:
                return 0
            state = self._fail[state]

    def step(self, state: int, char: str) -> int:
        return self._next(state, ord(char))


@functools.lru_cache(maxsize=32)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of one stop list; an ``n > 1`` request or a batch of prompts builds it
    once (and so does a client that repeats its stop list across requests)."""
    return StopAutomaton(stops)


class StopMatcher:
    """One sequence's position in its stop list's automaton."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.automaton = stop_automaton(tuple(stops))
        self.state = 0
        self.num_fed_chars = 0

    def feed(self, text: str) -> StopMatch | None:
        """Feed text that follows what was fed before; the first stop string to complete (the
        longest of those ending at the same character) or None. After a match, feed no more."""
        automaton = self.automaton
        state = self.state
        for offset, char in enumerate(text):
            state = automaton.step(state, char)
            index = automaton.match[state]
            if index != -1:
                self.state = state
                self.num_fed_chars += offset + 1
                return StopMatch(automaton.stops[index], self.num_fed_chars)
        self.state = state
        self.num_fed_chars += len(text)
        return None

    @property
    def num_pending_chars(self) -> int:
        """Length of the longest tail of the fed text that may still begin a stop string."""
        return self.automaton.depth[self.state]
