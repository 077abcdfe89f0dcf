"""LoRA expand: ``y[t] += scale[slot(t)] * h[t] @ B[slot(t)]^T`` in place for a batch mixing
adapters, then ``h[t] = 0`` (torch reference: ``ops.lora.lora_expand_ref``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.lora import ExpandConfig, LoRAIndex
from bastion.ops.triton.pdl import supports_pdl

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without grid dependency control: USE_PDL stays False
    gdc_wait = None


@triton.jit
def _slice_of(col, slice_end0, slice_end1, NUM_SLICES: tl.constexpr):
    """Which slice of a fused layer's output column ``col`` is in (0 for a plain layer)."""
    s = (col >= slice_end0).to(tl.int32) if NUM_SLICES > 1 else (col * 0).to(tl.int32)
    if NUM_SLICES > 2:
        s += (col >= slice_end1).to(tl.int32)
    return s


@triton.jit(do_not_specialize=["num_tokens"])  # a variant per batch size would compile in a step
def _lora_expand_kernel(
    h_ptr,
    b_ptr,
    slots_ptr,
    row_ids_ptr,
    slot_starts_ptr,
    scales_ptr,
    y_ptr,
    counts_ptr,
    num_tokens,
    out_features,
    rank,
    slice_rank,
    slice_end0,
    slice_end1,
    stride_ht,
    stride_bs,
    stride_bn,
    stride_yt,
    stride_cs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    ONE_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Programs as in the shrink: (slot, tile of that slot's rows, tile of output columns), so
    # every row of y is written by one program per column tile. B is block-diagonal over a fused
    # layer's slices, so a column tile reads only the rank blocks of the slices it spans: for
    # rank 16, 16 columns of h and B, whatever the layer's stacked rank.
    # With programmatic dependent launch this grid starts while the shrink runs: the index, B
    # and the scale load meanwhile; h and y only once the shrink (which waited for the base
    # matmul) has ended.
    slot = tl.program_id(0)
    tile = tl.program_id(1)
    if ONE_TILE:  # the batch fits one tile: its rows' slots are one load, not two
        offs = tl.arange(0, BLOCK_M)
        is_row = tl.load(slots_ptr + offs, mask=offs < num_tokens, other=-1) == slot
        if tl.max(is_row.to(tl.int32), axis=0) == 0:
            # One program always waits, so the grid ends after the one before it.
            if USE_PDL:  # noqa: SIM102 - a constexpr branch (no wait is built without PDL)
                if tl.program_id(0) + tl.program_id(1) + tl.program_id(2) == 0:
                    gdc_wait()
            return
        rows = offs.to(tl.int64)
    else:
        first = tl.load(slot_starts_ptr + slot) + tile * BLOCK_M
        end = tl.load(slot_starts_ptr + slot + 1)
        if first >= end:
            # One program always waits, so the grid ends after the one before it.
            if USE_PDL:  # noqa: SIM102 - a constexpr branch (no wait is built without PDL)
                if tl.program_id(0) + tl.program_id(1) + tl.program_id(2) == 0:
                    gdc_wait()
            return
        offs = first + tl.arange(0, BLOCK_M)
        is_row = offs < end
        rows = tl.load(row_ids_ptr + offs, mask=is_row, other=0).to(tl.int64)
    col0 = tl.program_id(2) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_slice = _slice_of(cols, slice_end0, slice_end1, NUM_SLICES)
    last_col = tl.minimum(col0 + BLOCK_N, out_features) - 1
    k_lo = _slice_of(col0, slice_end0, slice_end1, NUM_SLICES) * slice_rank
    k_hi = (_slice_of(last_col, slice_end0, slice_end1, NUM_SLICES) + 1) * slice_rank
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_ht + ks[None, :]
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn
    b_ptrs += ks[:, None]
    col_mask = cols[None, :] < out_features
    # The first rank step is peeled: its B load goes out before the wait.
    k = k_lo + ks
    b_mask = col_mask & (k[:, None] < k_hi) & (k[:, None] // slice_rank == col_slice[None, :])
    b = tl.load(b_ptrs + k_lo, mask=b_mask, other=0.0)
    scale = tl.load(scales_ptr + slot)
    if USE_PDL:
        gdc_wait()
    mask = is_row[:, None] & col_mask
    y_ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptrs + k_lo, mask=is_row[:, None] & (k[None, :] < k_hi), other=0.0)
    acc = tl.dot(h.to(b.dtype), b, out_dtype=tl.float32)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + ks
        h = tl.load(h_ptrs + k0, mask=is_row[:, None] & (k[None, :] < k_hi), other=0.0)
        b_mask = col_mask & (k[:, None] < k_hi) & (k[:, None] // slice_rank == col_slice[None, :])
        b = tl.load(b_ptrs + k0, mask=b_mask, other=0.0)
        acc += tl.dot(h.to(b.dtype), b)
    # The last program of this tile to have read h zeroes its rows for the next shrink.
    # NOTE: the barrier puts every thread's reads of h (whose values the product used) before
    # the count's release; the count of a tile goes back to zero with it.
    tl.debug_barrier()
    count_ptr = counts_ptr + slot * stride_cs + tile
    count = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    tl.store(y_ptrs, (y + acc * scale).to(y_ptr.dtype.element_ty), mask=mask)
    if count == tl.num_programs(2) - 1:
        for k0 in range(0, rank, BLOCK_K):
            k = k0 + ks
            zeros = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            tl.store(
                h_ptr + rows[:, None] * stride_ht + k[None, :],
                zeros,
                mask=is_row[:, None] & (k[None, :] < rank),
            )
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")


def lora_expand_triton(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    index: LoRAIndex,
    scales: torch.Tensor,
    y: torch.Tensor,
    tile_counts: torch.Tensor,
    slice_ends: tuple[int, ...],
    config: ExpandConfig,
) -> None:
    """``h`` float32 [T, R] (the shrink's sums; zeroed on the rows with a slot), ``lora_b`` [S,
    N, R], block-diagonal over the slices ending at ``slice_ends`` (up to 3, the last N),
    ``index`` the step's (``ops.lora.LoRAIndex``), ``scales`` float32 [S], ``y`` [T, N] (a column
    slice of the layer's output is fine), added into; ``tile_counts`` int32 [S, >= T / 16],
    zero, and left so."""
    if h.dim() != 2 or lora_b.dim() != 3 or y.dim() != 2 or tile_counts.dim() != 2:
        raise ValueError(
            f"lora_expand expects h [T, R], lora_b [S, N, R], y [T, N], tile_counts [S, tiles]; "
            f"got {tuple(h.shape)}, {tuple(lora_b.shape)}, {tuple(y.shape)}, "
            f"{tuple(tile_counts.shape)}"
        )
    num_tokens, rank = h.shape
    num_slots, out_features, _ = lora_b.shape
    token_slots, row_ids, slot_starts = index
    num_tiles = triton.cdiv(num_tokens, config.block_m)
    use_pdl = config.pdl and gdc_wait is not None and supports_pdl(h.device)
    if (
        lora_b.shape[2] != rank
        or y.shape != (num_tokens, out_features)
        or row_ids.shape[0] < num_tokens
        or token_slots.shape[0] < num_tokens
        or slot_starts.shape != (num_slots + 1,)
        or scales.shape != (num_slots,)
        or tile_counts.shape[0] != num_slots
        or tile_counts.shape[1] < num_tiles
    ):
        raise ValueError(
            f"lora_expand shapes disagree: h {tuple(h.shape)}, lora_b {tuple(lora_b.shape)}, "
            f"y {tuple(y.shape)}, slots {tuple(token_slots.shape)}, row_ids "
            f"{tuple(row_ids.shape)}, slot_starts "
            f"{tuple(slot_starts.shape)}, scales {tuple(scales.shape)}, tile_counts "
            f"{tuple(tile_counts.shape)}"
        )
    num_slices = len(slice_ends)
    if not 1 <= num_slices <= 3 or rank % num_slices or slice_ends[-1] != out_features:
        raise ValueError(
            f"lora_expand takes 1 to 3 slices ending at the output's last column, the rank "
            f"divided evenly; got slice_ends {slice_ends} for {out_features} columns, rank {rank}"
        )
    if h.stride(1) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("lora_expand needs the last dim of h, lora_b and y contiguous")
    if (
        h.dtype != torch.float32
        or scales.dtype != torch.float32
        or any(t.dtype != torch.int32 for t in index)
        or tile_counts.dtype != torch.int32
    ):
        raise ValueError(
            f"lora_expand needs float32 h and scales and an int32 index and tile_counts; "
            f"got {h.dtype}, {scales.dtype}, {[t.dtype for t in index]}, {tile_counts.dtype}"
        )
    if num_tokens == 0:
        return
    ends = (*slice_ends[:-1], out_features, out_features)
    grid = (num_slots, num_tiles, triton.cdiv(out_features, config.block_n))
    _lora_expand_kernel[grid](
        h,
        lora_b,
        token_slots,
        row_ids,
        slot_starts,
        scales,
        y,
        tile_counts,
        num_tokens,
        out_features,
        rank,
        rank // num_slices,
        ends[0],
        ends[1],
        h.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        tile_counts.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_SLICES=num_slices,
        ONE_TILE=num_tiles == 1,
        USE_PDL=use_pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=use_pdl,
    )
