"""The CPU's C kernels (ops/cpu) against the torch code they replace: decode attention over
the paged cache, rotary + KV store, greedy argmax, and the fallback when a kernel cannot be built."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from bastion.core.forward_context import build_attention_metadata
from bastion.ops import attention as attention_ops
from bastion.ops.attention import paged_attention, paged_attention_ref
from bastion.ops.cpu import load_cpu_kernel
from bastion.ops.cpu import paged_attention as cpu_attention
from bastion.ops.cpu import rotary as cpu_rotary
from bastion.ops.cpu.argmax import argmax_rows
from bastion.ops.rotary import apply_rotary_emb, apply_rotary_emb_ref

has_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                  reason="no C compiler")


def _cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _scattered_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                      shared: int) -> list[list[int]]:
    """Shuffled block ids; sequences 0 and 1 share their first ``shared`` blocks (a cached
    prefix), the rest own theirs."""
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    tables = []
    for i, length in enumerate(seq_lens):
        n = -(-length // block_size)
        table = tables[0][:shared] if i == 1 else []
        tables.append(table + [free.pop() for _ in range(n - len(table))])
    return tables


@has_compiler
def test_the_kernel_builds_where_a_compiler_is() -> None:
    assert load_cpu_kernel("paged_attention") is not None


@has_compiler
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4), (6, 2, 80, 1)])
def test_decode_matches_reference_over_scattered_and_shared_blocks(
        num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Lengths on and either side of a block boundary, a 1-token context, a long one; two
    sequences reading the same prefix blocks; GQA groups of 3, 1 (MHA), 8 and 3."""
    seq_lens = [2 * block_size + 3, 2 * block_size + 1, 1, block_size, block_size + 1, 397, 64]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 7
    tables = _scattered_tables(seq_lens, block_size, num_blocks, shared=2)
    assert tables[0][:2] == tables[1][:2]
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim)
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator()
                        .manual_seed(2))
    assert cpu_attention.can_run(query, k_cache, v_cache)
    scale = head_dim ** -0.5
    out = paged_attention(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, paged_attention_ref(query, k_cache, v_cache, meta, scale),
                               rtol=1e-5, atol=1e-6)


@has_compiler
def test_mixed_step_takes_prefill_rows_from_the_reference_and_zeroes_padding() -> None:
    """Decodes between a prefill from scratch and a chunk over a cached prefix, then two padding
    rows that belong to no sequence."""
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    seq_lens, query_lens = [7, 9, 13, 20, 3], [1, 9, 5, 1, 1]
    tables = _scattered_tables(seq_lens, block_size, 40, shared=0)
    k_cache, v_cache = _cache(40, block_size, num_kv_heads, head_dim)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    assert meta.decode_seq_ids == [0, 3, 4]
    query = torch.randn(sum(query_lens) + 2, num_heads, head_dim)
    out = paged_attention(query, k_cache, v_cache, meta, 0.3)
    expected = paged_attention_ref(query, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1:15], expected[1:15])  # the prefill rows: the same code
    assert not out[-2:].any()


def test_without_the_kernel_every_row_takes_the_reference(monkeypatch) -> None:
    block_size = 4
    seq_lens = [5, 11]
    tables = _scattered_tables(seq_lens, block_size, 8, shared=0)
    k_cache, v_cache = _cache(8, block_size, 2, 8)
    meta = build_attention_metadata([1, 1], seq_lens, tables, block_size)
    query = torch.randn(2, 4, 8)
    monkeypatch.setattr(cpu_attention, "_kernel", lambda: None)
    calls = []
    reference = attention_ops.paged_attention_ref
    monkeypatch.setattr(attention_ops, "paged_attention_ref",
                        lambda *a: calls.append(1) or reference(*a))
    out = paged_attention(query, k_cache, v_cache, meta, 0.5)
    assert calls and torch.equal(out, reference(query, k_cache, v_cache, meta, 0.5))


def test_bfloat16_caches_take_the_reference() -> None:
    k_cache, v_cache = _cache(4, 4, 1, 8)
    assert not cpu_attention.can_run(torch.randn(1, 2, 8, dtype=torch.bfloat16),
                                     k_cache.bfloat16(), v_cache.bfloat16())


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert load_cpu_kernel.__wrapped__("paged_attention") is None
    assert "using the torch reference" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


def test_kernels_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("BASTION_CPU_KERNELS", "0")
    assert load_cpu_kernel.__wrapped__("paged_attention") is None


@has_compiler
def test_argmax_is_torchs_on_ties_nans_infinities_and_strided_rows() -> None:
    logits = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 4000]] = 1e9  # a tie: the first index
    logits[2, [300, 20]] = float("nan")  # NaN beats everything: the first NaN
    logits[3] = float("-inf")
    logits[4, :100] = float("-inf")  # masked tokens (a grammar) before the maximum
    logits[5, 64] = float("inf")
    logits[6, -1] = 1e9  # the last column, past the last full chunk of 64
    logits[7, 1:] = logits[7, 0]  # all equal
    for rows in (logits, logits[:, :1000], logits[::2]):  # contiguous, row-strided
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    assert argmax_rows(logits[:, ::2]).tolist() == logits[:, ::2].argmax(dim=-1).tolist()
    assert argmax_rows(torch.empty(0, 5)).shape == (0,)


@has_compiler
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_and_store_are_the_references_bit_for_bit(rotary_dim: int) -> None:
    """Queries, keys and values as strided views of one fused QKV output; a padding token
    (slot -1) stores nothing."""
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 9, 3, 64
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    positions = torch.tensor([0, 17, 300, 5, 0])
    freqs = torch.outer(torch.arange(512.0), 1e4 ** -(torch.arange(0, rotary_dim, 2) / rotary_dim))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    slots = torch.tensor([3, 40, 41, 9, -1])
    caches = [torch.zeros(4, 16, num_kv_heads, head_dim) for _ in range(4)]
    fused = dict(value=v, slot_mapping=slots)
    assert cpu_rotary.can_run(q, k, True, fused)
    out = apply_rotary_emb(positions, q, k, cos_sin, head_dim, k_cache=caches[0],
                           v_cache=caches[1], **fused)
    ref = apply_rotary_emb_ref(positions, q, k, cos_sin, head_dim, k_cache=caches[2],
                               v_cache=caches[3], **fused)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int(caches[0].view(-1, num_kv_heads * head_dim).any(-1).sum()) == 4
    without_store = apply_rotary_emb(positions, q, k, cos_sin, head_dim)
    assert torch.equal(without_store[0], ref[0]) and torch.equal(without_store[1], ref[1])


def test_rotary_with_qk_norms_takes_the_reference() -> None:
    q, k = torch.randn(2, 16), torch.randn(2, 8)
    assert not cpu_rotary.can_run(q, k, True, {"q_weight": torch.ones(8)})
    assert not cpu_rotary.can_run(q, k, False, {})
    assert not cpu_rotary.can_run(q.bfloat16(), k.bfloat16(), True, {})
