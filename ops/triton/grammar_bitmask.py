"""A grammar's next-token bitmask applied to the logits rows it belongs to, in one launch.

``logits[r, t] = -inf`` wherever bit ``t`` of ``bitmask[mask_rows[r]]`` is clear; a row whose
``mask_rows`` entry is -1 has no grammar and is not touched. The bitmask rows are in the order
the runner filled them and ``mask_rows`` maps each logits row to its own, so the host copies
the filled rows as they are instead of gathering them into the logits' order first. Only
masked tokens are written. The torch reference is
``bastion.core.structured_output.bitmask.apply_token_bitmask_reference``. (A plain sampling
step reads the bitmask inside the sampling kernel instead: ``ops/triton/sample.py``.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # tokens a program covers (128 words of the bitmask)


@triton.jit
def _apply_bitmask_rows_kernel(
    logits_ptr,
    bitmask_ptr,
    mask_rows_ptr,
    vocab_size,
    stride_logits,
    stride_bitmask,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    mask_row = tl.load(mask_rows_ptr + row).to(tl.int64)
    if mask_row >= 0:
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = tokens < vocab_size
        words = tl.load(bitmask_ptr + mask_row * stride_bitmask + tokens // 32, mask=ok,
                        other=-1)
        allowed = (words >> (tokens % 32)) & 1
        tl.store(logits_ptr + row * stride_logits + tokens,
                 tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty),
                 mask=ok & (allowed == 0))


def apply_bitmask_rows_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                              mask_rows: torch.Tensor) -> None:
    """In place: ``logits`` [N, V] (float), ``bitmask`` int32 [R, >= ceil(V / 32)],
    ``mask_rows`` int32 [N] (each logits row's bitmask row, -1 for none) on the logits'
    device."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with a contiguous last dim; got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    num_rows, vocab_size = logits.shape
    if (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1
            or bitmask.shape[1] * 32 < vocab_size):
        raise ValueError(f"bitmask must be int32 [R, >= {-(-vocab_size // 32)}] with a "
                         f"contiguous last dim; got {bitmask.dtype} {tuple(bitmask.shape)}")
    if mask_rows.shape != (num_rows,) or mask_rows.dtype != torch.int32:
        raise ValueError(f"mask_rows must be int32 [{num_rows}]; got {mask_rows.dtype} "
                         f"{tuple(mask_rows.shape)}")
    if num_rows == 0:
        return
    _apply_bitmask_rows_kernel[(num_rows, triton.cdiv(vocab_size, _BLOCK))](
        logits, bitmask, mask_rows, vocab_size, logits.stride(0), bitmask.stride(0),
        BLOCK=_BLOCK, num_warps=4)
