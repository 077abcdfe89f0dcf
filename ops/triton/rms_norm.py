"""RMSNorm over the last dim, one program per row, float32 statistics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    stride_x,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / HIDDEN
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim of ``x`` [..., H], computed in
    float32 and returned in ``x.dtype``. Rows may be strided (e.g. per-head q/k norms)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(
            f"weight must be [{hidden}] for x {tuple(x.shape)}; got {tuple(weight.shape)}"
        )
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(
            "rms_norm needs the hidden dim contiguous (stride 1) and weight contiguous"
        )
    # reshape keeps a view where it can (per-head norms on a [T, H, D] slice stay zero-copy).
    x2 = x.reshape(-1, hidden)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.view(x.shape)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        out, x2, weight, x2.stride(0), out.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out.view(x.shape)
