"""LoRA shrink: ``h[t] += x[t] @ A[slot(t)]^T`` for a batch mixing adapters, K spread over many
programs (torch reference: ``ops.lora.lora_shrink_ref``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.lora import LoRAIndex, ShrinkConfig
from bastion.ops.triton.pdl import supports_pdl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: USE_PDL stays False
    gdc_launch_dependents = gdc_wait = None


# The batch's size and its K split are runtime values: a variant per batch size would compile
# in the middle of serving (ops.lora.precompile_lora builds the others at start-up).
@triton.jit(do_not_specialize=["num_tokens", "split_k", "steps_per_split"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    row_ids_ptr,
    slot_starts_ptr,
    h_ptr,
    num_tokens,
    rank,
    hidden,
    split_k,
    steps_per_split,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (slot, tile of that slot's rows, K split and tile of rank columns): rows
    # come grouped by slot, so a tile is one adapter's GEMM, and a program past its slot's rows
    # exits after two loads. A decode batch has one tile, so K is what spreads the work: each
    # program reads a short K range of x and A (one or two BLOCK_K steps) and adds its partial
    # product into h, which is zero on entry (the expand zeroes it after reading).
    # With programmatic dependent launch this grid starts while the kernel before it (the
    # base matmul) drains, reads the index and A meanwhile, and lets the expand start at once.
    # NOTE: it waits for that kernel before reading x or adding into h, and every program with
    # rows (and program 0 always) waits before it ends, so this grid ends after that kernel:
    # the expand, which waits for this grid, then reads that kernel's y.
    if USE_PDL:
        gdc_launch_dependents()
    slot = tl.program_id(0)
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
        first = tl.load(slot_starts_ptr + slot) + tl.program_id(1) * BLOCK_M
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
    split = tl.program_id(2) % split_k
    cols = (tl.program_id(2) // split_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + cols[None, :] * stride_ar + ks[:, None]
    x_ptrs = x_ptr + rows[:, None] * stride_xt + ks[None, :]
    a_mask = cols[None, :] < rank
    # A split's range is whole K steps (so its loads stay aligned and vectorised whatever the
    # split): only the last split needs the K mask, and every split has columns (the launcher
    # counts the splits so). The first step is peeled: its A load goes out before the wait.
    k_begin = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + steps_per_split * BLOCK_K, hidden)
    k = k_begin + ks
    a = tl.load(a_ptrs + k_begin, mask=a_mask & (k[:, None] < hidden), other=0.0)
    if USE_PDL:
        gdc_wait()
    x = tl.load(x_ptrs + k_begin, mask=is_row[:, None] & (k[None, :] < hidden), other=0.0)
    acc = tl.dot(x, a.to(x.dtype), out_dtype=tl.float32)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptrs + k0, mask=is_row[:, None] & (k[None, :] < hidden), other=0.0)
        a = tl.load(a_ptrs + k0, mask=a_mask & (k[:, None] < hidden), other=0.0)
        acc += tl.dot(x, a.to(x.dtype))
    h_ptrs = h_ptr + rows[:, None] * stride_ht + cols[None, :]
    # A single split's add into zero is exact, so a batch with one split is deterministic.
    tl.atomic_add(h_ptrs, acc, mask=is_row[:, None] & (cols[None, :] < rank), sem="relaxed")


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    index: LoRAIndex,
    h: torch.Tensor,
    config: ShrinkConfig,
) -> None:
    """``x`` [T, K], ``lora_a`` [S, R, K], ``index`` the step's (``ops.lora.LoRAIndex``), ``h``
    float32 [T, R], zero on the rows with a slot, which get their products added (by atomic
    adds: with ``config.split_k`` > 1 in no fixed order). With ``config.pdl`` on a Hopper or
    later GPU, the grid overlaps the kernel before it, which must not write ``lora_a`` or the
    index."""
    token_slots, row_ids, slot_starts = index
    if x.dim() != 2 or lora_a.dim() != 3 or h.dim() != 2 or row_ids.dim() != 1:
        raise ValueError(
            f"lora_shrink expects x [T, K], lora_a [S, R, K], h [T, R], row_ids [T]; got "
            f"{tuple(x.shape)}, {tuple(lora_a.shape)}, {tuple(h.shape)}, {tuple(row_ids.shape)}"
        )
    num_tokens, hidden = x.shape
    num_slots, rank, _ = lora_a.shape
    if (
        lora_a.shape[2] != hidden
        or h.shape != (num_tokens, rank)
        or row_ids.shape[0] < num_tokens
        or token_slots.shape[0] < num_tokens
        or slot_starts.shape != (num_slots + 1,)
    ):
        raise ValueError(
            f"lora_shrink shapes disagree: x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, "
            f"h {tuple(h.shape)}, slots {tuple(token_slots.shape)}, row_ids "
            f"{tuple(row_ids.shape)}, slot_starts "
            f"{tuple(slot_starts.shape)}"
        )
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or h.stride(1) != 1:
        raise ValueError("lora_shrink needs the last dim of x, lora_a and h contiguous")
    if h.dtype != torch.float32 or any(t.dtype != torch.int32 for t in index):
        raise ValueError(
            f"lora_shrink needs a float32 h and an int32 index; got {h.dtype}, "
            f"{[t.dtype for t in index]}"
        )
    if num_tokens == 0:
        return
    block_k = config.block_k
    steps_per_split = triton.cdiv(triton.cdiv(hidden, config.split_k), block_k)
    split_k = triton.cdiv(hidden, steps_per_split * block_k)  # no split without columns
    num_tiles = triton.cdiv(num_tokens, config.block_m)
    use_pdl = config.pdl and gdc_wait is not None and supports_pdl(x.device)
    grid = (
        num_slots,
        num_tiles,
        split_k * triton.cdiv(rank, config.block_n),
    )
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        token_slots,
        row_ids,
        slot_starts,
        h,
        num_tokens,
        rank,
        hidden,
        split_k,
        steps_per_split,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        h.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        ONE_TILE=num_tiles == 1,
        USE_PDL=use_pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=use_pdl,
    )
