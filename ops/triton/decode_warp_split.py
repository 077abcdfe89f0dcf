"""Decode attention with the key tile split between the warps, each keeping its own softmax.

In the unified kernel a decode program's [rows, keys] score tile is spread over its warps along
the keys, so the online softmax's row max and row sum cross warps (shared memory and a barrier)
at every tile: measured, that softmax costs 10-15 % of decode attention's time beyond the
loads and the two dots. Here the ``TILE`` keys of a step are ``WARP_SPLITS`` groups of
``TILE // WARP_SPLITS`` consecutive keys, computed as one batched dot of shape [groups, rows,
keys]; each group keeps its own running max, sum and output, so the reductions run along the
keys of one group, and the groups merge once after the loop, as flash-decoding merges splits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_bt"])
def decode_warp_split_kernel(
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
    NUM_Q_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: the query heads of one KV head, padded
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE: tl.constexpr,
    WARP_SPLITS: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    # NOTE: CUDA-graph padding rows own no token (query_start_loc repeats); nothing to do.
    if tl.load(query_start_loc_ptr + seq_idx + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    SUB: tl.constexpr = TILE // WARP_SPLITS

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    row_ok = offs_m < NUM_Q_PER_KV
    d_ok = offs_d < HEAD_DIM
    q_tok = q_start.to(tl.int64)
    head = kv_head * NUM_Q_PER_KV + offs_m
    q = tl.load(q_ptr + q_tok * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q3 = tl.broadcast_to(q[None, :, :], (WARP_SPLITS, BLOCK_M, HEAD_PAD))

    num_tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    # Key j of group g in a step: tile * TILE + g * SUB + j.
    key3 = (tl.arange(0, WARP_SPLITS)[:, None, None] * SUB
            + tl.arange(0, SUB)[None, None, :])  # [G, 1, SUB]
    key3v = (tl.arange(0, WARP_SPLITS)[:, None, None] * SUB
             + tl.arange(0, SUB)[None, :, None])  # [G, SUB, 1]
    d3 = offs_d[None, :, None]  # [1, D, 1]
    d3v = offs_d[None, None, :]  # [1, 1, D]

    m_i = tl.full([WARP_SPLITS, BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([WARP_SPLITS, BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([WARP_SPLITS, BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE + key3  # [G, 1, SUB]
        k_ok = k_pos < seq_len
        blk = tl.load(bt_row + k_pos // KV_BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        k_off = blk * stride_k_blk + (k_pos % KV_BLOCK_SIZE) * stride_k_off + kv_head * stride_k_h
        k = tl.load(k_cache_ptr + k_off + d3, mask=k_ok & (d3 < HEAD_DIM), other=0.0)
        if IEEE_DOT:
            s = tl.dot(q3, k, input_precision="ieee")
        else:
            s = tl.dot(q3, k)  # [G, M, SUB]
        s = tl.where(k_ok, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        # A group with no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, :, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=2)

        v_pos = tile * TILE + key3v  # [G, SUB, 1]
        v_ok = v_pos < seq_len
        v_blk = tl.load(bt_row + v_pos // KV_BLOCK_SIZE, mask=v_ok, other=0).to(tl.int64)
        v_off = (v_blk * stride_v_blk + (v_pos % KV_BLOCK_SIZE) * stride_v_off
                 + kv_head * stride_v_h)
        v = tl.load(v_cache_ptr + v_off + d3v, mask=v_ok & (d3v < HEAD_DIM), other=0.0)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)  # [G, M, D]
        acc = acc * alpha[:, :, None] + pv
        m_i = m_new

    # Merge the groups.
    m_row = tl.max(m_i, axis=0)  # [M]
    m_row_safe = tl.where(m_row > float("-inf"), m_row, 0.0)
    w = tl.exp2(m_i - m_row_safe[None, :])  # [G, M]: 0 for a group that saw no key
    l_row = tl.sum(l_i * w, axis=0)
    o = tl.sum(acc * w[:, :, None], axis=0)  # [M, D]
    if NUM_SPLITS == 1:
        o = o / tl.where(l_row > 0.0, l_row, 1.0)[:, None]
        tl.store(out_ptr + q_tok * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # NOTE: every split stores, even one with no tiles (m = -inf, l = 0): the merge reads all.
        row = (q_tok * tl.num_programs(1) * NUM_Q_PER_KV + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], o,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_row, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_row, mask=row_ok)
