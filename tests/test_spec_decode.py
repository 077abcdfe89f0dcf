"""Speculative decoding: ngram drafting, verification (greedy and rejection sampling), the
scheduler's lookahead slots, and token identity with plain decoding on the embedded model."""

from __future__ import annotations

import logging

import pytest
import torch

from bastion.core.config import CacheConfig, ConfigError, SchedulerConfig, build_engine_config
from bastion.core.request import Request
from bastion.core.scheduler import Scheduler
from bastion.core.spec_decode.ngram_proposer import NgramProposer
from bastion.core.spec_decode.rejection_sampler import VerifyRequest, rejection_sample, verify
from bastion.ipc.messages import FinishReason, ModelRunnerOutput, SamplingParams

# ------------------------------------------------------------------------------- proposer


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    # Suffix [7, 8] occurred at 1..2 (followed by 9, 10, 11) and 5..6 (followed by 1, 7, 8).
    assert proposer.propose([0, 7, 8, 9, 10, 7, 8, 1, 7, 8]) == [1, 7, 8]
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert proposer.propose([5, 6, 5]) == [6, 5]  # runs into the suffix itself: periodic
    assert NgramProposer(2, 2, 2).propose([4, 9, 1, 9]) == []  # a 1-token match is too short


# ---------------------------------------------------------------------------- verification


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=64, **kw)


def test_greedy_accepts_while_drafts_match_then_emits_the_argmax():
    vocab = 8
    best = [3, 5, 1, 6]
    logits = torch.full((4, vocab), -1.0)
    logits[torch.arange(4), torch.tensor(best)] = 1.0
    out = verify(logits, [VerifyRequest(_params(temperature=0.0), [1], [], None, None,
                                        [3, 5, 2])])
    assert out.token_ids == [[3, 5, 1]]  # third draft wrong: the target's token replaces it
    out = verify(logits, [VerifyRequest(_params(temperature=0.0), [1], [], None, None,
                                        [3, 5, 1])])
    assert out.token_ids == [[3, 5, 1, 6]]  # all accepted, plus the bonus token


def test_penalties_and_min_tokens_see_the_drafts_before_each_row():
    # Row 1 would pick token 2, but the draft before it (accepted) was 2 and a large
    # presence penalty forbids repeating it, exactly as plain decoding would after emitting 2.
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0], [0.0, 0.0, 5.0, 4.0]])
    req = VerifyRequest(_params(temperature=0.0, presence_penalty=2.0), [0], [], None, None, [2])
    assert verify(logits, [req]).token_ids == [[2, 3]]
    # min_tokens=2 with EOS 2: row 0 cannot end the sequence, row 1 (one token out) still cannot.
    req = VerifyRequest(_params(temperature=0.0, min_tokens=2), [0], [], None, 2, [3])
    assert verify(logits, [req]).token_ids == [[3, 3]]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 4 degrees of freedom: a correct sampler fails 1 in 1000
# seeds, and the seed is fixed.
_CHI2_4DOF_999 = 18.47


@pytest.mark.parametrize("wrong_draft", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(wrong_draft):
    """The first emitted token (an accepted draft or the residual draw after a rejection) is
    distributed as the target's p, whatever q the drafts came from."""
    gen = torch.Generator().manual_seed(1234)
    vocab, num_samples = 5, 6000
    p = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10], [0.30, 0.10, 0.10, 0.20, 0.30]])
    q = torch.tensor([[0.60, 0.05, 0.05, 0.10, 0.20]])  # deliberately far from p
    first = torch.zeros(vocab)
    for _ in range(num_samples):
        if wrong_draft:
            draft = int(torch.multinomial(q[0], 1, generator=gen))
            tokens = rejection_sample(p, [draft], q, gen)
        else:  # a deterministic (ngram) draft: q is one-hot at token 1
            tokens = rejection_sample(p, [1], None, gen)
        first[tokens[0]] += 1
    assert _chi_square(first, p[0]) < _CHI2_4DOF_999
    # The wrong draft would show: sampling q itself fails the same test by far.
    assert _chi_square(q[0] * num_samples, p[0]) > 100 * _CHI2_4DOF_999


def test_rejection_sampling_is_reproducible_from_the_seed():
    p = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    runs = [[rejection_sample(p, [4, 7], None, gen) for _ in range(20)]
            for gen in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------- scheduler


def _scheduler(num_blocks=16, block_size=4, budget=64, k=3) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=False),
                     CacheConfig(block_size=block_size), num_blocks, 64, num_spec_tokens=k)


