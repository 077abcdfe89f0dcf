"""Merging the per-split partials of split-context (flash-decoding) attention: ``merge_splits``,
which the attention kernel's last split calls, and a second kernel that does the same for a
whole launch (``BASTION_FUSED_SPLIT_MERGE=0``).

Split s of a (token, head) left an unnormalised output ``acc_s``, its running max ``m_s`` (log2
domain, -inf when the split saw no key) and running sum ``l_s``. The exact softmax result is
``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` with ``M = max_s m_s``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.triton.pdl import release_early, use_pdl, wait_for_previous


@triton.jit
def merge_splits(part_out_ptr, part_ml_ptr, first, row_ok, offs_d, ROWS: tl.constexpr,
                 HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, live):
    """The merged output [ROWS, HEAD_PAD] (float32) of (token, head) rows whose split 0 is at
    partial row ``first`` [ROWS] (the splits follow it); only the first ``live`` splits wrote
    theirs. Partials are read from L2 (``.cg``): the fused merge reads what other programs of
    the same launch wrote. A row no split saw comes out 0."""
    split = tl.zeros([ROWS], dtype=tl.int32)  # split + s: a split index as a tensor
    m_all = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(part_ml_ptr + (first + s) * 2, mask=row_ok & (split + s < live),
                      other=float("-inf"), cache_modifier=".cg")
        m_all = tl.maximum(m_all, m_s)
    m_all = tl.where(m_all > float("-inf"), m_all, 0.0)
    num = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)
    den = tl.zeros([ROWS], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        ok = row_ok & (split + s < live)
        m_s = tl.load(part_ml_ptr + (first + s) * 2, mask=ok, other=float("-inf"),
                      cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + (first + s) * 2 + 1, mask=ok, other=0.0,
                      cache_modifier=".cg")
        acc_s = tl.load(part_out_ptr + (first + s)[:, None] * HEAD_PAD + offs_d[None, :],
                        mask=ok[:, None], other=0.0, cache_modifier=".cg")
        w = tl.exp2(m_s - m_all)
        num += acc_s * w[:, None]
        den += l_s * w
    return num / tl.where(den > 0.0, den, 1.0)[:, None]


@triton.jit(do_not_specialize=["num_seqs"])  # it changes every step: no variant per count
def _merge_attention_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_out_ptr,  # [T, Hq, NUM_SPLITS, HEAD_PAD] float32
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] float32
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    wait_for_previous(USE_PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    out_row = out_ptr + tok.to(tl.int64) * stride_o_t + head * stride_o_h
    # NOTE: tokens past the last sequence are CUDA-graph padding; no split wrote them.
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        tl.store(out_row + offs_d, tl.zeros([HEAD_PAD], dtype=tl.float32), mask=d_ok)
        return
    first = (tok.to(tl.int64) * num_heads + head) * NUM_SPLITS + tl.zeros([1], dtype=tl.int64)
    out = merge_splits(part_out_ptr, part_ml_ptr, first, first >= 0, offs_d, 1, HEAD_PAD,
                       NUM_SPLITS, NUM_SPLITS)  # every split stored its partial
    tl.store(out_row + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=d_ok[None, :])


def merge_attention_splits_triton(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_ml: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: int,
) -> None:
    """Write into ``out`` [T, Hq, D] the merge of ``part_out`` [T, Hq, S, HEAD_PAD] (float32,
    unnormalised) and ``part_ml`` [T, Hq, S, 2] (running max in log2 units, running sum)."""
    num_tokens, num_heads, head_dim = out.shape
    num_splits, head_pad = part_out.shape[2], part_out.shape[3]
    if part_out.shape[:2] != out.shape[:2] or part_ml.shape != (*part_out.shape[:3], 2):
        raise ValueError(
            f"partials {tuple(part_out.shape)} / {tuple(part_ml.shape)} do not match "
            f"out {tuple(out.shape)}"
        )
    if not (part_out.is_contiguous() and part_ml.is_contiguous()) or out.stride(2) != 1:
        raise ValueError("partials must be contiguous and out's head dim must have stride 1")
    if part_out.dtype != torch.float32 or part_ml.dtype != torch.float32 or head_pad < head_dim:
        raise ValueError("partials must be float32 with a padded head dim >= head dim")
    if num_tokens == 0:
        return
    pdl = use_pdl(out.device)
    _merge_attention_splits_kernel[(num_tokens, num_heads)](
        out, part_out, part_ml, query_start_loc, num_seqs, num_heads,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=num_splits, USE_PDL=pdl,
        num_warps=4 if head_pad >= 128 else 2, launch_pdl=bool(pdl),
    )  # fmt: skip
