"""SwiGLU activation: ``silu(x[:, :I]) * x[:, I:]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.triton.pdl import release_early, use_pdl, wait_for_previous


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,
    x_ptr,
    stride_x,
    stride_out,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the input dtype before the product, as torch's silu(x) * up does.
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, 2I] -> ``silu(x[:, :I]) * x[:, I:]`` [T, I] in ``x.dtype``."""
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"silu_and_mul expects [T, 2I]; got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs the last dim contiguous (stride 1)")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    pdl = use_pdl(x.device)
    _silu_and_mul_kernel[grid](
        out, x, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, USE_PDL=pdl, num_warps=4,
        launch_pdl=bool(pdl),
    )
    return out
