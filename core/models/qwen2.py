"""Qwen2: Llama with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from bastion.core.models.llama import LlamaAttention, LlamaForCausalLM
from torch import nn
from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: PretrainedConfig) -> nn.Module:
        return LlamaAttention(config, qkv_bias=True, o_bias=False, qk_norm=False)
