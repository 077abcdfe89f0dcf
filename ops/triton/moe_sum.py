"""MoE combine: each token's sum over its k expert outputs (already scaled by their routing
weights), ``[T, k, H] -> [T, H]``, accumulated in float32.

``torch.sum`` over the middle dim of that view runs a generic strided reduction (13 us for 256
tokens of Qwen3-30B-A3B on an H200, against 2 us of bytes); here one program reads its
columns of the k rows, which lie next to each other, and writes one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.triton.pdl import release_early, use_grouped_moe_pdl, wait_for_previous


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    release_early(USE_PDL)
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (token * TOP_K + k) * hidden + cols, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum_triton(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous [T, k, H] -> [T, H] in ``x.dtype``."""
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"moe_sum expects a contiguous [T, k, H]; got {tuple(x.shape)}")
    num_tokens, top_k, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    pdl = use_grouped_moe_pdl(x.device)
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        x, out, hidden, TOP_K=top_k, BLOCK=block, USE_PDL=pdl, num_warps=4,
        launch_pdl=bool(pdl))
    return out
