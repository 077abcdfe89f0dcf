"""Residual add fused with RMSNorm: one read of x and residual, one write of each result."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bastion.ops.triton.pdl import release_early, use_pdl, wait_for_previous


class AddRMSNormOutput(NamedTuple):
    out: torch.Tensor
    residual: torch.Tensor


@triton.jit
def _fused_add_rms_norm_kernel(
    out_ptr,
    new_res_ptr,
    x_ptr,
    res_ptr,
    weight_ptr,
    stride_x,
    stride_res,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    # NOTE: the sum is rounded to the activation dtype before the norm, exactly as the
    # unfused `residual = x + residual; rms_norm(residual)` would see it.
    s = (x + r).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * HIDDEN + offs, s, mask=mask)
    s = s.to(tl.float32)
    var = tl.sum(s * s, axis=0) / HIDDEN
    y = s * tl.math.rsqrt(var + eps) * w
    tl.store(out_ptr + row * HIDDEN + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> AddRMSNormOutput:
    """Return ``(rms_norm(x + residual), x + residual)`` for ``x``, ``residual`` [T, H]; new
    tensors in ``x.dtype`` (the inputs are not modified)."""
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(
            f"expected x, residual [T, H] and weight [H]; got {tuple(x.shape)}, "
            f"{tuple(residual.shape)}, {tuple(weight.shape)}"
        )
    if x.dtype != residual.dtype:
        raise ValueError(f"x and residual dtypes differ: {x.dtype} vs {residual.dtype}")
    if x.stride(1) != 1 or residual.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("fused_add_rms_norm needs the hidden dim contiguous (stride 1)")
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out)
    if num_tokens == 0:
        return AddRMSNormOutput(out, new_residual)
    block = triton.next_power_of_2(hidden)
    pdl = use_pdl(x.device)
    _fused_add_rms_norm_kernel[(num_tokens,)](
        out, new_residual, x, residual, weight, x.stride(0), residual.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, USE_PDL=pdl, num_warps=min(16, max(1, block // 256)),
        launch_pdl=bool(pdl),
    )  # fmt: skip
    return AddRMSNormOutput(out, new_residual)
