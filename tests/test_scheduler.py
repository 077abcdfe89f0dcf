"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption, errors, no leaks."""

from __future__ import annotations

import time

from bastion.core.config import CacheConfig, SchedulerConfig
from bastion.core.request import Request, RequestStatus
from bastion.core.scheduler import Scheduler
from bastion.ipc.messages import FinishReason, ModelRunnerOutput, SamplingParams, SchedulerOutput


def make_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=8, max_model_len=64,
                   policy="fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     policy=policy),
                     CacheConfig(block_size=block_size), num_blocks, max_model_len)


def req(request_id: str, n_prompt: int, max_tokens: int = 4, start: int = 0, **kw) -> Request:
    return Request(request_id, list(range(start, start + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=0, **kw)


def run_step(s: Scheduler, token: int = 1) -> tuple[SchedulerOutput, list]:
    """Pretend the model ran: every request whose prefill finished samples ``token``."""
    out = s.schedule()
    sampled = [rid for rid, n in out.num_scheduled_tokens.items()
               if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens]
    result = ModelRunnerOutput(sampled, [token] * len(sampled), [])
    return out, s.update_from_output(out, result)


def test_prefill_then_decode_share_one_budget():
    s = make_scheduler(budget=10)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6, start=50))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}  # b's prefill is chunked
    assert [n.block_ids for n in out.new_requests] == [[0, 1], [2]]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}  # a decodes, b finishes its prefill
    assert out.cached_requests[1].new_block_ids == [3]
    assert out.cached_requests[1].num_computed_tokens == 4


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 3, start=10 * i))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert len(s.waiting) == 1


def test_requests_finish_at_max_tokens_and_free_every_block():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=3))
    outputs = []
    while s.has_unfinished_requests:
        outputs += run_step(s)[1]
    assert [o.new_token_ids for o in outputs] == [[1], [1], [1]]
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert s.kv.num_free_blocks == 16
    out = s.schedule()
    assert out.finished_request_ids == ["a"]  # the workers are told to forget it


def test_preemption_by_recompute_takes_newest_and_resumes_with_outputs():
    # 4 blocks of 2 tokens: two requests of 3 prompt tokens each need 2 blocks, then a third.
    s = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    s.add_request(req("old", 3, max_tokens=4))
    s.add_request(req("new", 3, max_tokens=4, start=20))
    run_step(s)  # both prefill: 2 blocks each, pool empty
    run_step(s)  # both decode their 4th token into their 2nd block
    out, _ = run_step(s)  # both need a 3rd block for their 5th token: "new" is preempted
    assert list(out.num_scheduled_tokens) == ["old"]
    assert out.cached_requests[0].new_block_ids == [3]  # "new" gave back 2, 3 tail first
    assert s.requests["new"].status == RequestStatus.PREEMPTED
    assert s.requests["new"].output_token_ids == [1, 1]
    assert s.num_preemptions == 1
    while s.requests.get("old"):
        run_step(s)
    out, _ = run_step(s)
    resumed = out.new_requests[0]
    assert resumed.request_id == "new" and resumed.output_token_ids == [1, 1]
    # prompt + the 2 tokens it produced = 5; its first block survived in the prefix cache
    assert resumed.num_computed_tokens == 2
    assert out.num_scheduled_tokens["new"] == 3


def test_request_that_can_never_fit_gets_an_error_not_a_hang():
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    s.add_request(req("big", 20))
    assert not s.has_unfinished_requests
    (err,) = s.take_rejected()
    assert err.finish_reason == FinishReason.REJECTED  # the client's input: the API answers 400
    assert "needs 6 KV blocks but the pool has only 2" in err.error


def test_prompt_at_max_model_len_is_rejected_with_the_limit():
    s = make_scheduler(max_model_len=16)
    s.add_request(req("long", 16))
    (err,) = s.take_rejected()
    assert "at most 15" in err.error and "max_model_len 16" in err.error