def _request(request_id: str, n_prompt: int, max_tokens: int = 20, **kw) -> Request:
    return Request(request_id, list(range(1, n_prompt + 1)),
                   SamplingParams(max_tokens=max_tokens, **kw), eos_token_id=0)


def _step(s: Scheduler, emit: dict[str, list[int]], drafts: dict[str, list[int]]):
    out = s.schedule()
    ids = list(emit)
    result = ModelRunnerOutput(ids, [], [], out.step_id, [emit[r] for r in ids],
                               [drafts.get(r, []) for r in ids])
    return out, s.update_from_output(out, result)


def test_drafts_take_lookahead_slots_and_rejected_ones_are_given_back():
    s = _scheduler(block_size=4, k=3)
    s.add_request(_request("a", 6))
    _step(s, {"a": [10]}, {"a": [11, 12, 13]})  # prefill: 6 tokens, 2 blocks
    assert s.kv.block_ids("a") == [0, 1]
    out, _ = _step(s, {"a": [11, 20]}, {"a": [21, 22, 23]})  # 1 of 3 drafts accepted
    assert out.num_scheduled_tokens == {"a": 4}  # the last token and 3 drafts
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert out.cached_requests[0].new_block_ids == [2]  # positions 6..9 reach block 2
    a = s.requests["a"]
    assert a.output_token_ids == [10, 11, 20] and a.num_computed_tokens == 8
    assert s.kv.block_ids("a") == [0, 1]  # block 2 held only rejected drafts: given back
    assert a.num_freed_blocks == 1
    out, _ = _step(s, {"a": [21, 22, 23, 24]}, {})  # all accepted, plus the bonus token
    assert out.cached_requests[0].num_freed_blocks == 1  # the workers hear of it once
    assert out.cached_requests[0].new_block_ids == [3]  # block 2 went to the free queue's back
    assert a.output_token_ids == [10, 11, 20, 21, 22, 23, 24] and a.num_computed_tokens == 12
    out, _ = _step(s, {"a": [30]}, {})  # no drafts: a plain decode row
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens
    s.abort_requests(["a"])
    assert s.kv.num_free_blocks == 16


def test_a_stop_inside_an_accepted_run_ends_at_exactly_that_token():
    s = _scheduler(k=4)
    s.add_request(_request("eos", 5))
    s.add_request(_request("stop", 5, stop_token_ids=[42]))
    s.add_request(_request("len", 5, max_tokens=3))
    _step(s, {r: [7] for r in ("eos", "stop", "len")}, {r: [8, 9, 9, 9] for r in ("eos", "stop", "len")})
    out, outputs = _step(s, {"eos": [8, 0, 5], "stop": [8, 42, 5], "len": [8, 9]}, {})
    # "len" had room for one draft only (max_tokens 3: one emitted, two to go).
    assert out.scheduled_spec_decode_tokens["len"] == [8]
    by_id = {o.request_id: o for o in outputs}
    assert by_id["eos"].new_token_ids == [8, 0] and by_id["eos"].finish_reason == FinishReason.STOP
    assert by_id["stop"].new_token_ids == [8, 42] and by_id["stop"].stop_reason == 42
    assert by_id["len"].new_token_ids == [8, 9]
    assert by_id["len"].finish_reason == FinishReason.LENGTH
    assert not s.has_unfinished_requests and s.kv.num_free_blocks == 16


def test_drafts_fit_the_token_budget():
    s = _scheduler(budget=3, k=4)
    s.add_request(_request("a", 3))
    _step(s, {"a": [7]}, {"a": [1, 2, 3, 4]})
    out, _ = _step(s, {"a": [1, 2, 9]}, {})
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2]}


def _async_scheduler(num_blocks=16, block_size=4, budget=64, k=3) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), CacheConfig(
        block_size=block_size), num_blocks, 64, num_spec_tokens=k, is_async_spec=True)


def _fold(s: Scheduler, out, emit: dict[str, list[int]], num_drafts: dict[str, int]):
    """Fold in a launched step as its worker answered: the tokens each row emitted and how
    many drafts it verified (async speculation: the drafts never reach the scheduler)."""
    ids = list(emit)
    result = ModelRunnerOutput(ids, [], [], out.step_id, [emit[r] for r in ids],
                               num_draft_tokens=[num_drafts.get(r, 0) for r in ids])
    return s.update_from_output(out, result)


