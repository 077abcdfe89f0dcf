"""A decoder layer's attention input in one kernel, for decode-sized batches: the residual add
and input RMSNorm, the QKV projection, Qwen3's per-head q/k RMSNorm, the rotary embedding and
the store of the new K/V in the paged cache.

At a decode step's batch sizes the unfused chain is three launches bound by latency, not by
bytes or FLOPs (Qwen3-0.6B at batch 256 on an H200: the add-norm 1.9 us, cuBLAS's QKV GEMM
6.4 us, the norm-rotary-store 3.5 us, against a floor of about 2 us for the GEMM's 8 MB of
weights). Here one program computes one head's 128 output columns for a block of tokens, as two
64-column halves, so the rotation pairs column i with i + 64 in registers:

- the input RMSNorm is applied after the dot: ``norm(x) W = diag(1 / rms(x)) (x * g) W``, with
  ``rms(x)`` summed from the same K tiles the dot reads, so nothing reads the row twice;
- the program of head 0 writes the new residual (``x + residual``, rounded as the unfused add).

Scope: neox-style rotary over the whole head, no QKV bias, a head size that is a power of two,
a hidden size that is a multiple of the K tile. ``ops/qkv.py`` falls back to the unfused ops
otherwise, and for batches above a size where cuBLAS's GEMM wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from bastion.ops.triton.counters import zeroed_counters


@triton.jit
def _norm_qkv_rope_kernel(
    q_out_ptr,  # [T, Hq * D]
    res_out_ptr,  # [T, HIDDEN]: x + residual (HAS_RESIDUAL)
    x_ptr,  # [T, HIDDEN], row stride stride_x
    res_ptr,  # [T, HIDDEN], row stride stride_res
    norm_w_ptr,  # [HIDDEN]
    w_ptr,  # [(Hq + 2 Hk) * D, HIDDEN], row stride stride_w
    positions_ptr,  # int64 [T]
    cos_sin_ptr,  # float32 [max_pos, D]: cos half, sin half
    q_w_ptr,  # [D] (QK_NORM)
    k_w_ptr,  # [D] (QK_NORM)
    k_cache_ptr,  # [blocks, KV_BLOCK_SIZE, Hk, D]
    v_cache_ptr,
    slot_ptr,  # int64 [T]; < 0: padding, not stored
    ws_acc_ptr,  # float32 [groups, SPLIT_K, BLOCK_M, HEAD_DIM]: partial dots (SPLIT_K > 1)
    ws_ss_ptr,  # float32 [groups, SPLIT_K, BLOCK_M]: partial sums of squares
    done_ptr,  # int32 [groups], zeros: splits finished per (token block, head)
    num_tokens,
    norm_eps,
    qk_eps,
    stride_x,
    stride_res,
    stride_w,
    stride_cs,
    stride_c_blk,
    stride_c_off,
    stride_c_h,
    HIDDEN: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QK_NORM: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    K_PER_SPLIT: tl.constexpr = HIDDEN // SPLIT_K
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    rows64 = rows.to(tl.int64)
    offs_h = tl.arange(0, HALF)
    offs_k = tl.arange(0, BLOCK_K)
    dtype = w_ptr.dtype.element_ty
    # W's rows of this head's two halves, as [BLOCK_K, HALF] tiles of W^T.
    w_lo = w_ptr + (head * HEAD_DIM + offs_h)[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    w_hi = w_lo + HALF * stride_w
    x_rows = x_ptr + rows64[:, None] * stride_x + offs_k[None, :]
    res_rows = res_ptr + rows64[:, None] * stride_res + offs_k[None, :]

    acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, (split + 1) * K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_rows + k0, mask=row_ok[:, None], other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_rows + k0, mask=row_ok[:, None], other=0.0).to(tl.float32)
            # Rounded to the activation dtype, as the unfused add writes it.
            x = (x + r).to(dtype).to(tl.float32)
            if head == 0:
                tl.store(res_out_ptr + rows64[:, None] * HIDDEN + k0 + offs_k[None, :],
                         x.to(dtype), mask=row_ok[:, None])
        ss += tl.sum(x * x, axis=1)
        g = tl.load(norm_w_ptr + k0 + offs_k).to(tl.float32)
        a = (x * g[None, :]).to(dtype)
        wl = tl.load(w_lo + k0)
        wh = tl.load(w_hi + k0)
        if IEEE_DOT:
            acc_lo += tl.dot(a, wl, input_precision="ieee")
            acc_hi += tl.dot(a, wh, input_precision="ieee")
        else:
            acc_lo += tl.dot(a, wl)
            acc_hi += tl.dot(a, wh)

    if SPLIT_K > 1:
        # Each split leaves its partial dots and sums of squares; the last of a (token block,
        # head) to finish adds them up and runs the epilogue (the counter's release/acquire
        # orders the partials; they are read from L2).
        offs_m = tl.arange(0, BLOCK_M)
        group = tl.program_id(0) * tl.num_programs(1) + head
        ws = ws_acc_ptr + (group * SPLIT_K * BLOCK_M + offs_m[:, None]) * HEAD_DIM \
            + offs_h[None, :]
        tl.store(ws + split * BLOCK_M * HEAD_DIM, acc_lo)
        tl.store(ws + split * BLOCK_M * HEAD_DIM + HALF, acc_hi)
        ws_ss = ws_ss_ptr + group * SPLIT_K * BLOCK_M + offs_m
        tl.store(ws_ss + split * BLOCK_M, ss)
        tl.debug_barrier()
        if tl.atomic_add(done_ptr + group, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        tl.store(done_ptr + group, 0)  # ready for the next launch (CUDA-graph replays too)
        tl.debug_barrier()
        acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s_i in tl.static_range(SPLIT_K):
            acc_lo += tl.load(ws + s_i * BLOCK_M * HEAD_DIM, cache_modifier=".cg")
            acc_hi += tl.load(ws + s_i * BLOCK_M * HEAD_DIM + HALF, cache_modifier=".cg")
            ss += tl.load(ws_ss + s_i * BLOCK_M, cache_modifier=".cg")

    rstd = tl.math.rsqrt(ss / HIDDEN + norm_eps)[:, None]
    # Rounded as the GEMM's output would be.
    lo = (acc_lo * rstd).to(dtype).to(tl.float32)
    hi = (acc_hi * rstd).to(dtype).to(tl.float32)

    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    cache_ok = (row_ok & (slot >= 0))[:, None]
    cache_row = ((slot // KV_BLOCK_SIZE) * stride_c_blk
                 + (slot % KV_BLOCK_SIZE) * stride_c_off)[:, None] + offs_h[None, :]
    cache_ty = k_cache_ptr.dtype.element_ty
    if head >= NUM_Q_HEADS + NUM_KV_HEADS:  # a value head: stored as projected
        dst = v_cache_ptr + cache_row + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_c_h
        tl.store(dst, lo.to(cache_ty), mask=cache_ok)
        tl.store(dst + HALF, hi.to(cache_ty), mask=cache_ok)
    else:
        is_q = head < NUM_Q_HEADS
        if QK_NORM:
            wl_n = tl.where(is_q, tl.load(q_w_ptr + offs_h), tl.load(k_w_ptr + offs_h))
            wh_n = tl.where(is_q, tl.load(q_w_ptr + HALF + offs_h),
                            tl.load(k_w_ptr + HALF + offs_h))
            ss2 = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
            r2 = tl.math.rsqrt(ss2 / HEAD_DIM + qk_eps)[:, None]
            # Rounded between norm and rotation, as the unfused kernel does.
            lo = (lo * r2 * wl_n.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
            hi = (hi * r2 * wh_n.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        pos = tl.load(positions_ptr + rows, mask=row_ok, other=0)
        cs = cos_sin_ptr + pos[:, None] * stride_cs + offs_h[None, :]
        cos = tl.load(cs, mask=row_ok[:, None], other=0.0)
        sin = tl.load(cs + HALF, mask=row_ok[:, None], other=0.0)
        o1 = lo * cos - hi * sin
        o2 = hi * cos + lo * sin
        if is_q:
            dst = (q_out_ptr + rows64[:, None] * (NUM_Q_HEADS * HEAD_DIM) + head * HEAD_DIM
                   + offs_h[None, :])
            tl.store(dst, o1.to(q_out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(dst + HALF, o2.to(q_out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            dst = k_cache_ptr + cache_row + (head - NUM_Q_HEADS) * stride_c_h
            tl.store(dst, o1.to(cache_ty), mask=cache_ok)
            tl.store(dst + HALF, o2.to(cache_ty), mask=cache_ok)


def _launch_shape(num_tokens: int, hidden_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages, SPLIT_K) for a batch of ``num_tokens``."""
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_k, split_k = 64, 4 if num_tokens <= 64 else 2
    while split_k > 1 and hidden_size % (block_k * split_k):
        split_k //= 2
    return block_m, block_k, 4, 3, split_k


