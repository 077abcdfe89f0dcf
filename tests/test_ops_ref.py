"""The torch reference ops (the CPU serving path) against plain, independent computations."""

from __future__ import annotations

import math

import bastion.ops.attention as attention_ops
import pytest
import torch
from bastion.core.forward_context import build_attention_metadata
from bastion.ops.activation import silu_and_mul
from bastion.ops.attention import paged_attention
from bastion.ops.communicator import GroupCoordinator, get_ep_group, get_tp_group
from bastion.ops.kv_store import store_kvcache
from bastion.ops.layernorm import fused_add_rms_norm, rms_norm
from bastion.ops.moe import fused_moe
from bastion.ops.rotary import apply_rotary_emb


def test_store_kvcache_writes_slots_and_skips_padding() -> None:
    k_cache = torch.zeros(6, 4, 2, 3)
    v_cache = torch.zeros(6, 4, 2, 3)
    key, value = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    slots = torch.tensor([21, -1, 2, 13])  # block 5 offset 1, padding, block 0 offset 2, 3/1
    store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[5, 1], key[0]) and torch.equal(v_cache[5, 1], value[0])
    assert torch.equal(k_cache[0, 2], key[2]) and torch.equal(v_cache[3, 1], value[3])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3  # nothing else was written


def _dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """q [q_len, Hq, D] = the LAST q_len tokens of a context k/v [S, Hk, D]; explicit loops."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for t in range(q_len):
        pos = seq_len - q_len + t
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            scores = (k[: pos + 1, kv] @ q[t, h]) * scale
            out[t, h] = torch.softmax(scores, dim=0) @ v[: pos + 1, kv]
    return out


@pytest.mark.parametrize("cpu_kernels,gather_limit", [("1", None), ("0", None), ("0", 64)])
def test_paged_attention_mixed_batch_matches_dense(monkeypatch, cpu_kernels: str,
                                                  gather_limit: int | None) -> None:
    """Prefill from scratch, a chunk over a cached prefix, and decodes in one batch; GQA 6/2;
    scattered blocks. The decode rows through the C kernel (where there is a compiler) and
    through the torch reference, which ``gather_limit`` forces to work in small chunks."""
    monkeypatch.setenv("BASTION_CPU_KERNELS", cpu_kernels)
    if gather_limit is not None:
        monkeypatch.setattr(attention_ops, "_MAX_GATHER_ELEMENTS", gather_limit)
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    seq_lens, query_lens = [9, 13, 20, 3, 17], [9, 5, 1, 1, 1]
    order = torch.randperm(40).tolist()
    tables = [[order.pop() for _ in range(math.ceil(s / block_size))] for s in seq_lens]
    keys = [torch.randn(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim) for s in seq_lens]
    k_cache = torch.zeros(40, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # the cached prefixes were stored by earlier steps ...
    prefix = build_attention_metadata([s - q for s, q in zip(seq_lens, query_lens) if s > q],
                                      [s - q for s, q in zip(seq_lens, query_lens) if s > q],
                                      [t for t, s, q in zip(tables, seq_lens, query_lens) if s > q],
                                      block_size)
    store_kvcache(torch.cat([k[: s - q] for k, s, q in zip(keys, seq_lens, query_lens)]),
                  torch.cat([v[: s - q] for v, s, q in zip(values, seq_lens, query_lens)]),
                  k_cache, v_cache, prefix.slot_mapping)
    # ... and this step stores its new tokens first, then attends.
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    store_kvcache(torch.cat([k[s - q:] for k, s, q in zip(keys, seq_lens, query_lens)]),
                  torch.cat([v[s - q:] for v, s, q in zip(values, seq_lens, query_lens)]),
                  k_cache, v_cache, meta.slot_mapping)
    query = torch.randn(sum(query_lens), num_heads, head_dim)
    out = paged_attention(query, k_cache, v_cache, meta, scale=0.3)
    starts = meta.query_start_loc_cpu
    for i in range(len(seq_lens)):
        expected = _dense_causal_attention(query[starts[i]:starts[i + 1]], keys[i], values[i], 0.3)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_and_fused_add() -> None:
    torch.manual_seed(0)
    x, residual, weight = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), expected)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, rms_norm(x + residual, weight, 1e-5))
    half = rms_norm(x.bfloat16(), weight, 1e-5)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), expected, rtol=2e-2, atol=2e-2)


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_rotary_neox_matches_rotate_half(rotary_dim: int) -> None:
    """Hugging Face Llama's formula ``x * cos + rotate_half(x) * sin`` on the rotary dims;
    the remaining dims (partial rotary) pass through."""
    torch.manual_seed(0)
    head_dim, positions = 8, torch.tensor([0, 3, 7, 31])
    query, key = torch.randn(4, 3 * head_dim), torch.randn(4, 1 * head_dim)
    cache = _cos_sin_cache(32, rotary_dim)
    got_q, got_k = apply_rotary_emb(positions, query, key, cache, head_dim, is_neox_style=True)

    def reference(x: torch.Tensor) -> torch.Tensor:
        heads = x.view(4, -1, head_dim)
        rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
        cos, sin = cache[positions].chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat((rotated, rest), -1).reshape(4, -1)

    torch.testing.assert_close(got_q, reference(query))
    torch.testing.assert_close(got_k, reference(key))
    assert torch.equal(got_q.view(4, 3, 8)[0], query.view(4, 3, 8)[0])  # position 0: identity


def test_rotary_gptj_style_is_complex_rotation() -> None:
    torch.manual_seed(0)
    positions = torch.tensor([1, 5])
    query, key = torch.randn(2, 8), torch.randn(2, 8)
    cache = _cos_sin_cache(8, 8)
    got_q, _ = apply_rotary_emb(positions, query, key, cache, 8, is_neox_style=False)
    cos, sin = cache[positions].chunk(2, dim=-1)
    angle = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))
    expected = torch.view_as_real(torch.view_as_complex(query.view(2, 4, 2)) * angle)
    torch.testing.assert_close(got_q, expected.reshape(2, 8))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    a, b = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_and_mul(x), a * torch.sigmoid(a) * b)


def _moe_reference(hidden, w13, w2, topk_weights, topk_ids):
    out = torch.zeros_like(hidden)
    inter = w2.shape[-1]
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = w13[e, :inter] @ hidden[t], w13[e, inter:] @ hidden[t]
            out[t] += topk_weights[t, k] * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    return out


def test_fused_moe_matches_per_token_loop_and_splits_over_experts() -> None:
    torch.manual_seed(0)
    num_experts, hidden_size, inter = 6, 8, 5
    hidden = torch.randn(7, hidden_size)
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden_size), torch.randn(num_experts,
                                                                            hidden_size, inter)
    topk_weights = torch.rand(7, 2)
    topk_ids = torch.stack([torch.randperm(num_experts)[:2] for _ in range(7)])
    expected = _moe_reference(hidden, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(fused_moe(hidden, w13, w2, topk_weights, topk_ids), expected)
    # expert parallel: two ranks with 3 experts each; each contributes only its own experts
    low = fused_moe(hidden, w13[:3], w2[:3], topk_weights, topk_ids, expert_offset=0)
    high = fused_moe(hidden, w13[3:], w2[3:], topk_weights, topk_ids, expert_offset=3)
    assert not torch.allclose(low, expected)
    torch.testing.assert_close(low + high, expected)


def test_single_rank_groups_are_identity() -> None:
    x = torch.randn(4, 6)
    for group in (GroupCoordinator(), get_tp_group(), get_ep_group()):
        assert group.world_size == 1 and group.rank == 0
        assert group.all_reduce(x) is x
        assert group.all_gather(x, dim=-1) is x and group.reduce_scatter(x, dim=0) is x
    with pytest.raises(ValueError, match="needs a torch.distributed group"):
        GroupCoordinator(rank=0, world_size=2)


TWO_RANK_CONFIGS = [("tp", "qwen3_moe"), ("tp", "qwen2"), ("ep", "qwen3_moe")]


def _two_rank_worker(rank: int, port: int, queue) -> None:
    import os

    import torch.distributed as dist
    from bastion.core.forward_context import build_attention_metadata, set_forward_context
    from bastion.core.models.registry import get_model_class
    from bastion.ops.communicator import destroy_model_parallel, init_model_parallel

    from tests.conftest import build_tiny_hf_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for mode, kind in TWO_RANK_CONFIGS:
        group = dist.new_group([0, 1])
        init_model_parallel(group, None) if mode == "tp" else init_model_parallel(None, group)
        hf_model = build_tiny_hf_model(kind)
        model = get_model_class(type(hf_model).__name__)(hf_model.config, torch.float32)
        model.load_weights(hf_model.state_dict().items())
        # Under EP the ranks hold different numbers of tokens (DP ranks with different
        # batches), padded to one row count as a coupled DP group does: rank 1's last two rows
        # are padding past the forward context's tokens, and choose no expert.
        ids = torch.tensor([5, 17, 99, 3, 250, 42, 7])
        num_real = 7 - 2 * rank if mode == "ep" else 7
        meta = build_attention_metadata([num_real], [num_real], [[0]], block_size=8)
        with torch.no_grad(), set_forward_context(meta):
            logits = model.compute_logits(model(ids, torch.arange(len(ids))))[:num_real]
        with torch.no_grad():
            expected = hf_model(ids[None, :num_real]).logits[0]
        queue.put((mode, kind, float((logits - expected).abs().max())))
        destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_errors() -> dict[tuple[str, str], list[float]]:
    """Every config of ``TWO_RANK_CONFIGS`` in one pair of spawned ranks (a spawn costs
    seconds of imports): each rank's largest logit error, by (mode, kind)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    errors: dict[tuple[str, str], list[float]] = {}
    for _ in range(2 * len(TWO_RANK_CONFIGS)):
        mode, kind, error = queue.get(timeout=5)
        errors.setdefault((mode, kind), []).append(error)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("mode,kind", TWO_RANK_CONFIGS)
def test_two_rank_sharded_model_matches_transformers(two_rank_errors, mode: str,
                                                     kind: str) -> None:
    """TP=2 (heads, MLP columns/rows, vocab, expert intermediate dims) and EP=2 (whole experts,
    uneven token counts) over gloo give the single-device logits."""
    errors = two_rank_errors[(mode, kind)]
    assert len(errors) == 2 and max(errors) < 1e-4, errors
