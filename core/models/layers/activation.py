"""Activation modules."""

from __future__ import annotations

import torch
from bastion.ops.activation import silu_and_mul
from torch import nn


class SiluAndMul(nn.Module):
    """[T, 2I] -> silu(first half) * second half, [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
