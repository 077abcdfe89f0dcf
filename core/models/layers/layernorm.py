"""RMSNorm module over the ops in ``bastion.ops.layernorm``."""

from __future__ import annotations

import torch
from bastion.ops.layernorm import fused_add_rms_norm, rms_norm
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: the normalised ``x``. With it: ``(norm(x + residual),
        x + residual)``, the pre-norm decoder's fused residual step."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
