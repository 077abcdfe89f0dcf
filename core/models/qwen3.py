"""Qwen3: Llama with per-head RMSNorm on q and k (q_norm/k_norm), no q/k/v bias by default."""

from __future__ import annotations

from bastion.core.models.llama import LlamaAttention, LlamaForCausalLM
from torch import nn
from transformers import PretrainedConfig


def qwen3_attention(config: PretrainedConfig) -> LlamaAttention:
    bias = bool(getattr(config, "attention_bias", False))
    return LlamaAttention(config, qkv_bias=bias, o_bias=bias, qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: PretrainedConfig) -> nn.Module:
        return qwen3_attention(config)
