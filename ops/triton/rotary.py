"""Rotary embedding of query and key in one launch (one program per token), optionally fused
with the two neighbours of a decoder layer's attention input:

- Qwen3's per-head RMSNorm of q and k before the rotation (``q_weight``/``k_weight``);
- the store of the rotated keys and the values into the paged KV cache (``k_cache``...).

A decode step of Qwen3-0.6B spent four launches a layer on these (two norms, rotary, KV store,
about 10 us at batch 256 on an H200); fused they are one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bastion import envs
from bastion.ops.triton.pdl import release_early, use_pdl, wait_for_previous


class RotaryOutput(NamedTuple):
    query: torch.Tensor
    key: torch.Tensor


@triton.jit
def _load_heads(src, x1_off, x2_off, offs_p, m, mp, PASS_PAD: tl.constexpr):
    """The two rotated halves (and the pass-through dims) of every head of one token, float32;
    ``src`` is [HEADS_PAD, 1] pointers to the heads."""
    x1 = tl.load(src + x1_off[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + x2_off[None, :], mask=m, other=0.0).to(tl.float32)
    if PASS_PAD > 0:
        xp = tl.load(src + offs_p[None, :], mask=mp, other=0.0).to(tl.float32)
    else:
        xp = x1  # unused
    return x1, x2, xp


@triton.jit
def _norm_rotate(
    x1,
    x2,
    xp,
    w1,
    w2,
    wp,
    eps,
    cos,
    sin,
    HEAD_DIM: tl.constexpr,
    PASS_PAD: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_TY: tl.constexpr,
):
    """Rotated halves (and the pass-through dims) of every head, float32; with NORM each
    head is RMS-normalised first, by the weights' halves ``w1``, ``w2`` (and ``wp``)."""
    if NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS_PAD > 0:
            ss += tl.sum(xp * xp, axis=1)
        r = tl.math.rsqrt(ss / HEAD_DIM + eps)[:, None]
        # NOTE: rounded to the activation dtype between norm and rotation, as the unfused
        # ops (a norm kernel writing bf16, then rotary reading it) would see it.
        x1 = (x1 * r * w1[None, :]).to(ROUND_TY).to(tl.float32)
        x2 = (x2 * r * w2[None, :]).to(ROUND_TY).to(tl.float32)
        if PASS_PAD > 0:
            xp = (xp * r * wp[None, :]).to(ROUND_TY).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, xp


