"""Qwen3-MoE: Qwen3 attention; sparse MoE feed-forward on the layers the config selects."""

from __future__ import annotations

import torch
from bastion.core.models.layers.fused_moe import FusedMoE
from bastion.core.models.layers.linear import ReplicatedLinear
from bastion.core.models.llama import LlamaForCausalLM, LlamaMLP
from bastion.core.models.qwen3 import qwen3_attention
from bastion.ops.linear import gemv
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig


def num_experts_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        num_experts = num_experts_of(config)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size,
                                renormalize=bool(getattr(config, "norm_topk_prob", True)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, router_logits(hidden, self.gate.weight))


def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's logits in float32. Rounded to bf16 (steps of 2^-8 relative), two experts
    whose logits are that close swap places in the top-k, and the token's whole output
    changes; the GEMM still reads bf16 operands, only its output is kept wider."""
    if hidden.is_cuda and hidden.dtype != torch.float32:
        out = gemv(hidden, weight, out_dtype=torch.float32)  # decode rows
        return out if out is not None else torch.mm(hidden, weight.t(),
                                                    out_dtype=torch.float32)
    return F.linear(hidden, weight).float()


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: PretrainedConfig) -> nn.Module:
        return qwen3_attention(config)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        is_sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
                     and num_experts_of(config) > 0 and (layer_idx + 1) % step == 0)
        if is_sparse:
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)
