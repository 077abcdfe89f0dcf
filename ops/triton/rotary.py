"""Rotary position embedding for query and key in one launch (one program per token)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class RotaryOutput(NamedTuple):
    query: torch.Tensor
    key: torch.Tensor


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_q,
    stride_k,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok)
    half = ROT_DIM // 2
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i, mask=i_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs_i, mask=i_ok, other=0.0)[None, :]
    # neox rotates the two halves of the rotary dims; GPT-J rotates interleaved pairs.
    if IS_NEOX:
        x1_off = offs_i
        x2_off = offs_i + half
    else:
        x1_off = 2 * offs_i
        x2_off = 2 * offs_i + 1

    # The same rotation for query (NUM_Q_HEADS heads) then key (NUM_K_HEADS heads).
    offs_h = tl.arange(0, Q_HEADS_PAD)[:, None] * HEAD_DIM
    m = (offs_h < NUM_Q_HEADS * HEAD_DIM) & i_ok[None, :]
    src = q_ptr + tok * stride_q + offs_h
    dst = q_out_ptr + tok * (NUM_Q_HEADS * HEAD_DIM) + offs_h
    x1 = tl.load(src + x1_off[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + x2_off[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(dst + x1_off[None, :], (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + x2_off[None, :], (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=m)
    if PASS_PAD > 0:  # partial rotary: copy the dims past ROT_DIM
        offs_p = ROT_DIM + tl.arange(0, PASS_PAD)
        mp = (offs_h < NUM_Q_HEADS * HEAD_DIM) & (offs_p[None, :] < HEAD_DIM)
        tl.store(dst + offs_p[None, :], tl.load(src + offs_p[None, :], mask=mp), mask=mp)

    offs_h = tl.arange(0, K_HEADS_PAD)[:, None] * HEAD_DIM
    m = (offs_h < NUM_K_HEADS * HEAD_DIM) & i_ok[None, :]
    src = k_ptr + tok * stride_k + offs_h
    dst = k_out_ptr + tok * (NUM_K_HEADS * HEAD_DIM) + offs_h
    x1 = tl.load(src + x1_off[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + x2_off[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(dst + x1_off[None, :], (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + x2_off[None, :], (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=m)
    if PASS_PAD > 0:
        offs_p = ROT_DIM + tl.arange(0, PASS_PAD)
        mp = (offs_h < NUM_K_HEADS * HEAD_DIM) & (offs_p[None, :] < HEAD_DIM)
        tl.store(dst + offs_p[None, :], tl.load(src + offs_p[None, :], mask=mp), mask=mp)


def apply_rotary_emb_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool = True,
) -> RotaryOutput:
    """Rotate ``query`` [T, Hq*D] and ``key`` [T, Hk*D] by ``positions`` [T] (int64) using
    ``cos_sin_cache`` [max_pos, rotary_dim] (cos half then sin half, float32). Dims past
    ``rotary_dim`` pass through (partial rotary). Returns new contiguous tensors shaped like
    the inputs (rows of the inputs may be strided views of a fused QKV output)."""
    num_tokens = positions.shape[0]
    rot_dim = cos_sin_cache.shape[1]
    if positions.dim() != 1 or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [T]; got {positions.dtype} {tuple(positions.shape)}"
        )
    if query.shape[0] != num_tokens or key.shape[0] != num_tokens:
        raise ValueError(
            f"query/key must have {num_tokens} rows; got {query.shape[0]}, {key.shape[0]}"
        )
    q2, k2 = query.reshape(num_tokens, -1), key.reshape(num_tokens, -1)
    if q2.shape[1] % head_size or k2.shape[1] % head_size:
        raise ValueError(
            f"query/key widths {q2.shape[1]}, {k2.shape[1]} are not multiples of {head_size}"
        )
    if rot_dim > head_size or rot_dim % 2 or cos_sin_cache.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache must be float32 [max_pos, rotary_dim] with even rotary_dim <= "
            f"{head_size}; got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
        )
    if q2.stride(1) != 1 or k2.stride(1) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary needs query, key and cos_sin_cache contiguous along the last dim")
    if query.dtype != key.dtype:
        raise ValueError(f"query and key dtypes differ: {query.dtype} vs {key.dtype}")
    q_out, k_out = (
        torch.empty_like(q2, memory_format=torch.contiguous_format),
        torch.empty_like(k2, memory_format=torch.contiguous_format),
    )
    if num_tokens > 0:
        num_q_heads, num_k_heads = q2.shape[1] // head_size, k2.shape[1] // head_size
        pass_dim = head_size - rot_dim
        _rotary_kernel[(num_tokens,)](
            q_out, k_out, q2, k2, positions, cos_sin_cache,
            q2.stride(0), k2.stride(0), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_size,
            ROT_DIM=rot_dim, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
            K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
            HALF_PAD=triton.next_power_of_2(rot_dim // 2),
            PASS_PAD=triton.next_power_of_2(pass_dim) if pass_dim else 0,
            IS_NEOX=is_neox_style, num_warps=4,
        )  # fmt: skip
    return RotaryOutput(q_out.view(query.shape), k_out.view(key.shape))