def norm_qkv_rope_triton(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    norm_eps: float,
    qkv_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    qk_eps: float = 0.0,
    block: tuple[int, int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, Hq * D], x + residual)`` (``hidden`` itself when ``residual`` is None); the
    new keys (normed, rotated) and values go into the caches at ``slot_mapping``. ``block``
    overrides the launch shape (benchmarks)."""
    num_tokens, hidden_size = hidden.shape
    block_m, block_k, num_warps, num_stages, split_k = block or _launch_shape(num_tokens, hidden.shape[1])
    if (hidden_size % (block_k * split_k) or head_dim & (head_dim - 1) or cos_sin_cache.shape[1] != head_dim
            or qkv_weight.shape != ((num_q_heads + 2 * num_kv_heads) * head_dim, hidden_size)
            or qkv_weight.stride(1) != 1 or hidden.stride(1) != 1
            or k_cache.shape[2:] != (num_kv_heads, head_dim) or k_cache.stride(3) != 1
            or v_cache.stride() != k_cache.stride()):
        raise ValueError("norm_qkv_rope_triton: unsupported shapes or strides")
    q = torch.empty((num_tokens, num_q_heads * head_dim), dtype=hidden.dtype,
                    device=hidden.device)
    has_res = residual is not None
    new_res = torch.empty_like(hidden, memory_format=torch.contiguous_format) if has_res \
        else hidden
    if num_tokens == 0:
        return q, new_res
    res = residual if has_res else hidden
    qk_norm = q_weight is not None
    grid = (triton.cdiv(num_tokens, block_m), num_q_heads + 2 * num_kv_heads, split_k)
    groups = grid[0] * grid[1]
    if split_k > 1:
        ws_acc = torch.empty((groups, split_k, block_m, head_dim), dtype=torch.float32,
                             device=hidden.device)
        ws_ss = torch.empty((groups, split_k, block_m), dtype=torch.float32,
                            device=hidden.device)
        done = zeroed_counters(hidden.device, groups)
    else:
        ws_acc = ws_ss = done = q  # unused
    _norm_qkv_rope_kernel[grid](
        q, new_res, hidden, res, norm_weight, qkv_weight, positions, cos_sin_cache,
        q_weight if qk_norm else norm_weight, k_weight if qk_norm else norm_weight,
        k_cache, v_cache, slot_mapping, ws_acc, ws_ss, done, num_tokens, norm_eps, qk_eps,
        hidden.stride(0), res.stride(0), qkv_weight.stride(0), cos_sin_cache.stride(0),
        *k_cache.stride()[:3],
        HIDDEN=hidden_size, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, KV_BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_K=block_k,
        SPLIT_K=split_k, HAS_RESIDUAL=has_res, QK_NORM=qk_norm, IEEE_DOT=hidden.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return q, new_res
