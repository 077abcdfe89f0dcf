"""Mixture-of-experts feed-forward over routed tokens."""

from __future__ import annotations

import torch
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.activation import silu_and_mul_ref


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_offset: int = 0) -> torch.Tensor:
    """Sum over each token's top-k experts of ``weight * w2_e(silu(gate_e x) * up_e x)``.

    ``w13`` [E_local, 2I, H] holds gate (first I rows) then up; ``w2`` [E_local, H, I].
    ``topk_ids`` are global expert ids; only experts in ``[expert_offset, expert_offset + E_local)``
    live here, the others contribute zero (expert parallelism sums partial results across ranks).
    """
    if use_triton(hidden, w13):
        launcher = triton_launcher("fused_moe", "fused_moe_triton")
        if launcher is not None:
            return launcher(hidden, w13, w2, topk_weights, topk_ids, expert_offset)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, expert_offset)


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_offset: int = 0) -> torch.Tensor:
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    local_ids = topk_ids - expert_offset
    num_local = w13.shape[0]
    for e in torch.unique(local_ids).tolist():
        if not 0 <= e < num_local:
            continue
        token_idx, k_idx = torch.nonzero(local_ids == e, as_tuple=True)
        x = hidden[token_idx]
        y = silu_and_mul_ref(x @ w13[e].t()) @ w2[e].t()
        weights = topk_weights[token_idx, k_idx].unsqueeze(-1)
        out.index_add_(0, token_idx, y.float() * weights)
    return out.to(hidden.dtype)