def test_abort_returns_blocks_and_tells_workers():
    s = make_scheduler()
    s.add_request(req("a", 9))
    s.add_request(req("b", 9, start=100))
    run_step(s)
    assert s.kv.num_free_blocks == 16 - 6
    (out,) = s.abort_requests(["a"])
    assert out.finish_reason == FinishReason.ABORT
    assert s.kv.num_free_blocks == 16 - 3
    assert s.schedule().finished_request_ids == ["a"]
    s.abort_requests(["b"])
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests


def test_prefix_cache_hit_is_reported_as_cached_tokens():
    s = make_scheduler(block_size=4)
    s.add_request(req("a", 9, max_tokens=1))
    while s.has_unfinished_requests:
        run_step(s)
    s.add_request(req("b", 10, max_tokens=1))  # shares a's first 8 tokens (two full blocks)
    out, outputs = run_step(s)
    assert out.new_requests[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 2}
    assert outputs[0].num_cached_tokens == 8


def test_priority_policy_admits_lowest_value_first():
    s = make_scheduler(max_seqs=1, policy="priority")
    s.add_request(req("late", 3, priority=5, arrival_time=1.0))
    s.add_request(req("urgent", 3, start=40, priority=0, arrival_time=2.0))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["urgent"]


def test_drop_all_forgets_requests_and_kv_state():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=8))
    run_step(s)
    s.drop_all()
    assert not s.has_unfinished_requests and s.requests == {}
    assert s.kv.num_free_blocks == 16 and s.kv.pool.cached == {}
    # The same id can be added again (a resubmission after recovery).
    s.add_request(req("a", 5, max_tokens=8))
    out, _ = run_step(s)
    assert out.new_requests[0].request_id == "a" and out.num_scheduled_tokens == {"a": 5}


# ------------------------------------------------------------------- async scheduling


def sampled_by(s: Scheduler, out: SchedulerOutput) -> list[str]:
    """Requests that sample a token in ``out`` (their computed tokens reach the end, counting
    the tokens still in flight)."""
    return [rid for rid in out.num_scheduled_tokens
            if s.requests[rid].num_computed_tokens
            == s.requests[rid].num_tokens + s.requests[rid].num_output_placeholders - 1]


def test_async_step_is_scheduled_before_the_previous_tokens_arrive():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=3))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 5}
    assert sampled_by(s, first) == ["a"]
    # Step 2 goes out before step 1's token is known: it feeds that token (a placeholder).
    second = s.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.cached_requests[0].num_computed_tokens == 5
    assert s.requests["a"].num_output_placeholders == 2
    outputs = s.update_from_output(first, ModelRunnerOutput(["a"], [7], []))
    assert [o.new_token_ids for o in outputs] == [[7]]
    assert s.requests["a"].all_token_ids[-1] == 7
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    # Three tokens are now produced or in flight: a fourth step would pass max_tokens.
    assert s.schedule().num_scheduled_tokens == {}
    s.update_from_output(second, ModelRunnerOutput(["a"], [8], []))
    outputs = s.update_from_output(third, ModelRunnerOutput(["a"], [9], []))
    assert outputs[0].finish_reason == FinishReason.LENGTH
    assert not s.has_unfinished_requests
    assert s.kv.num_free_blocks == 16


def test_async_request_finished_early_drops_the_token_in_flight():
    s = make_scheduler()
    r = req("a", 3, max_tokens=10)
    r.sampling_params.stop_token_ids.append(5)
    s.add_request(r)
    first, second = s.schedule(), s.schedule()
    outputs = s.update_from_output(first, ModelRunnerOutput(["a"], [5], []))
    assert outputs[0].finish_reason == FinishReason.STOP
    assert s.kv.num_free_blocks == 16
    assert s.update_from_output(second, ModelRunnerOutput(["a"], [6], [])) == []
    assert s.schedule().finished_request_ids == ["a"]


