"""Decode attention on the CUDA cores: one new token per sequence, no tensor-core dots.

A decode token's query is a handful of rows (the query heads of one KV head: 2 for Qwen3-0.6B,
4 for Llama-3.1-8B), so the tensor-core kernel's dots run mostly padding and stage every K/V
tile through shared memory for them. Here K/V tiles stay in registers: ``q . k`` is a product
and a sum over the head dim within each warp, and ``p v`` is accumulated element-wise.

Softmax is online per *key slot*: the ``TILE`` positions of a tile are ``TILE`` independent
streams (slot ``j`` sees keys ``j, j + TILE, ...``), each with its own running max, sum and
output row, so the loop needs no reduction across the tile (no shared memory, no barrier).
The streams merge once at the end, exactly as flash-decoding merges splits. Across splits the
partials have the same form as the tensor-core kernel's, and the same merge kernel combines
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from bastion.ops.triton.attention_reduce import merge_attention_splits_triton

if TYPE_CHECKING:
    from bastion.core.forward_context import AttentionMetadata


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_attention_kernel(
    out_ptr,  # [T, Hq, D], written when NUM_SPLITS == 1
    part_out_ptr,  # [T, Hq, NUM_SPLITS, HEAD_PAD] float32, written when NUM_SPLITS > 1
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] float32: running max (log2 domain), running sum
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_blk,
    stride_k_off,
    stride_k_h,
    stride_v_blk,
    stride_v_off,
    stride_v_h,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    # NOTE: CUDA-graph padding rows own no token (query_start_loc repeats); nothing to do.
    if tl.load(query_start_loc_ptr + seq_idx + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)

    # Everything is laid out as [GROUP_PAD, TILE, HEAD_PAD] or a slice of it, so the loop needs
    # no layout conversion.
    offs_g = tl.arange(0, GROUP_PAD)[:, None, None]
    offs_t = tl.arange(0, TILE)[None, :, None]
    offs_d = tl.arange(0, HEAD_PAD)[None, None, :]
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q_tok = q_start.to(tl.int64)
    head = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + q_tok * stride_q_t + head * stride_q_h + offs_d, mask=g_ok & d_ok,
                other=0.0).to(tl.float32) * scale_log2  # [G, 1, D]

    num_tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m = tl.full([GROUP_PAD, TILE], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD, TILE], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, TILE, HEAD_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE + offs_t  # [1, T, 1]
        k_ok = k_pos < seq_len
        blk = tl.load(bt_row + k_pos // KV_BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_blk = (k_pos % KV_BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_cache_ptr + blk * stride_k_blk + in_blk * stride_k_off
                    + kv_head * stride_k_h + offs_d, mask=k_ok & d_ok, other=0.0)
        v = tl.load(v_cache_ptr + blk * stride_v_blk + in_blk * stride_v_off
                    + kv_head * stride_v_h + offs_d, mask=k_ok & d_ok, other=0.0)
        s = tl.sum(q * k.to(tl.float32), axis=2)  # [G, T], log2 domain
        s = tl.where(tl.sum(k_ok.to(tl.int32), axis=2) > 0, s, float("-inf"))
        m_new = tl.maximum(m, s)
        # A slot with no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe)
        l = l * alpha + p
        acc = acc * alpha[:, :, None] + p[:, :, None] * v.to(tl.float32)
        m = m_new

    # Merge the TILE streams.
    m_row = tl.max(m, axis=1)  # [G]
    m_row_safe = tl.where(m_row > float("-inf"), m_row, 0.0)
    w = tl.exp2(m - m_row_safe[:, None])  # [G, T]: 0 for slots that saw no key
    l_row = tl.sum(l * w, axis=1)
    o = tl.sum(acc * w[:, :, None], axis=1)  # [G, D]
    g2 = tl.arange(0, GROUP_PAD)[:, None]
    d2 = tl.arange(0, HEAD_PAD)[None, :]
    head2 = kv_head * GROUP + g2
    ok2 = (g2 < GROUP) & (d2 < HEAD_DIM)
    if NUM_SPLITS == 1:
        o = o / tl.where(l_row > 0.0, l_row, 1.0)[:, None]
        tl.store(out_ptr + q_tok * stride_o_t + head2 * stride_o_h + d2,
                 o.to(out_ptr.dtype.element_ty), mask=ok2)
    else:
        # NOTE: every split stores, even one with no tiles (m = -inf, l = 0): the merge reads all.
        g1 = tl.arange(0, GROUP_PAD)
        row = (q_tok * tl.num_programs(1) * GROUP + kv_head * GROUP + g1) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_PAD + d2, o, mask=g2 < GROUP)
        tl.store(part_ml_ptr + row * 2, m_row, mask=g1 < GROUP)
        tl.store(part_ml_ptr + row * 2 + 1, l_row, mask=g1 < GROUP)


def decode_attention_cores_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int,
    *,
    tile: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of a decode batch (one new token per sequence, ``query`` [B, Hq, D]) over the
    paged cache, whose K/V of the new tokens are already stored; returns [B, Hq, D]. Rows of
    padding sequences (no token in ``query_start_loc``) are left unwritten."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = meta.seq_lens.shape[0]
    if meta.max_query_len > 1 or num_tokens != num_seqs:
        raise ValueError("decode attention takes exactly one new token per sequence")
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, head_pad),
                               dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32,
                              device=query.device)
    else:
        part_out = part_ml = out  # unused by the kernel
    bt = meta.block_tables
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_ml, query, k_cache, v_cache, bt, meta.seq_lens,
        meta.query_start_loc, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, TILE=tile, KV_BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_attention_splits_triton(out, part_out, part_ml, meta.query_start_loc, num_seqs)
    return out
