"""Batched LoRA over mixed adapters (Punica's shrink/expand): every token row carries the device
slot of its adapter (-1: none), and one launch serves every slot of a batch.

``lora_a`` is stacked ``[num_slots, R, K]`` and ``lora_b`` ``[num_slots, N, R]`` per slot; slots
are fixed-size (rank padded with zeros to ``R``), so shapes never change between steps and a
CUDA graph captured once serves any mix of adapters. No function here syncs with the host: the
host, which knows every row's slot, builds the step's ``LoRAIndex`` (``build_lora_index``).

The shrink's result ``h`` is float32 ``[T, R]`` in a persistent scratch that is zero between
calls: the shrink adds into it (its K splits with atomic adds, so there is no memset launch),
and the expand zeroes the rows it read once every program has read them. On Hopper both
kernels use programmatic dependent launch: each grid starts while the kernel before it drains
and reads the index and the adapter's weights meanwhile, its activations only after that
kernel has ended. ``precompile_lora`` builds every variant a step can pick at start-up.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from bastion.ops._dispatch import triton_launcher, use_triton


class LoRAIndex(NamedTuple):
    """One step's rows by adapter slot, on the device. ``token_slots[t]`` is row t's slot (-1:
    none; the torch references read it); ``row_ids`` lists the rows with a slot grouped by slot,
    slot s's at ``row_ids[slot_starts[s]:slot_starts[s + 1]]`` (the kernels read these, so a
    program's tile of rows is one adapter's)."""

    token_slots: torch.Tensor  # int32 [>= T]
    row_ids: torch.Tensor  # int32 [>= T]
    slot_starts: torch.Tensor  # int32 [num_slots + 1]


def build_lora_index(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row_ids, slot_starts)`` of one step's slots, on the host (``LoRAIndex``'s layout)."""
    slots = np.asarray(token_slots, dtype=np.int32)
    with_slot = np.flatnonzero(slots >= 0)
    row_ids = with_slot[np.argsort(slots[with_slot], kind="stable")].astype(np.int32)
    starts = np.searchsorted(slots[row_ids], np.arange(num_slots + 1), side="left")
    return row_ids, starts.astype(np.int32)


class ShrinkConfig(NamedTuple):
    block_m: int  # rows of a tile (all one slot's)
    block_n: int  # rank columns of a tile
    block_k: int  # input columns a step of the K loop reads
    split_k: int  # programs the K reduction is spread over (their atomic adds meet in h)
    num_warps: int
    num_stages: int
    pdl: bool = True  # programmatic dependent launch, where the GPU has it (Hopper on)


class ExpandConfig(NamedTuple):
    block_m: int
    block_n: int  # output columns of a tile
    block_k: int  # rank columns a step of the rank loop reads
    num_warps: int
    num_stages: int
    pdl: bool = True


