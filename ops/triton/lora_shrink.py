"""LoRA shrink: the K-split partials of ``x[t] @ A[slot(t)]^T`` for a batch mixing adapters
(torch reference: ``ops.lora.lora_shrink_ref``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    num_tokens,
    rank,
    hidden,
    stride_xt,
    stride_as,
    stride_ar,
    stride_os,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # One program per (slot and K split, tile of rows, tile of rank columns); it computes only
    # the rows of its slot, so a tile of one adapter's rows is a tensor-core GEMM, and a program
    # whose tile holds no row of its slot exits after reading the slot ids. Each K split stores
    # its partial product in its own plane of ``out`` (the expand sums them): a decode batch has
    # one row tile, and without the split one program would walk all of K (14336 for
    # Llama-3-8B's down_proj) alone; without atomics no memset is needed and sums are ordered.
    slot = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_slots = tl.load(slots_ptr + rows, mask=rows < num_tokens, other=-1)
    is_mine = row_slots == slot
    if tl.sum(is_mine.to(tl.int32), axis=0) == 0:
        return
    ks = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    for k0 in range(split * BLOCK_K, hidden, BLOCK_K * SPLIT_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + rows64[:, None] * stride_xt + k[None, :],
            mask=is_mine[:, None] & (k[None, :] < hidden),
            other=0.0,
        )
        a = tl.load(
            a_base + cols[None, :] * stride_ar + k[:, None],
            mask=(cols[None, :] < rank) & (k[:, None] < hidden),
            other=0.0,
        )
        acc += tl.dot(x, a.to(x.dtype))
    mask = is_mine[:, None] & (cols[None, :] < rank)
    # NOTE: a split with no K columns (a short K) still stores its zeros: the expand reads
    # every plane of a row with a slot.
    out_ptrs = out_ptr + split * stride_os + rows64[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc, mask=mask)


def lora_shrink_triton(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """``x`` [T, K], ``lora_a`` [S, R, K], ``token_slots`` int32 [T] (-1: no adapter), ``out``
    float32 [SPLIT_K, T, R]: the K-split partials, written for rows with a slot (any split
    count; ``ops.lora.lora_split_k`` picks it)."""
    if x.dim() != 2 or lora_a.dim() != 3 or out.dim() != 3 or token_slots.dim() != 1:
        raise ValueError(
            f"lora_shrink expects x [T, K], lora_a [S, R, K], out [SPLIT_K, T, R], slots [T]; "
            f"got {tuple(x.shape)}, {tuple(lora_a.shape)}, {tuple(out.shape)}, "
            f"{tuple(token_slots.shape)}"
        )
    num_tokens, hidden = x.shape
    num_slots, rank, _ = lora_a.shape
    if (
        lora_a.shape[2] != hidden
        or out.shape[1:] != (num_tokens, rank)
        or token_slots.shape[0] < num_tokens
    ):
        raise ValueError(
            f"lora_shrink shapes disagree: x {tuple(x.shape)}, lora_a "
            f"{tuple(lora_a.shape)}, out {tuple(out.shape)}, slots "
            f"{tuple(token_slots.shape)}"
        )
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("lora_shrink needs the last dim of x, lora_a and out contiguous")
    if out.dtype != torch.float32 or token_slots.dtype != torch.int32:
        raise ValueError(
            f"lora_shrink needs a float32 out and int32 slots; got {out.dtype}, {token_slots.dtype}"
        )
    if num_tokens == 0:
        return
    block_n = max(16, triton.next_power_of_2(rank))
    block_m = 16 if num_tokens <= 16 else 64
    num_row_tiles = triton.cdiv(num_tokens, block_m)
    split_k = out.shape[0]
    grid = (num_slots * split_k, num_row_tiles, triton.cdiv(rank, block_n))
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        token_slots,
        out,
        num_tokens,
        rank,
        hidden,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=64,
        SPLIT_K=split_k,
        num_warps=4,
    )
