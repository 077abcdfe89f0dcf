"""Mixture-of-experts layer: softmax top-k routing over stacked expert weights.

Two ways to split the experts over ranks:
- expert parallel (EP group larger than one rank): each rank holds ``E / ep_size`` whole experts;
  tokens are all-gathered over the EP group (every rank runs the same padded row count, so
  the buffers have a fixed size and a CUDA graph can hold the collectives), every rank
  applies its own experts to all of them, and a reduce-scatter returns each rank the sum for
  its own tokens.
- otherwise tensor parallel: every rank holds all experts with their intermediate dim split,
  and the partial outputs are all-reduced like a row-parallel layer.
"""

from __future__ import annotations

import torch
from bastion.core.forward_context import get_forward_context
from bastion.ops.communicator import get_ep_group, get_tp_group
from bastion.ops.moe import fused_moe, select_experts
from torch import nn


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.tp, self.ep = get_tp_group(), get_ep_group()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if self.ep.world_size > 1:
            if num_experts % self.ep.world_size:
                raise ValueError(f"num_experts ({num_experts}) is not divisible by the expert "
                                 f"parallel size ({self.ep.world_size})")
            self.num_local_experts = num_experts // self.ep.world_size
            self.expert_offset = self.ep.rank * self.num_local_experts
            self.intermediate_per_rank = intermediate_size
        else:
            if intermediate_size % self.tp.world_size:
                raise ValueError(f"moe_intermediate_size ({intermediate_size}) is not divisible "
                                 f"by tensor_parallel_size ({self.tp.world_size})")
            self.num_local_experts, self.expert_offset = num_experts, 0
            self.intermediate_per_rank = intermediate_size // self.tp.world_size
        size = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, size),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        """``shard_id`` is ``w1`` (gate [I, H]), ``w3`` (up [I, H]), ``w2`` (down [H, I]) of
        global expert ``expert_id``, or ``w13`` ([E, 2I, H], gate then up) / ``w2`` ([E, H, I])
        of all experts when ``expert_id`` is None. Experts of other EP ranks are skipped."""
        if expert_id is None:
            for e in range(loaded.shape[0]):
                if shard_id == "w13":
                    gate, up = loaded[e].chunk(2, dim=0)
                    self.weight_loader(param, gate, "w1", e)
                    self.weight_loader(param, up, "w3", e)
                else:
                    self.weight_loader(param, loaded[e], shard_id, e)
            return
        local = expert_id - self.expert_offset
        if not 0 <= local < self.num_local_experts:
            return
        size = self.intermediate_per_rank
        tp_rank = self.tp.rank if self.ep.world_size == 1 else 0
        if shard_id in ("w1", "w3"):
            target = param.data[local].narrow(0, 0 if shard_id == "w1" else size, size)
            source = loaded.narrow(0, tp_rank * size, size)
        elif shard_id == "w2":
            target, source = param.data[local], loaded.narrow(1, tp_rank * size, size)
        else:
            raise ValueError(f"FusedMoE shard_id must be w1, w2, w3 or w13; got {shard_id!r}")
        if target.shape != source.shape:
            raise ValueError(f"expert {expert_id} {shard_id}: shape {tuple(loaded.shape)} does "
                             f"not fit the layer")
        target.copy_(source)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # Rows past the step's real tokens (CUDA-graph or DP-lockstep padding) choose no
        # expert: the count is the forward context's last query start, read on the device.
        meta = get_forward_context()
        num_real = meta.query_start_loc[-1:] if meta is not None else None
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize,
                                                num_real)
        if self.ep.world_size == 1:
            # Padding rows' outputs are junk that no later op mixes into real rows.
            out = fused_moe(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                            padding_only_unrouted=True)
            return self.tp.all_reduce(out)
        # NOTE: every EP rank runs the same number of rows (the DP group agreed on a padded
        # size for the step), so the gather and the reduce-scatter have static shapes and no
        # row count crosses to the host. With TP inside the EP group the TP ranks gather
        # identical tokens; the reduce-scatter still returns every rank the full sum for its
        # own copy.
        out = fused_moe(self.ep.all_gather(hidden, dim=0), self.w13_weight, self.w2_weight,
                        self.ep.all_gather(topk_weights, dim=0),
                        self.ep.all_gather(topk_ids, dim=0), self.expert_offset)
        return self.ep.reduce_scatter(out, dim=0)
