"""A grammar's next-token bitmask applied to the logits rows it belongs to, in one launch.

``logits[rows[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is clear: row ``i`` of the
bitmask is the ``i``-th grammar row in the order the engine filled them, and ``rows`` maps it
to its logits row, so the host copies the filled rows as they are instead of gathering them
into the logits' order first (xgrammar's own kernel reads bitmask row ``r`` for logits row
``r``). Only masked tokens are written. The torch reference is
``bastion.core.structured_output.bitmask.apply_token_bitmask_reference``.
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
    rows_ptr,
    vocab_size,
    stride_logits,
    stride_bitmask,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = tokens < vocab_size
    words = tl.load(bitmask_ptr + i.to(tl.int64) * stride_bitmask + tokens // 32, mask=ok,
                    other=-1)
    allowed = (words >> (tokens % 32)) & 1
    tl.store(logits_ptr + row * stride_logits + tokens,
             tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty),
             mask=ok & (allowed == 0))


def apply_bitmask_rows_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                              rows: torch.Tensor) -> None:
    """In place: ``logits`` [N, V] (float), ``bitmask`` int32 [R, ceil(V / 32)] (at least),
    ``rows`` int32 or int64 [R] on the logits' device, distinct."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with a contiguous last dim; got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    num_rows, vocab_size = rows.shape[0], logits.shape[1]
    if (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1
            or bitmask.shape[0] < num_rows or bitmask.shape[1] * 32 < vocab_size):
        raise ValueError(f"bitmask must be int32 [>= {num_rows}, >= {-(-vocab_size // 32)}] "
                         f"with a contiguous last dim; got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if num_rows == 0:
        return
    _apply_bitmask_rows_kernel[(num_rows, triton.cdiv(vocab_size, _BLOCK))](
        logits, bitmask, rows, vocab_size, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK,
        num_warps=4)