def test_async_speculation_schedules_ahead_and_corrects_by_the_rejected_drafts():
    """Each step is scheduled before the one in flight is folded in, its decode row with 1 + k
    slots as if every draft in flight were accepted; the fold takes the rejected drafts off
    the count (where the worker ran the next step) and gives their blocks back."""
    s = _async_scheduler(block_size=4, k=3)
    s.add_request(_request("a", 6))
    a = s.requests["a"]
    out1 = s.schedule()  # the prefill: 6 tokens in blocks 0 and 1
    out2 = s.schedule()  # the first decode, its token still in flight: 1 + 3 slots
    assert out2.num_scheduled_tokens == {"a": 4}
    assert out2.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert out2.cached_requests[0].new_block_ids == [2]  # positions 6..9
    assert (a.num_computed_tokens, a.num_output_placeholders) == (10, 5)
    _fold(s, out1, {"a": [10]}, {})
    out3 = s.schedule()  # as if step 2's three drafts are all accepted: positions 10..13
    assert out3.cached_requests[0].new_block_ids == [3]
    assert out3.cached_requests[0].num_computed_tokens == 10  # optimistic: the worker has 8
    outputs = _fold(s, out2, {"a": [11, 20]}, {"a": 3})  # one of three drafts accepted
    assert outputs[0].new_token_ids == [11, 20]
    # The worker ran step 3 from position 8 (token 20) on, 4 tokens: 12 have KV once it is done.
    assert (a.num_computed_tokens, a.num_output_placeholders) == (12, 4)
    assert s.kv.block_ids("a") == [0, 1, 2]  # block 3 held only slots past 12: given back
    out4 = s.schedule()
    assert out4.cached_requests[0].num_freed_blocks == 1
    assert out4.cached_requests[0].new_block_ids == [4]  # block 3 went to the queue's back
    assert out4.num_scheduled_tokens == {"a": 4}
    _fold(s, out3, {"a": [21, 22, 23, 24]}, {"a": 3})  # all three accepted, then one more
    assert a.num_computed_tokens == 16 and s.kv.block_ids("a") == [0, 1, 2, 4]
    out5 = s.schedule()  # step 5 is in flight when step 4 ends the request
    assert "a" in out5.num_scheduled_tokens
    outputs = _fold(s, out4, {"a": [30, 0, 31]}, {"a": 3})  # EOS inside the accepted run
    assert outputs[0].new_token_ids == [30, 0]
    assert outputs[0].finish_reason == FinishReason.STOP
    assert a.output_token_ids == [10, 11, 20, 21, 22, 23, 24, 30, 0]
    assert s.kv.num_free_blocks == 16 and s.finished_ids == ["a"]
    assert _fold(s, out5, {"a": [40, 41]}, {"a": 3}) == []  # its extra tokens are dropped
    assert not s.has_unfinished_requests and a.output_token_ids[-1] == 0
    assert (s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (9, 6)


def test_async_speculation_slots_leave_room_for_a_step_in_flight_that_accepts_nothing():
    """Draft slots stop at the length limit as if the step in flight emitted only its sampled
    token: the worker has as many slots as a synchronous step would have drafts (a seeded
    request draws alike either way); slots its exact limit leaves empty are given back."""
    s = _async_scheduler(k=3)
    s.add_request(_request("a", 5, max_tokens=6))
    a = s.requests["a"]
    out1 = s.schedule()
    out2 = s.schedule()  # one token in flight; five to go after it: room for 3 drafts
    assert out2.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    _fold(s, out1, {"a": [7]}, {})
    # Step 2 emits at least its sampled token, leaving at most four: 3 drafts and one more.
    out3 = s.schedule()
    assert out3.num_scheduled_tokens == {"a": 4}
    assert out3.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    _fold(s, out2, {"a": [8, 9, 9, 9]}, {"a": 3})  # it emitted four: one is left
    out4 = s.schedule()  # five tokens known and the sixth in flight: nothing to schedule
    assert not out4.num_scheduled_tokens
    # The worker filled none of step 3's slots (its exact limit) and sampled the last token.
    outputs = _fold(s, out3, {"a": [5]}, {"a": 0})
    assert outputs[0].new_token_ids == [5] and outputs[0].finish_reason == FinishReason.LENGTH
    assert a.output_token_ids == [7, 8, 9, 9, 9, 5]
    assert (s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (3, 3)
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests


def test_async_draft_model_keeps_the_lookahead_of_the_step_in_flight():
    """A draft model writes its next drafts' KV in lookahead slots past a step's tokens. A fold
    that gives rejected slots back keeps those of the step still in flight (its worker drafts
    into them after verifying); with no step in flight they go back too."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4), 16, 64,
                  num_spec_tokens=2, num_lookahead_tokens=2, is_async_spec=True)
    s.add_request(_request("a", 6))
    a = s.requests["a"]
    out1 = s.schedule()  # the prefill and 2 lookahead slots: 8 tokens, blocks 0 and 1
    assert s.kv.block_ids("a") == [0, 1]
    out2 = s.schedule()  # 1 + 2 slots from position 6, then 2 lookahead: block 2
    assert out2.num_scheduled_tokens == {"a": 3} and s.kv.block_ids("a") == [0, 1, 2]
    _fold(s, out1, {"a": [10]}, {})
    out3 = s.schedule()  # as if step 2's drafts were accepted: positions 9..11, then 12, 13
    assert out3.cached_requests[0].new_block_ids == [3]
    _fold(s, out2, {"a": [11, 20]}, {"a": 2})  # one of two accepted
    # Step 3 runs from position 8 (token 20): 3 tokens, and its draft model may then write
    # positions up to 12 (block 3) as it drafts.
    assert a.num_computed_tokens == 11 and s.kv.block_ids("a") == [0, 1, 2, 3]
    _fold(s, out3, {"a": [21, 30]}, {"a": 2})  # one of two accepted; nothing in flight
    assert a.num_computed_tokens == 10 and s.kv.block_ids("a") == [0, 1, 2]
    assert a.num_freed_blocks == 1
    s.abort_requests(["a"])
    assert s.kv.num_free_blocks == 16


def test_async_speculation_a_row_preempted_with_a_step_in_flight_keeps_its_tokens():
    s = _async_scheduler(num_blocks=6, block_size=4, k=3)
    s.add_request(_request("a", 8))
    s.add_request(Request("b", list(range(101, 109)), SamplingParams(max_tokens=20),
                          eos_token_id=0))  # another prompt: no prefix hit on a's blocks
    a, b = s.requests["a"], s.requests["b"]
    out1 = s.schedule()  # blocks 0, 1 (a) and 2, 3 (b)
    out2 = s.schedule()  # 1 + 3 slots each: blocks 4 (a) and 5 (b); the pool is empty
    assert out2.num_scheduled_tokens == {"a": 4, "b": 4}
    _fold(s, out1, {"a": [10], "b": [20]}, {})
    out3 = s.schedule()  # a needs a block: b, the newest, is preempted with step 2 in flight
    assert out3.finished_request_ids == ["b"] and b.num_computed_tokens == 0
    assert out3.num_scheduled_tokens == {"a": 1}  # room for a's own token only
    assert out3.cached_requests[0].new_block_ids == [5]
    _fold(s, out2, {"a": [11, 12], "b": [21, 22, 23, 24]}, {"a": 3, "b": 3})
    # b's tokens count (its KV was intact when step 2 ran); it starts over with all of them.
    assert b.output_token_ids == [20, 21, 22, 23, 24] and b.num_computed_tokens == 0
    assert b.num_output_placeholders == 0 and s.kv.block_ids("b") == []
    assert a.num_computed_tokens == 11 and s.kv.block_ids("a") == [0, 1, 4]
    s.abort_requests(["a", "b"])
    assert s.kv.num_free_blocks == 6


# --------------------------------------------------------------------------------- config


def test_speculative_config_is_validated_with_clear_errors():
    cfg = build_engine_config(speculative_config='{"method": "ngram", "num_speculative_tokens": '
                                                 '3, "prompt_lookup_min": 2, '
                                                 '"prompt_lookup_max": 5}')
    assert cfg.speculative.num_speculative_tokens == 3 and cfg.speculative.prompt_lookup_min == 2
    assert build_engine_config().speculative is None
    cases = [
        ({"method": "eagle"}, "method must be one of ngram, draft_model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"in \[1, 16\]"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "prompt_lookup_min <= prompt_lookup_max"),
        ({"method": "ngram", "draft_tensor_parallel_size": 1}, "unknown key"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2},
         "does not exist"),
        ("{not json", "must be a JSON object"),
    ]
    for value, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_engine_config(speculative_config=value)
    with pytest.raises(ConfigError, match="tensor parallelism"):
        build_engine_config(speculative_config={"method": "ngram"}, tensor_parallel_size=2)


# ------------------------------------------------------------------- end to end (embedded)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4}
_PASSAGE = ("The committee met on Tuesday to review the budget. The committee agreed that the "
            "budget for the new library would rise by ten percent next year.")
PROMPTS = [
    f"Copy the passage exactly.\nPassage: {_PASSAGE}\nCopy: The committee met",
    f"Copy the passage exactly.\nPassage: {_PASSAGE}\nCopy: The committee agreed",  # prefix hit
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Hello, my name is",
]


def _greedy(llm, prompts, max_tokens=24, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One thread: on a small shared CPU two OpenMP threads wait at barriers (BENCHMARKS.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plain_llm(embedded_llm):
    return embedded_llm


@pytest.fixture(scope="module")
def reference(plain_llm):
    return [o.token_ids for o in _greedy(plain_llm, PROMPTS)]


@pytest.fixture(scope="module")
def ngram_llm():
    """One ngram-speculating LLM for the tests that only generate with it (each counts its own
    drafts through ``_count_spec``; none changes the runner). Async scheduling is on (the
    default): the worker drafts into the slots the scheduler reserved ahead."""
    from bastion.procs.llm import LLM

    llm = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM)
    assert llm.engine.async_scheduling and llm.engine.executor.runner.is_async_spec
    return llm


@pytest.fixture(scope="module")
def ngram_sync_llm():
    """The same speculation with async scheduling off: the scheduler carries the drafts."""
    from bastion.procs.llm import LLM

    llm = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM,
              async_scheduling=False)
    assert not llm.engine.async_scheduling and not llm.engine.executor.runner.is_async_spec
    return llm


def _record_outputs(llm, monkeypatch) -> list:
    """Every EngineCoreOutput the engine gives while the test runs."""
    seen = []
    step = llm.engine.step

    def recording_step():
        outputs = step()
        seen.extend(outputs.outputs)
        return outputs

    monkeypatch.setattr(llm.engine, "step", recording_step)
    return seen


def _count_spec(llm) -> dict[str, int]:
    """Wrap the scheduler's counters so a test sees totals (reports reset them every step)."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "preemptions": 0}
    sched = llm.engine.scheduler
    observe, preempt = sched.spec_stats.observe, sched._preempt

    def counting_observe(num_draft_tokens, num_accepted):
        totals["drafts"] += 1
        totals["draft_tokens"] += num_draft_tokens
        totals["accepted"] += num_accepted
        observe(num_draft_tokens, num_accepted)

    def counting_preempt(request):
        totals["preemptions"] += 1
        preempt(request)

    sched.spec_stats.observe, sched._preempt = counting_observe, counting_preempt
    return totals


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_ngram_greedy_is_token_identical_with_prefix_hits(reference, ngram_llm, ngram_sync_llm,
                                                          is_async):
    llm = ngram_llm if is_async else ngram_sync_llm
    totals = _count_spec(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert outputs[1].num_cached_tokens > 0
    # The copy prompts repeat their passage: most drafts are accepted.
    assert totals["accepted"] > totals["draft_tokens"] // 2 > 0
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_ngram_with_chunked_prefill_and_preemption_is_token_identical(reference, is_async):
    from bastion.procs.llm import LLM

    llm = LLM(dtype="float32", max_model_len=128, max_num_batched_tokens=16, block_size=8,
              num_gpu_blocks_override=16, enable_prefix_caching=False, speculative_config=NGRAM,
              async_scheduling=is_async)
    assert llm.engine.async_scheduling is is_async
    totals = _count_spec(llm)
    outputs = _greedy(llm, PROMPTS)
    assert [o.token_ids for o in outputs] == reference
    assert totals["preemptions"] > 0 and totals["accepted"] > 0
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks
    assert all(b.ref_cnt == 0 for b in llm.engine.scheduler.kv.pool.blocks)


def test_async_ngram_with_prefix_hits_chunked_prefill_and_preemption(reference):
    """Prefix caching on in a pool too small for the batch: prefix hits, chunked prefills and
    preemptions with steps in flight, all at once."""
    from bastion.procs.llm import LLM

    llm = LLM(dtype="float32", max_model_len=128, max_num_batched_tokens=16, block_size=8,
              num_gpu_blocks_override=16, speculative_config=NGRAM)
    assert llm.engine.async_scheduling
    totals = _count_spec(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert outputs[1].num_cached_tokens > 0
    assert totals["preemptions"] > 0 and totals["accepted"] > 0
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == llm.engine.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_ngram_stops_and_logprobs_match_plain_decoding(plain_llm, ngram_llm, ngram_sync_llm,
                                                       reference, monkeypatch):
    prompt = PROMPTS[0]
    # Stop ids and a stop string placed inside what will be an accepted run of drafts;
    # penalties and min_tokens, which read the drafts before each verified position. One batch
    # of every variant on each side (greedy tokens do not depend on the batch: test_llm).
    stop_id = reference[0][9]
    stop_text = plain_llm.tokenizer.decode(reference[0])[30:38]
    variants = [{"max_tokens": 40} | kw for kw in (
        {"logprobs": 2}, {"stop_token_ids": [stop_id]}, {"stop": [stop_text]},
        {"max_tokens": 7}, {"repetition_penalty": 1.3, "frequency_penalty": 0.4},
        {"min_tokens": 12, "stop_token_ids": [stop_id]})]
    params = [SamplingParams(temperature=0.0, **kw) for kw in variants]
    expected = [o.outputs[0] for o in plain_llm.generate([prompt] * len(params), params)]
    got_sync = [o.outputs[0] for o in ngram_sync_llm.generate([prompt] * len(params), params)]
    seen = _record_outputs(ngram_llm, monkeypatch)
    got = [o.outputs[0] for o in ngram_llm.generate([prompt] * len(params), params)]
    assert expected[0].token_ids[:len(reference[0])] == reference[0]
    for kw, a, s, b in zip(variants, got, got_sync, expected):
        assert a.token_ids == s.token_ids == b.token_ids, kw
        assert (a.text, a.finish_reason, a.stop_reason) == (
            s.text, s.finish_reason, s.stop_reason) == (b.text, b.finish_reason,
                                                        b.stop_reason), kw
    # Under async scheduling the stop id, and max_tokens, ended their requests inside a run of
    # accepted drafts (a step that emitted several tokens), with the next step in flight.
    final = [o for o in seen if o.finish_reason is not None]
    assert any(len(o.new_token_ids) > 1 and o.stop_reason == stop_id for o in final)
    assert any(len(o.new_token_ids) > 1 and o.finish_reason == FinishReason.LENGTH
               for o in final)
    assert ngram_llm.engine.scheduler.kv.num_free_blocks == ngram_llm.engine.num_blocks
    # The stop id and the stop string ended their runs early; min_tokens held the stop id off.
    assert [got[i].finish_reason for i in (1, 2)] == ["stop"] * 2
    assert len(got[1].token_ids) == 10 < len(got[5].token_ids)
    assert len(got[0].logprobs) == 40
    for a, b in zip(got[0].logprobs, expected[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for token_id in a:
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-3)
            assert a[token_id].rank == b[token_id].rank


def test_ngram_seeded_sampling_is_reproducible(ngram_llm, ngram_sync_llm):
    llm = ngram_llm
    totals = _count_spec(llm)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert first == again and all(len(t) == 20 for t in first)
    assert totals["draft_tokens"] > 0
    # Async scheduling verifies the same drafts as a synchronous engine (the slots it reserves
    # ahead leave room for them), so the seeds draw alike: the same tokens.
    batch = [params, params] + [SamplingParams(temperature=1.0, seed=3, max_tokens=n)
                                for n in (13, 9)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, batch)]
    assert got[:2] == first
    assert [o.outputs[0].token_ids for o in ngram_sync_llm.generate(PROMPTS, batch)] == got
    # A seeded request's tokens do not depend on what else runs beside it.
    mixed = llm.generate(PROMPTS[2:] + PROMPTS[:1], [SamplingParams(
        temperature=0.0, max_tokens=20)] * 2 + [params])
    assert mixed[2].outputs[0].token_ids == first[0]


def _count_graph_runs(runner, name: str, calls: list[int]) -> None:
    graph_runner = getattr(runner, name)
    run = graph_runner.run

    def counting_run(inputs, *args, **kwargs):
        calls.append(len(inputs.input_ids))
        return run(inputs, *args, **kwargs)

    graph_runner.run = counting_run


def test_ngram_plain_steps_replay_the_decode_graph_and_verify_steps_the_verify_graph(reference):
    """On a GPU, steps without drafts replay the decode graphs and steps with drafts the
    verify graphs (k + 1 tokens per sequence, fewer drafts padded). Here both graph runners run
    their padded batches eagerly on the CPU, as in test_llm; the tokens stay the reference's."""
    from bastion.procs.llm import LLM

    llm = LLM(dtype="float32", max_model_len=256, speculative_config=NGRAM)
    runner = llm.engine.executor.runner
    k = NGRAM["num_speculative_tokens"]
    runner.graph_runner = runner.build_graph_runner()
    runner.verify_graph_runner = runner.build_graph_runner(k + 1)
    decode_calls: list[int] = []
    verify_calls: list[int] = []
    _count_graph_runs(runner, "graph_runner", decode_calls)
    _count_graph_runs(runner, "verify_graph_runner", verify_calls)
    totals = _count_spec(llm)
    assert [o.token_ids for o in _greedy(llm, PROMPTS)] == reference
    assert decode_calls and verify_calls and totals["drafts"] > 0
    # Every verify step fed k + 1 tokens for each of its sequences.
    assert all(n % (k + 1) == 0 for n in verify_calls)


# ------------------------------------------------------------------------------ draft model


@pytest.fixture(scope="module")
def tiny_random_draft(tmp_path_factory) -> str:
    """A random 2-layer Llama with the embedded model's vocabulary: its drafts are junk."""
    from conftest import build_tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny-draft")
    build_tiny_hf_model("llama", seed=3, vocab_size=49152).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, embedded_gguf_path) -> str:
    """Another random 2-layer Llama with the embedded model's vocabulary, and its tokenizer: a
    target whose forward takes milliseconds (the embedded model's, float32, reads 538 MB a
    step: ~70 ms here). Its greedy tokens follow the context (no token repeats for long) with
    top-1 margins of 1e-3 and up, far above float noise."""
    from conftest import build_tiny_hf_model, copy_embedded_tokenizer

    folder = tmp_path_factory.mktemp("tiny-target")
    build_tiny_hf_model("llama", seed=5, vocab_size=49152).save_pretrained(folder)
    copy_embedded_tokenizer(folder, embedded_gguf_path)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_reference(tiny_target) -> list[list[int]]:
    """Plain greedy decoding of PROMPTS by ``tiny_target``."""
    from bastion.procs.llm import LLM

    return [o.token_ids for o in _greedy(LLM(tiny_target, dtype="float32", max_model_len=128),
                                         PROMPTS)]


def _draft_config(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def _small_pool_llm(speculative_config: dict, is_async: bool, caplog, model: str | None = None):
    """An LLM (of ``model``, the embedded one by default) whose pool is too small for PROMPTS
    (forced preemption), with chunked prefills and prefix caching on; async scheduling as
    asked, never turned off behind its back."""
    from bastion.procs.llm import LLM

    with caplog.at_level(logging.INFO, logger="bastion.core.engine_core"):
        llm = LLM(model, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
                  block_size=8, num_gpu_blocks_override=16,
                  speculative_config=speculative_config, async_scheduling=is_async)
    assert llm.engine.async_scheduling is is_async
    assert llm.engine.executor.runner.is_async_spec is is_async
    assert "async scheduling is off" not in caplog.text
    return llm


def _assert_all_blocks_free(llm) -> None:
    """The draft's KV lives in the target's block ids, so the one pool counts both."""
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == llm.engine.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks) and not kv.req_blocks


# NOTE: the [sync] twins of the two small-pool draft-model tests run a tiny target (and, for
# the equal draft, the same tiny model as its draft): what sync differs in (the scheduler
# carries the drafts; no slots reserved ahead) does not depend on the model, and the scenario
# is the same: PROMPTS' token counts, the pool and the budget give the same prefix hit,
# chunked prefills and preemptions, with the same drafts proposed and accepted where the draft
# is the target (19 drafts, 54 tokens, one preemption, either model). With the embedded model
# as target and draft, [sync] took 10-14 s, most of it float32 forwards; the [async] twins
# keep the embedded model (the verify-graph test and the seeded test run it too).
@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_draft_model_equal_to_the_target_has_every_draft_accepted(reference, embedded_gguf_path,
                                                                  tiny_target, tiny_reference,
                                                                  is_async, caplog):
    # Prefix hits, chunked prefill and preemption too: the draft's KV rides on the target's
    # blocks; under async scheduling its lookahead is reserved ahead of the step in flight.
    target, draft = (None, embedded_gguf_path) if is_async else (tiny_target, tiny_target)
    reference = reference if is_async else tiny_reference
    llm = _small_pool_llm(_draft_config(draft), is_async, caplog, target)
    totals = _count_spec(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert outputs[1].num_cached_tokens > 0
    assert totals["preemptions"] > 0
    assert totals["accepted"] == totals["draft_tokens"] > 0
    _assert_all_blocks_free(llm)


def test_draft_model_verify_steps_through_the_verify_graph_runner(reference,
                                                                  embedded_gguf_path):
    """The verify graphs' padded batch is what the draft model shadows for its KV: with the
    target as its own draft, every draft is still accepted (async scheduling on)."""
    from bastion.procs.llm import LLM

    llm = LLM(dtype="float32", max_model_len=128, block_size=8,
              speculative_config=_draft_config(embedded_gguf_path))
    assert llm.engine.async_scheduling
    runner = llm.engine.executor.runner
    runner.verify_graph_runner = runner.build_graph_runner(4)
    verify_calls: list[int] = []
    _count_graph_runs(runner, "verify_graph_runner", verify_calls)
    totals = _count_spec(llm)
    assert [o.token_ids for o in _greedy(llm, PROMPTS)] == reference
    assert verify_calls and totals["accepted"] == totals["draft_tokens"] > 0
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_random_draft_model_is_almost_never_accepted_and_changes_nothing(reference,
                                                                         tiny_random_draft,
                                                                         tiny_target,
                                                                         tiny_reference,
                                                                         is_async, caplog):
    # [sync]: the tiny target (NOTE above), another random model than the draft.
    target = None if is_async else tiny_target
    reference = reference if is_async else tiny_reference
    llm = _small_pool_llm(_draft_config(tiny_random_draft), is_async, caplog, target)
    totals = _count_spec(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert outputs[1].num_cached_tokens > 0 and totals["preemptions"] > 0
    assert totals["draft_tokens"] > 0 and totals["accepted"] <= totals["draft_tokens"] // 10
    _assert_all_blocks_free(llm)


def test_draft_model_seeded_sampling_is_reproducible_and_the_same_async_or_not(
        tiny_random_draft):
    """Sampling with the random draft's probabilities (rejection sampling, mostly rejected):
    a seeded request's tokens come from its seed alone, async scheduling on or off. Lengths
    vary so that rows near their end (fewer drafts than k) are in the batch."""
    from bastion.procs.llm import LLM

    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate((12, 20, 17, 9))]
    tokens = {}
    for is_async in (True, False):
        llm = LLM(dtype="float32", max_model_len=256, speculative_config=_draft_config(
            tiny_random_draft), async_scheduling=is_async)
        assert llm.engine.async_scheduling is is_async
        totals = _count_spec(llm)
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        if is_async:  # again, the same engine: the seeds, not the engine's state, decide
            assert first == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert [len(t) for t in first] == [12, 20, 17, 9] and totals["draft_tokens"] > 0
        _assert_all_blocks_free(llm)
        tokens[is_async] = first
    assert tokens[True] == tokens[False]


def test_draft_model_with_another_vocabulary_fails_at_start_up(tmp_path):
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    from bastion.procs.llm import LLM

    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).save_pretrained(
        tmp_path)
    with pytest.raises(ConfigError, match="must share the target's vocabulary"):
        LLM(dtype="float32", max_model_len=128, speculative_config=_draft_config(str(tmp_path)))


def test_speculative_config_reaches_worker_processes_and_the_cli():
    import msgspec

    from bastion.core.config import EngineConfig
    from bastion.procs.cli import build_parser, engine_kwargs

    config = build_engine_config(speculative_config=NGRAM)
    decoded = msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig)
    assert decoded.speculative == config.speculative
    args = build_parser().parse_args(["generate", "hi", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}'])
    spec = build_engine_config(**engine_kwargs(args)).speculative
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 2)


def test_spec_decode_metrics_and_log_line():
    from bastion.api.metrics import ApiMetrics
    from bastion.core.spec_decode.metrics import SpecDecodingLogger
    from bastion.ipc.messages import SchedulerStats

    class Client:
        max_model_len = 2048  # sizes the token histograms' buckets

        def scheduler_stats(self):
            return []

    metrics = ApiMetrics(Client(), "m")
    stats = SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=12,
                           spec_num_accepted_tokens=7, spec_num_accepted_tokens_per_pos=[4, 2, 1])
    metrics.observe_scheduler_stats(0, stats)
    text = metrics.render().decode()
    for line in ('bastion:spec_decode_num_drafts_total{model_name="m"} 4.0',
                 'bastion:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'bastion:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 ('bastion:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
                  'position="2"} 1.0')):
        assert line in text
    log = SpecDecodingLogger(3, interval_s=0.0)
    log.observe(stats)  # logs and resets; a fresh summary shows the same numbers when refed
    log.interval_s = 1e9
    log.observe(stats)
    assert log.summary().startswith("SpecDecoding metrics: mean acceptance length 2.75, "
                                    "accepted 7/12 draft tokens (58.3 %), 4 drafts, "
                                    "per-position acceptance [1.00, 0.50, 0.25]")


def test_served_completion_speculates_through_worker_processes(plain_llm, tmp_path):
    """``bastion serve --speculative-config``: the worker process drafts and verifies, the
    completion matches plain offline decoding and /metrics counts the drafts."""
    import json
    import signal
    import urllib.request

    from serve_fixture import SMALL_SERVER_ARGS, ServerProcess

    srv = ServerProcess(extra_args=(*SMALL_SERVER_ARGS, "--speculative-config", json.dumps(NGRAM)),
                        workdir=str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(timeout_s=120)
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}).encode()
        req = urllib.request.Request(srv.base_url + "/v1/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
        assert text == _greedy(plain_llm, PROMPTS[:1])[0].text
        _, metrics = srv.get("/metrics")
        drafts = [line for line in metrics.decode().splitlines()
                  if line.startswith("bastion:spec_decode_num_accepted_tokens_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0
        assert srv.stop(signal.SIGTERM, timeout_s=60) == 0
    finally:
        srv.kill_tree()
