"""Gated activations: Triton on a GPU, a C kernel for float32 CPU rows (``cpu/activation.c``),
the torch reference otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.cpu import activation as cpu_activation


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, 2I] -> ``silu(x[:, :I]) * x[:, I:]`` [T, I]."""
    if use_triton(x):
        launcher = triton_launcher("silu_and_mul", "silu_and_mul_triton")
        if launcher is not None:
            return launcher(x)
    if cpu_activation.can_run(x):
        return cpu_activation.silu_and_mul_cpu(x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
