"""RMSNorm over the last dim, one program per row, float32 statistics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.triton.pdl import release_early, use_pdl, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    stride_x0,
    stride_x1,
    eps,
    NUM_INNER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    # Row r of the [R, NUM_INNER, HIDDEN] input: outer index r // NUM_INNER, inner r % NUM_INNER
    # (per-head q/k norms read the heads of a fused qkv row in place, without a copy).
    row = tl.program_id(0).to(tl.int64)
    x_row = (row // NUM_INNER) * stride_x0 + (row % NUM_INNER) * stride_x1
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + x_row + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / HIDDEN
    y = x * tl.math.rsqrt(var + eps) * w
    tl.store(out_ptr + row * HIDDEN + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim of ``x`` [..., H], computed in
    float32 and returned contiguous in ``x.dtype``. The last two dims may be strided apart
    (e.g. per-head q/k norms on a [T, heads, D] view of a fused qkv output), read in place."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(
            f"weight must be [{hidden}] for x {tuple(x.shape)}; got {tuple(weight.shape)}"
        )
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(
            "rms_norm needs the hidden dim contiguous (stride 1) and weight contiguous"
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # As [outer, inner, hidden]: a view for 1-D to 3-D inputs whatever their strides; higher
    # ranks flatten their leading dims (a copy only when those do not merge).
    if x.dim() <= 2:
        x3 = x.reshape(-1, 1, hidden) if x.dim() == 1 else x.unsqueeze(1)
    else:
        x3 = x.reshape(-1, x.shape[-2], hidden)
    block = triton.next_power_of_2(hidden)
    pdl = use_pdl(x.device)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        out, x3, weight, x3.stride(0), x3.stride(1), eps,
        NUM_INNER=x3.shape[1], HIDDEN=hidden, BLOCK=block, USE_PDL=pdl,
        num_warps=min(16, max(1, block // 256)), launch_pdl=bool(pdl),
    )  # fmt: skip
    return out
