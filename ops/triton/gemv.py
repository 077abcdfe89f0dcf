"""``y = x @ W^T (+ b)`` for a few rows of ``x``: a matrix-vector kernel for decode batches.

At one to four rows a linear layer is a stream over its weight: cuBLAS picks split-K GEMM
tiles built for wider inputs (and a second reduce kernel for the o-projection's shape), which
at a decode step's sizes reach about half the copy bandwidth. Here one program owns
``BLOCK_N`` output columns for every row: it streams their ``[BLOCK_N, K]`` weight rows once,
multiplies them against all rows of ``x`` (a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` float32 tile,
reduced over K once at the end) and writes the ``[M, BLOCK_N]`` result. One row whose whole K
is one step (``ONE_ROW``) has a form of its own with fewer registers (see the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion import envs
from bastion.ops.triton.pdl import (evict_policy, prefetch_l2, prefetch_lanes, release_early,
                                   use_pdl, use_prefetch, wait_for_previous)


# BASTION_GEMV_WHOLE_K: a program's weight tile in one K step, at most this many bytes, for K
# up to WHOLE_K_MAX. The bf16 tile is 64 registers a thread at 4 warps; one row's kernel with
# K in one step takes 95-99 registers for sm_90 (scripts/kernel_resources.py), so 5 programs
# fit a SM: 160 KB of weights, 21 MB over an H200's 132 SMs, read before the wait.
WHOLE_K_TILE_BYTES = 32 * 1024
WHOLE_K_MAX = 4096


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    W_BYTES: tl.constexpr,
    LINES: tl.constexpr,
    ONE_ROW: tl.constexpr = False,
    EVICT: tl.constexpr = "",
):
    release_early(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # Before the wait for the kernel that writes x (ops/triton/pdl.py): the program's whole
    # weight tile is asked of L2, and the first K step (peeled) read.
    if PREFETCH:
        n0 = tl.program_id(0) * BLOCK_N
        rows = tl.minimum(N - n0, BLOCK_N)
        prefetch_l2(w_ptr + n0.to(tl.int64) * stride_wn, ((rows - 1) * stride_wn + K) * W_BYTES,
                    LINES)
    if EVEN_K:
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy=EVICT)
    else:
        w = tl.load(w_ptrs, mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0,
                    eviction_policy=EVICT)
    wait_for_previous(USE_PDL)
    if ONE_ROW:
        # One row with K in one step: [BLOCK_N, BLOCK_K] products, which need not all be live at
        # once without the row axis of the general case and with no loop to carry them. A
        # 4 x 4096 bf16 tile at 4 warps takes 99 registers for sm_90 against 243
        # (scripts/kernel_resources.py), so 5 programs a SM instead of 2, and their weight
        # tiles, are read before their wait. Not for stepped K: Llama-3.1-8B's one-row products
        # took 15 % longer a batch through a loop of this form (session 28, call 4).
        if EVEN_K:
            x = tl.load(x_ptr + offs_k)
        else:
            x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        for k in range(BLOCK_K, K, BLOCK_K):
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy=EVICT)
            else:
                k_ok = offs_k < K - k
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                            eviction_policy=EVICT)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        y = tl.sum(acc, axis=2)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: dict[str, int], out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` [M, K] (M at most a few), ``weight`` [N, K] -> [M, N] in ``out_dtype`` (default
    ``x.dtype``), accumulated in float32; ``config`` holds ``BLOCK_N``, ``BLOCK_K`` and
    ``num_warps``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv: x and weight need a contiguous last dim")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    pdl, warps = use_pdl(x.device), config["num_warps"]
    prefetch = use_prefetch(x.device, weight.numel() * weight.element_size())
    whole_k = False
    if prefetch and m == 1 and k <= WHOLE_K_MAX and envs.get("BASTION_GEMV_WHOLE_K"):
        # The kernel reads its first K step before the wait: with that step the whole of K,
        # each program asks for its whole weight tile (into registers) while the kernel before
        # it runs, and after the wait reads only x. Qwen3-30B-A3B at batch 1 on an H200: 7-10
        # ms less per 128-token batch (about 2 %) in three calls, and with the one-row form
        # (5 programs a SM instead of 2) 34-40 ms less again (docs/BENCHMARKS.md, sessions 26
        # and 28).
        bk = triton.next_power_of_2(k)
        bn = max(1, min(bn, WHOLE_K_TILE_BYTES // (bk * weight.element_size())))
        prefetch, whole_k = False, True
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl,
        PREFETCH=prefetch, W_BYTES=weight.element_size(),
        LINES=prefetch_lanes(warps), ONE_ROW=whole_k and envs.get("BASTION_GEMV_ONE_ROW"),
        EVICT=evict_policy(x.device),
        num_warps=warps, launch_pdl=bool(pdl))
    return y