def test_async_preempted_request_keeps_its_token_in_flight():
    # 4 blocks of 4 tokens: a (4 prompt tokens) and b (8) fill 3; a's decode needs a new block,
    # b's as well, so scheduling the next step preempts b while b's token is in flight.
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add_request(req("a", 4, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, start=50))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 4, "b": 8}
    second = s.schedule()  # a takes the last free block; b (newest) is preempted
    assert second.num_scheduled_tokens == {"a": 1}
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert second.finished_request_ids == ["b"]
    assert s.schedule().num_scheduled_tokens == {"a": 1}  # b waits for its token first
    s.update_from_output(first, ModelRunnerOutput(["a", "b"], [3, 4], []))
    assert s.requests["b"].output_token_ids == [4]
    assert s.requests["b"].num_output_placeholders == 0
    # b resumes with that token once a leaves room; its prompt blocks come from the cache.
    s.abort_requests(["a"])
    resumed = s.schedule()
    assert resumed.num_scheduled_tokens == {"b": 1}
    assert resumed.new_requests[0].num_computed_tokens == 8
    assert resumed.new_requests[0].output_token_ids == [4]


def test_async_token_in_flight_never_reaches_a_new_request_with_the_same_id():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=8))
    first, second = s.schedule(), s.schedule()
    s.abort_requests(["a"])
    s.add_request(req("a", 3, max_tokens=8, start=40))  # the id is free again
    third = s.schedule()
    assert third.new_requests[0].prompt_token_ids == [40, 41, 42]
    assert s.update_from_output(first, ModelRunnerOutput(["a"], [7], [])) == []
    assert s.update_from_output(second, ModelRunnerOutput(["a"], [8], [])) == []
    outputs = s.update_from_output(third, ModelRunnerOutput(["a"], [9], []))
    assert [o.new_token_ids for o in outputs] == [[9]]
    assert s.requests["a"].output_token_ids == [9]
    assert s.requests["a"].num_output_placeholders == 0


def test_prompt_over_the_budget_without_chunked_prefill_is_rejected():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False),
                  CacheConfig(block_size=4), 16, 64)
    s.add_request(req("a", 9))
    s.add_request(req("b", 8, start=20))
    [rejected] = s.take_rejected()
    assert rejected.request_id == "a" and rejected.finish_reason == FinishReason.REJECTED
    assert "chunked prefill off" in rejected.error and "at most 8" in rejected.error
    assert s.schedule().num_scheduled_tokens == {"b": 8}


def test_first_output_carries_queue_and_prefill_time_and_stats_the_step_sizes(monkeypatch):
    clock = iter([100.0, 101.5, 104.0, 105.0])  # queued, first scheduled, first token, ...
    monkeypatch.setattr("bastion.core.request.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("bastion.core.scheduler.time.monotonic", lambda: next(clock))
    s = make_scheduler(budget=10)
    s.add_request(req("a", 6, max_tokens=2))
    _, first = run_step(s)
    _, second = run_step(s)
    assert (first[0].queue_time_s, first[0].prefill_time_s) == (1.5, 2.5)
    assert (second[0].queue_time_s, second[0].prefill_time_s) == (0.0, 0.0)
    stats = s.make_stats()
    assert stats.iteration_tokens == [6, 1] and stats.num_gpu_blocks == 16
    assert s.make_stats().iteration_tokens == []  # deltas: each step is reported once
def test_request_whose_deadline_passed_on_the_way_is_answered_without_a_prefill():
    s = make_scheduler()
    s.add_request(req("late", 4, deadline=time.time() - 1e-3))
    s.add_request(req("on_time", 4, deadline=time.time() + 60))
    assert list(s.requests) == ["on_time"]
    (late,) = s.take_rejected()
    assert (late.request_id, late.finish_reason) == ("late", FinishReason.TIMEOUT)
    assert "deadline passed" in late.error
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"on_time"}
