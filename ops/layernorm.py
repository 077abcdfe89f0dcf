"""RMS normalisation, alone and fused with the residual add.

On a GPU, Triton kernels; on the CPU, float32 rows go through a C kernel (``cpu/rms_norm.c``),
other dtypes through the torch reference.
"""

from __future__ import annotations

import torch
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.cpu import rms_norm as cpu_rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in float32, returned in ``x.dtype``."""
    if use_triton(x):
        launcher = triton_launcher("rms_norm", "rms_norm_triton")
        if launcher is not None:
            return launcher(x, weight, eps)
    if cpu_rms_norm.can_run(x, weight):
        return cpu_rms_norm.rms_norm_cpu(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``."""
    if use_triton(x):
        launcher = triton_launcher("fused_add_rms_norm", "fused_add_rms_norm_triton")
        if launcher is not None:
            return launcher(x, residual, weight, eps)
    if cpu_rms_norm.can_run(x, weight) and residual.dtype == torch.float32:
        return cpu_rms_norm.rms_norm_cpu(x, weight, eps, residual)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual
