"""Grouped GEMM over expert-sorted (token, expert) pairs: the two matrix products of a MoE layer.

Pairs come grouped by expert from ``moe_align.py`` (each group padded to ``BLOCK_M`` rows, the
padding marked by the sentinel ``num_pairs``). A program computes one ``BLOCK_M x BLOCK_N``
tile of one expert's rows: it gathers its ``A`` rows by pair id, multiplies by that expert's
weight and scatters the tile back to the pairs' rows, so no token is ever copied into a
per-expert buffer. The same kernel runs both products of ``w2(silu(w1 x) * w3 x)``:

- ``GATED``: ``A`` rows are tokens (pair // top_k); the weight is ``w13`` [E, 2N, K], gate rows
  then up rows; the program keeps two accumulators and writes ``silu(gate) * up`` [pairs, N];
- otherwise ``A`` rows are pairs; the weight is ``w2`` [E, N, K]; with ``MUL_ROUTED_WEIGHT``
  the tile is scaled by each pair's routing weight before it is written [pairs, N].

Launch configurations come from ``bastion.ops.moe_configs`` (tuned JSON per shape and GPU);
a configuration holding ``gemv`` sends a few tokens to ``fused_moe_gemv.py`` instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.triton.pdl import release_early, use_grouped_moe_pdl, wait_for_previous


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``, in full float32 precision where ``IEEE`` (float32 operands: tests and
    the reference's dtype), else at the tensor cores' default."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_sorted_ptr,
    num_pairs,
    N,
    K,
    max_sorted,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    wait_for_previous(USE_PDL)  # every program, before it may return below
    # Grouped order: GROUP_M row blocks share each column block, so one expert's weight tile
    # is read by neighbouring programs while it is still in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(max_sorted, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
    if pid_m * BLOCK_M >= tl.load(num_sorted_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        up_ptrs = b_ptrs + N * stride_bn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_acc(a, b, acc, IEEE)
        if GATED:
            if EVEN_K:
                u = tl.load(up_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                u = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = dot_acc(a, u, acc_up, IEEE)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_gemm_triton(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                          topk_weights: torch.Tensor | None, sorted_ids: torch.Tensor,
                          block_experts: torch.Tensor, num_sorted: torch.Tensor, top_k: int,
                          gated: bool, config: dict[str, int]) -> torch.Tensor:
    """One grouped product into ``out`` [pairs, N] (rows of pairs on no local expert are left
    as they are). ``a``: [T, K] tokens when ``gated`` (pair p reads row p // top_k), else
    [pairs, K]; ``weight``: [E, 2N, K] when ``gated``, else [E, N, K]; ``topk_weights``: the
    flat [pairs] routing weights to scale by, or None."""
    num_pairs, n = out.shape
    k = a.shape[1]
    if a.stride(1) != 1 or weight.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("fused_moe: a, weight and out need a contiguous last dim")
    if weight.shape[1] != (2 * n if gated else n) or weight.shape[2] != k:
        raise ValueError(f"fused_moe: weight {tuple(weight.shape)} does not fit a {tuple(a.shape)}"
                         f" -> out {tuple(out.shape)} (gated={gated})")
    if gated and a.shape[0] * top_k != num_pairs or not gated and a.shape[0] != num_pairs:
        raise ValueError(f"fused_moe: {a.shape[0]} input rows for {num_pairs} pairs, top_k "
                         f"{top_k}, gated={gated}")
    if topk_weights is not None and topk_weights.numel() != num_pairs:
        raise ValueError("fused_moe: one routing weight per pair")
    max_sorted = sorted_ids.numel()
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    grid = (triton.cdiv(max_sorted, bm) * triton.cdiv(n, bn),)
    pdl = use_grouped_moe_pdl(a.device)
    _fused_moe_kernel[grid](
        a, weight, out, topk_weights if topk_weights is not None else out, sorted_ids,
        block_experts, num_sorted, num_pairs, n, k, max_sorted, a.stride(0), weight.stride(0),
        weight.stride(1), out.stride(0), A_ROW_DIV=top_k if gated else 1, GATED=gated,
        MUL_ROUTED_WEIGHT=topk_weights is not None, EVEN_K=k % bk == 0,
        IEEE=a.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=config["GROUP_SIZE_M"], USE_PDL=pdl, num_warps=config["num_warps"],
        num_stages=config["num_stages"], launch_pdl=bool(pdl))
    return out


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_offset: int = 0,
                     config: dict | None = None, zero_unrouted: bool = True) -> torch.Tensor:
    """The whole expert computation of ``bastion.ops.moe.fused_moe`` without a host sync:
    align, gate/up product with SiLU-and-mul, down product scaled by the routing weights, and
    the sum over each token's k choices. ``zero_unrouted``: pairs on no local expert (another
    rank's, or id -1) add zero; without it their tokens' rows are left undefined, which a
    caller whose only such rows are padding may allow (it saves a fill of [T * k, H])."""
    from bastion.ops.moe_configs import get_moe_config
    from bastion.ops.triton.moe_align import moe_align_triton
    from bastion.ops.triton.moe_sum import moe_sum_triton

    num_tokens, hidden_size = hidden.shape
    num_local, two_n, _ = w13.shape
    inter, top_k = two_n // 2, topk_ids.shape[1]
    if config is None:
        config = get_moe_config(num_local, inter, hidden_size, num_tokens, top_k, hidden.dtype)
    if "gemv" in config:  # a few tokens: no sort, no padding, the top-k sum folded in
        from bastion.ops.triton.fused_moe_gemv import fused_moe_gemv_triton

        return fused_moe_gemv_triton(hidden, w13, w2, topk_weights, topk_ids, expert_offset,
                                     config["gemv"])
    sorted_ids, block_experts, num_sorted = moe_align_triton(
        topk_ids.contiguous(), config["BLOCK_SIZE_M"], num_local, expert_offset)
    num_pairs = num_tokens * top_k
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    fused_moe_gemm_triton(hidden, w13, act, None, sorted_ids, block_experts, num_sorted, top_k,
                          gated=True, config={**config, **config["up"]})
    # NOTE: rows of pairs routed to no local expert are never written.
    alloc = torch.zeros if zero_unrouted else torch.empty
    out = alloc((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    fused_moe_gemm_triton(act, w2, out, topk_weights.reshape(-1).float(), sorted_ids,
                          block_experts, num_sorted, top_k, gated=False,
                          config={**config, **config["down"]})
    return moe_sum_triton(out.view(num_tokens, top_k, hidden_size))
