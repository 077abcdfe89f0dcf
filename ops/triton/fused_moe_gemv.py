"""The MoE layer for a handful of tokens: two matrix-vector kernels, no sort and no sum.

At decode batch sizes each routed expert sees one or two tokens, so the grouped GEMM of
``fused_moe.py`` pads every expert's rows to a 16-row block, needs the align step to sort the
pairs first and a third kernel to sum each token's k outputs. Here a token's (token, expert)
pair is its own row and nothing is sorted:

- ``up``: one program per (pair, ``BLOCK_N`` columns of the intermediate size) streams its
  expert's gate and up rows against the token's hidden state and writes
  ``silu(gate) * up`` for the pair;
- ``down``: one program per (token, ``BLOCK_N`` hidden columns) reads the token's k experts
  side by side, scales each expert's product by its routing weight and accumulates the sum
  over k in float32 before a single store, so every row of the output is written (a pair on another
  rank's expert, or id -1, adds zero) and no zero fill or top-k sum follows.

Both accumulate elementwise in a ``[BLOCK_N, BLOCK_K]`` float32 tile and reduce it once at the
end: the products are bound by the weight bytes, which each program reads exactly once. Two
tokens that chose the same expert read its weights twice, which is why the grouped GEMM takes
over from a few tokens on (the tuned tables in ``bastion.ops.moe_configs`` say where).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion import envs
from bastion.ops.triton.pdl import (evict_policy, prefetch_l2, prefetch_lanes, release_early,
                                   use_pdl, use_prefetch, wait_for_previous)


@triton.jit
def _moe_gemv_up_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    ids_ptr,
    expert_offset,
    num_local,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVICT: tl.constexpr = "",
):
    # Released only after the wait: the down kernel reads the routing's ids before its own.
    wait_for_previous(USE_PDL, RELEASE=True)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64) - expert_offset
    if (expert < 0) | (expert >= num_local):
        return  # another rank's expert, or padding: the down kernel skips the pair
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn \
        + offs_k[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    x_ptrs = x_ptr + token * stride_x + offs_k
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(gate_ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        u = tl.load(up_ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        acc_gate += g * x[None, :]
        acc_up += u * x[None, :]
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pair.to(tl.int64) * stride_act + offs_n,
             act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_gemv_down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    ids_ptr,
    weights_ptr,
    expert_offset,
    num_local,
    N,
    K,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    W_BYTES: tl.constexpr,
    LINES: tl.constexpr,
    EVICT: tl.constexpr = "",
):
    release_early(USE_PDL)
    # The token's k experts form the leading dim of one [k, BLOCK_N, BLOCK_K] tile, so every
    # step of the K loop has all k experts' loads in flight at once (a loop over the experts
    # would wait on each expert's bytes in turn).
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_j = tl.arange(0, BLOCK_TOPK)
    pair = token * TOP_K + offs_j
    j_ok = offs_j < TOP_K
    expert = tl.load(ids_ptr + pair, mask=j_ok, other=-1).to(tl.int64) - expert_offset
    local = j_ok & (expert >= 0) & (expert < num_local)
    expert = tl.where(local, expert, 0)
    weight = tl.load(weights_ptr + pair, mask=local, other=0.0).to(tl.float32)
    k_end = tl.where(local, K, 0)  # no column of a pair on no local expert is read
    if PREFETCH:  # each local expert's [BLOCK_N, K] rows into L2 while the up kernel runs
        n0 = tl.program_id(1) * BLOCK_N
        num_bytes = ((tl.minimum(N - n0, BLOCK_N) - 1) * stride_wn + K) * W_BYTES
        for j in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + token * TOP_K + j).to(tl.int64) - expert_offset
            if (e >= 0) & (e < num_local):
                prefetch_l2(w2_ptr + e * stride_we + n0.to(tl.int64) * stride_wn, num_bytes,
                            LINES)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (w2_ptr + expert[:, None, None] * stride_we
              + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :])
    a_ptrs = act_ptr + pair[:, None] * stride_act + offs_k[None, :]
    # The routing (two kernels back) has ended once the up kernel lets this one launch
    # (ops/triton/pdl.py): the ids and the first K step's weights are read before the wait
    # for the up kernel's products.
    k_ok = offs_k[None, :] < k_end[:, None]
    w = tl.load(w_ptrs, mask=k_ok[:, None, :] & n_ok[None, :, None], other=0.0,
                eviction_policy=EVICT)
    wait_for_previous(USE_PDL)
    a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32) * weight[:, None]
    acc = w.to(tl.float32) * a[:, None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k_ok = offs_k[None, :] < (k_end - k)[:, None]
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32) * weight[:, None]
        w = tl.load(w_ptrs, mask=k_ok[:, None, :] & n_ok[None, :, None], other=0.0,
                    eviction_policy=EVICT)
        acc += w.to(tl.float32) * a[:, None, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=0)
    tl.store(out_ptr + token * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def fused_moe_gemv_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          expert_offset: int, config: dict) -> torch.Tensor:
    """``bastion.ops.moe.fused_moe`` for a few tokens: ``config`` holds the ``up`` and ``down``
    tiles (``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``num_warps``, ``num_stages``). Every row of
    the result is written; pairs on no local expert add zero."""
    num_tokens, hidden_size = hidden.shape
    num_local, two_n, k_in = w13.shape
    inter, top_k = two_n // 2, topk_ids.shape[1]
    if hidden.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe_gemv: hidden and the weights need a contiguous last dim")
    if k_in != hidden_size or tuple(w2.shape) != (num_local, hidden_size, inter):
        raise ValueError(f"fused_moe_gemv: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do "
                         f"not fit hidden {tuple(hidden.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError("fused_moe_gemv: one routing weight and id per (token, k)")
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    act = torch.empty((num_tokens * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    up, down = _tiles(config)
    pdl, evict = use_pdl(hidden.device), evict_policy(hidden.device)
    routed_bytes = num_tokens * top_k * w2[0].numel() * w2.element_size()  # at the most
    _moe_gemv_up_kernel[(num_tokens * top_k, triton.cdiv(inter, up["BLOCK_SIZE_N"]))](
        hidden, w13, act, ids, expert_offset, num_local, inter, hidden_size, hidden.stride(0),
        w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k,
        BLOCK_N=up["BLOCK_SIZE_N"], BLOCK_K=up["BLOCK_SIZE_K"], USE_PDL=pdl, EVICT=evict,
        num_warps=up["num_warps"], num_stages=up["num_stages"], launch_pdl=bool(pdl))
    _moe_gemv_down_kernel[(num_tokens, triton.cdiv(hidden_size, down["BLOCK_SIZE_N"]))](
        act, w2, out, ids, weights, expert_offset, num_local, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), TOP_K=top_k,
        BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_N=down["BLOCK_SIZE_N"],
        BLOCK_K=down["BLOCK_SIZE_K"], USE_PDL=pdl,
        PREFETCH=(use_prefetch(hidden.device, routed_bytes)
                  and envs.get("BASTION_MOE_DOWN_PREFETCH")),
        W_BYTES=w2.element_size(), LINES=prefetch_lanes(down["num_warps"]), EVICT=evict,
        num_warps=down["num_warps"], num_stages=down["num_stages"], launch_pdl=bool(pdl))
    return out


def _tiles(config: dict) -> tuple[dict, dict]:
    """The up and down tiles: the tuned table's, or ``BASTION_MOE_GEMV_CONFIG``'s."""
    tiles = envs.get("BASTION_MOE_GEMV_CONFIG")
    return tiles.get("up", config["up"]), tiles.get("down", config["down"])
