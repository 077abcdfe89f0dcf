"""MoE align: (token, expert) pairs grouped by local expert, each group padded to the GEMM's
row block, all on the device.

The grouped GEMM (``fused_moe.py``) runs one ``BLOCK_M``-row block per program, every row of
a block belonging to the same expert. This kernel writes, for the flattened ``topk_ids``
(pair ``p`` = token ``p // k``, choice ``p % k``):

- ``sorted_pair_ids``: the pair ids of expert 0, padded with ``num_pairs`` (the sentinel) to a
  multiple of ``BLOCK_M``, then those of expert 1, ...; pairs whose expert lives on another
  expert-parallel rank (or whose id is negative: padding rows) appear nowhere;
- ``block_expert_ids``: the local expert of each block, -1 past the end;
- ``num_sorted``: the padded length actually used (a device scalar, so no host sync).

The buffers have a static size that depends only on ``num_pairs`` (``max_sorted_len``), so a
CUDA graph can hold them. One program does everything: a histogram per chunk of pairs, an
exclusive scan of the padded counts, then each pair takes its slot with an atomic increment
of its expert's cursor. The order inside an expert's rows is whatever the atomics give; the
GEMM's rows are independent, so results do not depend on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion import envs
from bastion.ops.triton.pdl import release_early, use_grouped_moe_pdl, wait_for_previous


@triton.jit
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_sorted_ptr,
    cursor_ptr,
    num_pairs,
    expert_offset,
    max_sorted,
    max_blocks,
    NUM_LOCAL: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNK_B: tl.constexpr,
    RELAXED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    wait_for_previous(USE_PDL)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32) - expert_offset
        e = tl.where(ok & (e >= 0) & (e < NUM_LOCAL), e, NUM_LOCAL)  # NUM_LOCAL: not here
        counts += tl.histogram(e, NUM_BINS)
    counts = tl.where(bins < NUM_LOCAL, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_sorted_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + bins, ends - padded)
    # Block b starts at row b * BLOCK_M; its expert is the first whose end lies beyond that
    # (experts with no pairs have end == start and are skipped by the count).
    for bstart in range(0, max_blocks, CHUNK_B):
        b = bstart + tl.arange(0, CHUNK_B)
        owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < NUM_LOCAL, owner, -1),
                 mask=b < max_blocks)
    for start in range(0, max_sorted, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs,
                 mask=offs < max_sorted)
    # NOTE: the cursors and the sentinel fill must be visible to every thread before the
    # scatter below takes slots and overwrites sentinels.
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32) - expert_offset
        ok = ok & (e >= 0) & (e < NUM_LOCAL)
        cursors = cursor_ptr + tl.where(ok, e, 0)
        if RELAXED:
            # Only this program touches the cursors, and the barrier above orders their
            # stores before these: no fence is needed (Triton's default, acq_rel at GPU scope,
            # puts MEMBAR.GPU before and an L1 invalidate after each atomic in sm_90 SASS).
            slot = tl.atomic_add(cursors, 1, mask=ok, sem="relaxed", scope="cta")
        else:
            slot = tl.atomic_add(cursors, 1, mask=ok)
        tl.store(sorted_ptr + slot, offs, mask=ok)


def max_sorted_len(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Rows the aligned pairs can need at most: every expert that has a pair pads it to a
    multiple of ``block_m``."""
    return num_pairs + min(num_local_experts, num_pairs) * (block_m - 1)


def moe_align_triton(topk_ids: torch.Tensor, block_m: int, num_local_experts: int,
                     expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids`` [T, k] (global expert ids; negative = no expert) -> (sorted_pair_ids int32
    [S], block_expert_ids int32 [ceil(S / block_m)], num_sorted int32 [1]), S =
    ``max_sorted_len``."""
    if topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        raise ValueError(f"moe align expects contiguous [T, k] ids; got {tuple(topk_ids.shape)}")
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two; got {block_m}")
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_sorted = max_sorted_len(num_pairs, num_local_experts, block_m)
    max_blocks = triton.cdiv(max_sorted, block_m)
    sorted_ids = torch.empty(max_sorted, dtype=torch.int32, device=device)
    block_experts = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=device)
    num_sorted = torch.empty(1, dtype=torch.int32, device=device)
    num_bins = triton.next_power_of_2(num_local_experts + 1)
    cursor = torch.empty(num_bins, dtype=torch.int32, device=device)
    chunk = 1024 if num_pairs <= 4096 else 4096
    pdl = use_grouped_moe_pdl(device)
    _moe_align_kernel[(1,)](
        topk_ids, sorted_ids, block_experts, num_sorted, cursor, num_pairs, expert_offset,
        max_sorted, max_blocks, NUM_LOCAL=num_local_experts, NUM_BINS=num_bins,
        BLOCK_M=block_m, CHUNK=chunk, CHUNK_B=max(16, 8192 // num_bins),
        RELAXED=envs.get("BASTION_MOE_ALIGN_RELAXED"), USE_PDL=pdl,
        num_warps=8 if chunk == 1024 else 16, launch_pdl=bool(pdl))
    return sorted_ids, block_experts, num_sorted