@triton.jit
def _norm_weights(w_ptr, x1_off, x2_off, offs_p, HEAD_DIM: tl.constexpr):
    """A per-head norm weight split as the heads are: the two halves and the pass-through."""
    w1 = tl.load(w_ptr + x1_off, mask=x1_off < HEAD_DIM, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + x2_off, mask=x2_off < HEAD_DIM, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + offs_p, mask=offs_p < HEAD_DIM, other=0.0).to(tl.float32)
    return w1, w2, wp


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_w_ptr,
    k_w_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    eps,
    stride_q,
    stride_k,
    stride_v,
    stride_cs,
    stride_c_blk,
    stride_c_off,
    stride_c_h,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    PASS_ARANGE: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOADS_FIRST: tl.constexpr = True,
):
    release_early(USE_PDL)
    # Positions, cos/sin, the norm weights and the cache slot are read before the wait for the
    # kernel that wrote q, k and v (the QKV projection); after it q, k and v are all read
    # before anything is stored (a load after a store is not moved above it: it might alias,
    # and each such load would add a round trip to L2 to this latency-bound kernel).
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
    offs_p = ROT_DIM + tl.arange(0, PASS_ARANGE)  # the dims partial rotary passes through
    out_ty = q_out_ptr.dtype.element_ty
    if NORM:
        qw1, qw2, qwp = _norm_weights(q_w_ptr, x1_off, x2_off, offs_p, HEAD_DIM)
        kw1, kw2, kwp = _norm_weights(k_w_ptr, x1_off, x2_off, offs_p, HEAD_DIM)
    else:  # unused
        qw1, qw2, qwp = cos, cos, cos
        kw1, kw2, kwp = cos, cos, cos
    heads = tl.arange(0, K_HEADS_PAD)[:, None]
    if STORE:
        slot = tl.load(slot_mapping_ptr + tok + heads * 0)  # [K_HEADS_PAD, 1], all the same
    wait_for_previous(USE_PDL)

    # query: NUM_Q_HEADS heads; key: NUM_K_HEADS heads (also into the cache when STORE)
    offs_qh = tl.arange(0, Q_HEADS_PAD)[:, None] * HEAD_DIM
    qm = (offs_qh < NUM_Q_HEADS * HEAD_DIM) & i_ok[None, :]
    qmp = (offs_qh < NUM_Q_HEADS * HEAD_DIM) & (offs_p[None, :] < HEAD_DIM)
    q1, q2, qp = _load_heads(q_ptr + tok * stride_q + offs_qh, x1_off, x2_off, offs_p, qm, qmp,
                             PASS_PAD)
    offs_kh = heads * HEAD_DIM
    km = (offs_kh < NUM_K_HEADS * HEAD_DIM) & i_ok[None, :]
    kmp = (offs_kh < NUM_K_HEADS * HEAD_DIM) & (offs_p[None, :] < HEAD_DIM)
    k_src = k_ptr + tok * stride_k + offs_kh
    if LOADS_FIRST:
        k1, k2, kp = _load_heads(k_src, x1_off, x2_off, offs_p, km, kmp, PASS_PAD)
    if STORE:
        offs_d = tl.arange(0, DIM_PAD)[None, :]
        # NOTE: slot -1 marks a padding token (CUDA-graph batch padding); it owns no slot.
        ok = slot >= 0
        mv = (heads < NUM_K_HEADS) & (offs_d < HEAD_DIM) & ok
        v_src = v_ptr + tok * stride_v + heads * HEAD_DIM + offs_d
        if LOADS_FIRST:
            v = tl.load(v_src, mask=mv)

    o1, o2, op = _norm_rotate(q1, q2, qp, qw1, qw2, qwp, eps, cos, sin, HEAD_DIM, PASS_PAD,
                              NORM, out_ty)
    dst = q_out_ptr + tok * (NUM_Q_HEADS * HEAD_DIM) + offs_qh
    tl.store(dst + x1_off[None, :], o1.to(out_ty), mask=qm)
    tl.store(dst + x2_off[None, :], o2.to(out_ty), mask=qm)
    if PASS_PAD > 0:
        tl.store(dst + offs_p[None, :], op.to(out_ty), mask=qmp)
    if not LOADS_FIRST:  # BASTION_ROTARY_LOADS_FIRST=0 (A/B runs): k read after q's stores
        k1, k2, kp = _load_heads(k_src, x1_off, x2_off, offs_p, km, kmp, PASS_PAD)

    o1, o2, op = _norm_rotate(k1, k2, kp, kw1, kw2, kwp, eps, cos, sin, HEAD_DIM, PASS_PAD,
                              NORM, out_ty)
    dst = k_out_ptr + tok * (NUM_K_HEADS * HEAD_DIM) + offs_kh
    tl.store(dst + x1_off[None, :], o1.to(out_ty), mask=km)
    tl.store(dst + x2_off[None, :], o2.to(out_ty), mask=km)
    if PASS_PAD > 0:
        tl.store(dst + offs_p[None, :], op.to(out_ty), mask=kmp)
    if STORE:
        row = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_off
        row += heads * stride_c_h
        cache_ty = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + row + x1_off[None, :], o1.to(cache_ty), mask=km & ok)
        tl.store(k_cache_ptr + row + x2_off[None, :], o2.to(cache_ty), mask=km & ok)
        if PASS_PAD > 0:
            tl.store(k_cache_ptr + row + offs_p[None, :], op.to(cache_ty), mask=kmp & ok)
        if not LOADS_FIRST:
            v = tl.load(v_src, mask=mv)
        tl.store(v_cache_ptr + row + offs_d, v.to(cache_ty), mask=mv)


