"""The model runner's flat batch for eager (prefill and mixed) steps, checked value by value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from bastion.core.config import build_engine_config
from bastion.core.model_runner import CachedRequestState, ModelRunner
from bastion.ipc.messages import SamplingParams, SchedulerOutput


def _runner(max_num_batched_tokens: int = 64) -> ModelRunner:
    config = build_engine_config(device="cpu", max_num_seqs=4,
                                 max_num_batched_tokens=max_num_batched_tokens)
    runner = ModelRunner(config)
    runner.max_model_len = 256
    return runner


def _state(rid: str, tokens: list[int], computed: int, blocks: list[int]) -> CachedRequestState:
    state = CachedRequestState(rid, tokens, SamplingParams(), [], computed, [], list(tokens))
    state.append_blocks(blocks)
    return state


def test_mixed_step_inputs_exactly():
    runner = _runner()
    bs = runner.block_size
    # "a": a prompt of 40 tokens, 16 already cached; this step computes 20 more (a chunk).
    # "b": decoding; 33 tokens known, its 34th still in flight as row 2 of the last step.
    # "c": a 3-token prompt computed whole; it samples.
    a = _state("a", list(range(100, 140)), 16, [7, 3, 9])
    b = _state("b", list(range(200, 233)), 33, [5, 6, 11])
    b.num_pending, b.pending_row = 1, 2
    c = _state("c", [1, 2, 3], 0, [4, 8])  # a spare block, allocated ahead
    runner.requests = {"a": a, "b": b, "c": c}
    sched = SchedulerOutput(num_scheduled_tokens={"a": 20, "b": 1, "c": 3},
                            total_num_scheduled_tokens=24)
    prev = torch.tensor([50, 51, 52, 53])
    batch = runner._prepare_inputs(sched, prev)

    assert batch.input_ids.tolist() == list(range(116, 136)) + [52] + [1, 2, 3]
    positions = list(range(16, 36)) + [33] + [0, 1, 2]
    assert batch.positions.tolist() == positions
    a_slots = [(7, 3, 9)[p // bs] * bs + p % bs for p in range(16, 36)]
    assert batch.meta.slot_mapping.tolist() == a_slots + [11 * bs + 1] + [4 * bs, 4 * bs + 1,
                                                                          4 * bs + 2]
    # Only the blocks each context occupies: 36 tokens -> 3, 34 -> 3, 3 -> 1.
    assert batch.meta.block_tables.tolist() == [[7, 3, 9], [5, 6, 11], [4, 0, 0]]
    assert batch.meta.query_start_loc.tolist() == [0, 20, 21, 24]
    assert batch.meta.query_start_loc_cpu == [0, 20, 21, 24]
    assert batch.meta.seq_lens.tolist() == [36, 34, 3]
    assert batch.meta.seq_lens_cpu == [36, 34, 3]
    assert (batch.meta.max_query_len, batch.meta.max_seq_len) == (20, 36)
    # "a" is mid-prompt: no token yet; "b" and "c" sample from their last rows.
    assert batch.logits_indices.tolist() == [20, 23]
    assert batch.sample_ids == ["b", "c"]
    # Every tensor a kernel receives starts 16-byte aligned (Triton specialises on it).
    tensors = [batch.input_ids, batch.positions, batch.logits_indices, batch.meta.slot_mapping,
               batch.meta.query_start_loc, batch.meta.seq_lens, batch.meta.block_tables]
    assert [t.data_ptr() % 16 for t in tensors] == [0] * len(tensors)


def test_a_context_beyond_its_blocks_is_refused():
    # 40 tokens need 3 blocks of 16; the runner holds one. Its table's spare entries are zeros,
    # so building the step would write keys into block 0, another request's block.
    runner = _runner()
    runner.requests = {"a": _state("a", list(range(40)), 0, [5])}
    sched = SchedulerOutput(num_scheduled_tokens={"a": 40}, total_num_scheduled_tokens=40)
    with pytest.raises(RuntimeError, match="request a needs 3 KV blocks for this step but holds 1"):
        runner._prepare_inputs(sched, None)


def test_decode_batch_runs_longest_context_first():
    runner = _runner()
    runner.graph_runner = SimpleNamespace(can_run=lambda num_seqs, width: True)
    bs = runner.block_size
    short = _state("short", [1, 2, 3], 2, [4])
    long = _state("long", list(range(40)), 39, [7, 3, 9])
    mid = _state("mid", list(range(20)), 19, [6, 2])
    mid.num_pending, mid.pending_row = 1, 0  # its 21st token is row 0 of the last step
    mid.num_computed_tokens = 20
    runner.requests = {"short": short, "long": long, "mid": mid}
    sched = SchedulerOutput(num_scheduled_tokens={"short": 1, "long": 1, "mid": 1},
                            total_num_scheduled_tokens=3)
    states, inputs = runner._prepare_decode(sched)
    assert [s.request_id for s in states] == ["long", "mid", "short"]
    assert inputs.positions.tolist() == [39, 20, 2]
    assert inputs.input_ids.tolist() == [39, 0, 3]  # mid's token is read on the device
    assert inputs.pending_rows.tolist() == [-1, 0, -1]
    assert inputs.slot_mapping.tolist() == [9 * bs + 7, 2 * bs + 4, 4 * bs + 2]
    assert inputs.block_tables.tolist() == [[7, 3, 9], [6, 2, 0], [4, 0, 0]]


def test_staging_buffers_rotate_without_touching_earlier_batches():
    runner = _runner(max_num_batched_tokens=8)
    runner.requests = {"x": _state("x", list(range(30)), 0, [1, 2])}
    batches = []
    for start in (0, 8, 16):  # three chunks of 8: the third reuses the first buffer set
        runner.requests["x"].num_computed_tokens = start
        sched = SchedulerOutput(num_scheduled_tokens={"x": 8}, total_num_scheduled_tokens=8)
        batches.append(runner._prepare_inputs(sched, None))
    assert [b.input_ids.tolist() for b in batches] == [list(range(s, s + 8)) for s in (0, 8, 16)]
    # A step larger than the buffers were sized for grows them.
    runner.requests["x"].num_computed_tokens = 0
    sched = SchedulerOutput(num_scheduled_tokens={"x": 30}, total_num_scheduled_tokens=30)
    big = runner._prepare_inputs(sched, None)
    assert big.positions.tolist() == list(range(30))
    assert big.meta.block_tables.tolist() == [[1, 2]]
    assert big.logits_indices.tolist() == [29]
    assert batches[0].input_ids.tolist() == list(range(8))


def test_padding_rows_follow_the_step_and_belong_to_no_sequence():
    """A coupled DP group's agreed row count: rows past the step's tokens are id 0, position 0,
    slot -1 (stored nowhere), and the query starts still end at the real tokens (the MoE
    layers read that count to route the padding to no expert)."""
    runner = _runner()
    runner.requests = {"c": _state("c", [1, 2, 3], 0, [4])}
    sched = SchedulerOutput(num_scheduled_tokens={"c": 3}, total_num_scheduled_tokens=3,
                            num_padded_tokens=8)
    batch = runner._prepare_inputs(sched, None, num_rows=8)
    bs = runner.block_size
    assert batch.input_ids.tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert batch.meta.slot_mapping.tolist() == [4 * bs, 4 * bs + 1, 4 * bs + 2] + [-1] * 5
    assert batch.meta.query_start_loc.tolist() == [0, 3]
    assert batch.logits_indices.tolist() == [2]


def test_a_forward_that_cannot_be_captured_runs_eager_with_one_warning(monkeypatch, caplog):
    runner = _runner()
    runner.use_cuda_graphs = True

    def capture() -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "_allocate_kv_cache", lambda num_blocks: None)
    monkeypatch.setattr(runner, "build_graph_runner", lambda: SimpleNamespace(capture=capture))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with caplog.at_level("WARNING", logger="bastion.core.model_runner"):
        runner.initialize_kv_cache(16)
    assert runner.graph_runner is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["CUDA graph capture failed (RuntimeError: CUDA error: operation not "
                        "permitted when stream is capturing); decode runs eager"]


@pytest.mark.parametrize(("fields", "expected"), [
    ({"temperature": 0.0}, 0.0),
    ({"temperature": 0.7}, 0.7),
    ({"temperature": 0.7, "top_k": -1}, 0.7),
    ({"temperature": 0.7, "top_p": 0.9}, None),
    ({"temperature": 0.7, "top_k": 5}, None),
    ({"temperature": 0.7, "min_p": 0.1}, None),
    ({"temperature": 0.7, "seed": 3}, None),
    ({"temperature": 0.7, "logprobs": 0}, None),
    ({"temperature": 0.0, "logprobs": 2}, None),
    ({"temperature": 0.7, "repetition_penalty": 1.1}, None),
    ({"temperature": 0.0, "presence_penalty": 0.5}, None),
    ({"temperature": 0.7, "min_tokens": 2}, None),
    ({"temperature": 0.7, "logit_bias": {5: 1.0}}, None),
])
def test_plain_temperature_says_which_rows_a_sampling_graph_may_draw(fields, expected):
    """A captured sampling graph draws a row only when the fused kernel would draw it as it
    is (greedy: 0.0; a temperature alone: that temperature); every processor, logprobs or a
    seed of its own sends the step to the eager sampler (None)."""
    from bastion.core.model_runner import _plain_temperature

    assert _plain_temperature(SamplingParams(**fields)) == expected
