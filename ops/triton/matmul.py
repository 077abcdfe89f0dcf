"""``y = x W^T`` for decode-sized batches, optionally with SwiGLU fused into the epilogue.

cuBLAS picks tiles for a GEMM from its shape alone; at a few hundred rows the N=1024 outputs
of a small model's o_proj and down_proj make only a few dozen tiles with long K loops, which
leaves most of the GPU idle. This kernel splits K over programs (``split_k``) and sums the
fp32 partials in a second pass, and can compute SwiGLU in the epilogue of gate_up_proj
(``gated``: W holds the gate rows, then the up rows), so the [T, 2I] intermediate is never
written. Which launch shape is fastest depends on the GPU; ``LinearConfig`` carries it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class LinearConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _matmul_kernel(
    y_ptr,
    x_ptr,
    w_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ys,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GATED: tl.constexpr,
):
    # Programs that share a weight tile are adjacent (the M axis is the fastest), so the
    # tile is read from memory once and from L2 by the others.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_span
    k_end = tl.minimum(k_start + k_span, K)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = (k + offs_k) < k_end
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            u = tl.load(up_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(u), acc_up)
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if GATED:
        # Rounded as the unfused path rounds: the GEMM's output, silu's output, the product.
        gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptrs, (act * up).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(y_ptr, part_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, config: LinearConfig,
                  gated: bool = False) -> torch.Tensor:
    """``x`` [M, K] @ ``weight`` [N, K]^T -> [M, N] in ``x.dtype``; with ``gated``, ``weight``
    is [2I, K] (gate rows, then up rows) and the result is ``silu(x g^T) * (x u^T)`` [M, I]."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("linear_triton needs K contiguous (stride 1) in x and weight")
    if gated and config.split_k != 1:
        raise ValueError("a gated linear cannot split K (SwiGLU needs the full sums)")
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    split = config.split_k
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split)
    _matmul_kernel[grid](
        out, x, weight, m, n, k, x.stride(0), weight.stride(0), n, m * n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, GATED=gated, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            y, out, m * n, SPLIT_K=split, BLOCK=block, num_warps=4)
    return y