def apply_rotary_emb_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool = True,
    *,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    value: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> RotaryOutput:
    """Rotate ``query`` [T, Hq*D] and ``key`` [T, Hk*D] by ``positions`` [T] (int64) using
    ``cos_sin_cache`` [max_pos, rotary_dim] (cos half then sin half, float32). Dims past
    ``rotary_dim`` pass through (partial rotary). Returns new contiguous tensors shaped like
    the inputs (rows of the inputs may be strided views of a fused QKV output).

    With ``q_weight``/``k_weight`` [D], each head is RMS-normalised first (``eps``). With
    ``k_cache``/``v_cache`` [num_blocks, block_size, Hk, D], the rotated key and ``value``
    [T, Hk*D] are also stored at ``slot_mapping`` [T] (int64; slots < 0 are skipped).
    """
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
    norm = q_weight is not None
    if norm != (k_weight is not None) or (norm and (
            q_weight.shape != (head_size,) or k_weight.shape != (head_size,)
            or not q_weight.is_contiguous() or not k_weight.is_contiguous())):
        raise ValueError(f"q_weight and k_weight must both be contiguous [{head_size}] or None")
    store = k_cache is not None
    num_q_heads, num_k_heads = q2.shape[1] // head_size, k2.shape[1] // head_size
    if store:
        v2 = value.reshape(num_tokens, -1) if value is not None else None
        if (v2 is None or v2.shape != k2.shape or v2.stride(1) != 1 or v_cache is None
                or k_cache.dim() != 4 or v_cache.stride() != k_cache.stride()
                or v_cache.shape != k_cache.shape
                or k_cache.shape[2:] != (num_k_heads, head_size) or k_cache.stride(3) != 1):
            raise ValueError(
                "storing needs value [T, Hk*D] (last dim contiguous) and k_cache = v_cache "
                f"[num_blocks, block_size, {num_k_heads}, {head_size}], same strides"
            )
        if (slot_mapping is None or slot_mapping.dtype != torch.int64
                or slot_mapping.shape != (num_tokens,) or not slot_mapping.is_contiguous()):
            raise ValueError(f"slot_mapping must be contiguous int64 [{num_tokens}]")
    q_out, k_out = (
        torch.empty_like(q2, memory_format=torch.contiguous_format),
        torch.empty_like(k2, memory_format=torch.contiguous_format),
    )
    if num_tokens > 0:
        # Stand-ins of the right kind for what a disabled NORM or STORE never reads.
        if not norm:
            q_weight = k_weight = cos_sin_cache
        if store:
            cache_strides, block_size = k_cache.stride()[:3], k_cache.shape[1]
        else:
            cache_strides, block_size = (0, 0, 0), 1
            v2, k_cache, v_cache, slot_mapping = k2, q_out, q_out, positions
        pass_dim = head_size - rot_dim
        pdl = use_pdl(query.device)
        pass_pad = triton.next_power_of_2(pass_dim) if pass_dim else 0
        _rotary_kernel[(num_tokens,)](
            q_out, k_out, q2, k2, v2, positions, cos_sin_cache, q_weight, k_weight,
            k_cache, v_cache, slot_mapping, eps,
            q2.stride(0), k2.stride(0), v2.stride(0), cos_sin_cache.stride(0), *cache_strides,
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_size,
            ROT_DIM=rot_dim, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
            K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
            HALF_PAD=triton.next_power_of_2(rot_dim // 2),
            PASS_PAD=pass_pad, PASS_ARANGE=max(pass_pad, 1),
            DIM_PAD=triton.next_power_of_2(head_size),
            IS_NEOX=is_neox_style, NORM=norm, STORE=store, BLOCK_SIZE=block_size,
            USE_PDL=pdl, LOADS_FIRST=envs.get("BASTION_ROTARY_LOADS_FIRST"), num_warps=4,
            launch_pdl=bool(pdl),
        )  # fmt: skip
    return RotaryOutput(q_out.view(query.shape), k_out.view(key.shape))