# Decode batches are latency-bound (a rank-16 adapter is ~4 MB a layer, read in microseconds):
# what counts is programs enough to fill the SMs, each with one short K step. The shrink spreads
# K over about _DECODE_SPLITS programs a tile of rows, one step of 64-256 columns each, up to
# _SHRINK_PROGRAMS programs in all and _MAX_ATOMIC_ROWS rows of atomic adds (split * T); prefill
# (from _PREFILL_TOKENS rows) walks K in steps of 64, splitting it only while the row tiles are
# few, into ranges of at least _MIN_PREFILL_COLUMNS. Measured on an H200 (Llama-3.1-8B shapes,
# rank 16, scripts/bench_lora_kernels.py --sweep): a decode shrink takes 2.0-2.7 us a launch
# (an empty Triton launch 1.1 us); down_proj's at batch 256 8.3 us in 16 ranges of 896 columns,
# 4.6 us in 112 of 128; at 2048 rows 85 us unsplit, 23 us in 8 ranges.
_DECODE_SPLITS = 64
_SHRINK_PROGRAMS = 256
_MAX_ATOMIC_ROWS = 16384
_PREFILL_TOKENS = 2048
_MIN_PREFILL_COLUMNS = 1024


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 128 else 64


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def shrink_config(num_tokens: int, hidden: int, rank: int) -> ShrinkConfig:
    """The shrink's tiles and K split for ``[num_tokens, hidden] @ [hidden, rank]``."""
    block_n = min(64, max(16, _pow2(rank)))
    if num_tokens >= _PREFILL_TOKENS:
        block_m, block_k, min_columns, num_stages = 64, 64, _MIN_PREFILL_COLUMNS, 3
    else:
        block_m = _block_m(num_tokens)
        block_k = min(256, max(64, _pow2(-(-hidden // _DECODE_SPLITS))))
        min_columns, num_stages = block_k, 1
    tiles = -(-num_tokens // block_m) * -(-rank // block_n)
    split = min(
        -(-hidden // min_columns),
        max(1, _SHRINK_PROGRAMS // tiles),
        max(1, _MAX_ATOMIC_ROWS // num_tokens),
    )
    if split * block_k < hidden and num_stages == 1 and block_m * block_k <= 8192:
        # Several K steps a program: load the next while one multiplies (not for 64 x 256
        # tiles: two stages of those take 120 KB of shared memory, one program an SM).
        num_stages = 2
    return ShrinkConfig(block_m, block_n, block_k, split, 4, num_stages)


def expand_config(num_tokens: int, out_features: int, slice_rank: int) -> ExpandConfig:
    """The expand's tiles for ``[num_tokens, R] @ [R, out_features]``, where each output
    column reads only ``slice_rank`` of R (its slice's block of a fused layer's B). Column
    tiles of 128 but for small decode batches of small layers (measured as the shrink's; 4
    adapters' gate_up at batch 8: 5.8 us at 128 columns, 7.3 at 64)."""
    block_k = min(64, max(16, _pow2(slice_rank)))
    block_m = _block_m(num_tokens) if num_tokens < _PREFILL_TOKENS else 64
    block_n = 64 if num_tokens <= 16 and out_features < 16384 else 128
    return ExpandConfig(block_m, block_n, block_k, 4, 1 if num_tokens < _PREFILL_TOKENS else 2)


def max_row_tiles(max_tokens: int) -> int:
    """Row tiles a slot can have in a batch of up to ``max_tokens`` (the expand's counters)."""
    return -(-max_tokens // 16)


def kernel_variants(
    max_tokens: int, hidden: int, rank: int, out_features: int, num_slices: int
) -> list[tuple[int, ShrinkConfig, ExpandConfig]]:
    """``(rows, shrink config, expand config)`` for each kernel variant a batch of up to
    ``max_tokens`` rows picks: a variant is the configs but the split (a runtime value, as the
    batch size is) and whether the batch is one tile; ``rows`` is a batch that builds it."""
    variants, seen = [], set()
    for num_tokens in range(1, max_tokens + 1):
        s_config = shrink_config(num_tokens, hidden, rank)
        e_config = expand_config(num_tokens, out_features, rank // num_slices)
        # NOTE: both kernels tile rows alike; one row past a tile stands for any larger batch.
        is_one_tile = num_tokens <= s_config.block_m
        key = (s_config._replace(split_k=0), e_config, is_one_tile)
        if key not in seen:
            seen.add(key)
            rows = num_tokens if is_one_tile else s_config.block_m + 1
            variants.append((rows, s_config, e_config))
    return variants


def precompile_lora(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_ends: tuple[int, ...],
    index: LoRAIndex,
    scales: torch.Tensor,
    tile_counts: torch.Tensor,
    max_tokens: int,
) -> None:
    """Launch one layer's shrink and expand once for each of ``kernel_variants``, so that
    Triton builds them at start-up, not in a step (a build takes about a second). ``index``
    must have no row in a slot: then the kernels read and write nothing."""
    if not use_triton(lora_a, lora_b, *index, scales, tile_counts):
        return
    shrink = triton_launcher("lora_shrink", "lora_shrink_triton")
    expand = triton_launcher("lora_expand", "lora_expand_triton")
    if shrink is None or expand is None:
        return
    rank, hidden = lora_a.shape[1:]
    out_features = lora_b.shape[1]
    for rows, s_config, e_config in kernel_variants(
        max_tokens, hidden, rank, out_features, len(slice_ends)
    ):
        x = torch.zeros(rows, hidden, dtype=lora_a.dtype, device=lora_a.device)
        h = torch.zeros(rows, rank, dtype=torch.float32, device=lora_a.device)
        y = torch.zeros(rows, out_features, dtype=lora_a.dtype, device=lora_a.device)
        shrink(x, lora_a, index, h, s_config)
        expand(h, lora_b, index, scales, y, tile_counts, slice_ends, e_config)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, index: LoRAIndex, h: torch.Tensor) -> None:
    """``h[t] += x[t] @ lora_a[token_slots[t]]^T`` (float32 ``[T, R]``, zero on entry) for the
    rows with a slot; rows of slot -1 are left as they are."""
    if use_triton(x, lora_a, *index, h):
        launcher = triton_launcher("lora_shrink", "lora_shrink_triton")
        if launcher is not None:
            config = shrink_config(x.shape[0], x.shape[1], lora_a.shape[1])
            launcher(x, lora_a, index, h, config)
            return
    lora_shrink_ref(x, lora_a, index.token_slots, h)


def lora_expand(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    index: LoRAIndex,
    scales: torch.Tensor,
    y: torch.Tensor,
    tile_counts: torch.Tensor,
    slice_ends: tuple[int, ...] | None = None,
) -> None:
    """``y[t] += scales[s] * h[t] @ lora_b[s]^T`` with ``s = token_slots[t]``, in place, then
    ``h[t] = 0``; rows of slot -1 are left exactly as they are (the base model's output).

    ``slice_ends``: where each slice of a fused layer's output ends (default: one slice); B must
    be block-diagonal over them (slice i's columns read only rank block i), and the kernel reads
    only those blocks. ``tile_counts`` (int32 ``[num_slots, max_row_tiles]``, zero between
    calls) counts the programs that have read a tile of h."""
    ends = slice_ends if slice_ends is not None else (y.shape[1],)
    if use_triton(h, lora_b, *index, scales, y, tile_counts):
        launcher = triton_launcher("lora_expand", "lora_expand_triton")
        if launcher is not None:
            config = expand_config(h.shape[0], y.shape[1], h.shape[1] // len(ends))
            launcher(h, lora_b, index, scales, y, tile_counts, ends, config)
            return
    lora_expand_ref(h, lora_b, index.token_slots, scales, y)


def lora_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, h: torch.Tensor
) -> None:
    # One matmul per slot over all rows, kept where the row is that slot's: no host sync, and
    # a row's value is exactly its own adapter's product.
    slots = token_slots[: x.shape[0]].view(-1, 1)
    for slot in range(lora_a.shape[0]):
        part = x.float() @ lora_a[slot].float().T
        h.copy_(torch.where(slots == slot, h + part, h))


def lora_expand_ref(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    y: torch.Tensor,
) -> None:
    slots = token_slots[: h.shape[0]].view(-1, 1)
    for slot in range(lora_b.shape[0]):
        part = (h @ lora_b[slot].float().T) * scales[slot]
        y.copy_(torch.where(slots == slot, (y.float() + part).to(y.dtype), y))
    h.masked_fill_(slots >= 0, 0.0)
