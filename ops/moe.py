"""Mixture-of-experts: routing and the feed-forward over routed tokens.

On CUDA both run as Triton kernels with no device-to-host sync (``ops/triton/moe_routing.py``,
``moe_align.py``, ``fused_moe.py``), so a MoE forward can be captured in a CUDA graph; the
torch references below serve the CPU and the tests.
"""

from __future__ import annotations

import torch
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.activation import silu_and_mul_ref


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_offset: int = 0, padding_only_unrouted: bool = False) -> torch.Tensor:
    """Sum over each token's top-k experts of ``weight * w2_e(silu(gate_e x) * up_e x)``.

    ``w13`` [E_local, 2I, H] holds gate (first I rows) then up; ``w2`` [E_local, H, I].
    ``topk_ids`` are global expert ids; only experts in ``[expert_offset, expert_offset + E_local)``
    live here, the others (and negative ids: padding rows) contribute zero (expert parallelism
    sums partial results across ranks). ``padding_only_unrouted``: the caller holds every
    expert, so only padding rows (id -1) go unrouted and their output may be left undefined.
    """
    if use_triton(hidden, w13):
        launcher = triton_launcher("fused_moe", "fused_moe_triton")
        if launcher is not None:
            return launcher(hidden, w13, w2, topk_weights, topk_ids, expert_offset,
                            zero_unrouted=not padding_only_unrouted)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, expert_offset)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   num_real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k (weights float32 [T, k], ids [T, k]),
    optionally renormalised to sum to 1. Rows at or past the device scalar ``num_real``
    (padding) get id -1: no expert."""
    if use_triton(router_logits):
        launcher = triton_launcher("moe_routing", "moe_routing_triton")
        if launcher is not None:
            return launcher(router_logits, top_k, renormalize, num_real)
    return select_experts_ref(router_logits, top_k, renormalize, num_real)


def select_experts_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       num_real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if num_real is not None:
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
        topk_ids = torch.where((rows < num_real)[:, None], topk_ids, -1)
    return topk_weights, topk_ids


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
