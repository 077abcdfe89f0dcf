"""LoRA expand: ``y[t] += scale[slot(t)] * h[t] @ B[slot(t)]^T`` in place, for a batch mixing
adapters, ``h`` summed from the shrink's K-split partials as it is loaded (torch reference: ``ops.lora.lora_expand_ref``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    b_ptr,
    slots_ptr,
    scales_ptr,
    y_ptr,
    num_tokens,
    out_features,
    rank,
    stride_hs,
    stride_ht,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # Programs as in the shrink: (slot, tile of rows, tile of output columns), rows of other
    # slots untouched, so every row of y is written by at most one program. Each sums the
    # partials of its rows' h in split order (a few KB, from L2), so results are deterministic.
    slot = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_slots = tl.load(slots_ptr + rows, mask=rows < num_tokens, other=-1)
    is_mine = row_slots == slot
    if tl.sum(is_mine.to(tl.int32), axis=0) == 0:
        return
    ks = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    for k0 in range(0, rank, BLOCK_K):
        k = k0 + ks
        h_ptrs = h_ptr + rows64[:, None] * stride_ht + k[None, :]
        h_mask = is_mine[:, None] & (k[None, :] < rank)
        h = tl.load(h_ptrs, mask=h_mask, other=0.0)
        for split in tl.static_range(1, SPLIT_K):
            h += tl.load(h_ptrs + split * stride_hs, mask=h_mask, other=0.0)
        b = tl.load(
            b_base + cols[None, :].to(tl.int64) * stride_bn + k[:, None],
            mask=(cols[None, :] < out_features) & (k[:, None] < rank),
            other=0.0,
        )
        acc += tl.dot(h.to(b.dtype), b)
    scale = tl.load(scales_ptr + slot)
    mask = is_mine[:, None] & (cols[None, :] < out_features)
    y_ptrs = y_ptr + rows64[:, None] * stride_yt + cols[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc * scale).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand_triton(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """``h`` float32 [SPLIT_K, T, R] (the shrink's partials), ``lora_b`` [S, N, R],
    ``token_slots`` int32 [T], ``scales`` float32 [S], ``y`` [T, N] (a column slice of the
    layer's output is fine), added into."""
    if h.dim() != 3 or lora_b.dim() != 3 or y.dim() != 2 or token_slots.dim() != 1:
        raise ValueError(
            f"lora_expand expects h [SPLIT_K, T, R], lora_b [S, N, R], y [T, N], slots [T]; "
            f"got {tuple(h.shape)}, {tuple(lora_b.shape)}, {tuple(y.shape)}, "
            f"{tuple(token_slots.shape)}"
        )
    split_k, num_tokens, rank = h.shape
    num_slots, out_features, _ = lora_b.shape
    if (
        lora_b.shape[2] != rank
        or y.shape != (num_tokens, out_features)
        or token_slots.shape[0] < num_tokens
        or scales.shape != (num_slots,)
    ):
        raise ValueError(
            f"lora_expand shapes disagree: h {tuple(h.shape)}, lora_b "
            f"{tuple(lora_b.shape)}, y {tuple(y.shape)}, slots "
            f"{tuple(token_slots.shape)}, scales {tuple(scales.shape)}"
        )
    if h.stride(2) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("lora_expand needs the last dim of h, lora_b and y contiguous")
    if (
        h.dtype != torch.float32
        or scales.dtype != torch.float32
        or token_slots.dtype != torch.int32
    ):
        raise ValueError(
            f"lora_expand needs float32 h and scales and int32 slots; got "
            f"{h.dtype}, {scales.dtype}, {token_slots.dtype}"
        )
    if num_tokens == 0:
        return
    block_m = 16 if num_tokens <= 16 else 64
    # Decode: wider column tiles halve the programs (gate_up has 28672 columns), each summing
    # the partials of h once for more of the output.
    block_n = 128 if num_tokens <= 16 else 64
    grid = (num_slots, triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _lora_expand_kernel[grid](
        h,
        lora_b,
        token_slots,
        scales,
        y,
        num_tokens,
        out_features,
        rank,
        h.stride(0),
        h.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=16,
        SPLIT_K=split_k,
        num_warps=4,
        # NOTE: one stage: pipelining the SPLIT_K partial loads of h staged them all in shared
        # memory (268 KB for 64-row tiles at split 32, past the H200's 227 KB).
        num_stages=1,
    )
