"""Llama family decoder (SmolLM2, Llama 3); Qwen2/Qwen3/Qwen3-MoE change it through hooks."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from bastion.core.forward_context import get_forward_context
from bastion.core.models.cpu_decode import FusedDecode
from bastion.core.models.layers.activation import SiluAndMul
from bastion.core.models.layers.attention import Attention
from bastion.core.models.layers.layernorm import RMSNorm
from bastion.core.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from bastion.core.models.layers.rotary_embedding import get_rope
from bastion.core.models.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from bastion.core.models.weights import default_dtype, load_hf_weights
from torch import nn
from transformers import PretrainedConfig


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """``qk_norm``: Qwen3's per-head RMSNorm on q and k before the rotary embedding."""

    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, total_heads,
                                          total_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(total_heads * head_dim, config.hidden_size, bias=o_bias)
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = get_rope(config, head_dim, config.max_position_embeddings)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim ** -0.5,
                              self.qkv_proj.num_kv_heads)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # One kernel: q/k norms (Qwen3), rotary, and the store of k and v in the KV cache.
        # It reads q, k and v in place from the fused output.
        fused = self.attn.kv_store_args(v)
        if self.q_norm is not None:
            fused.update(q_weight=self.q_norm.weight, k_weight=self.k_norm.weight,
                         eps=self.q_norm.eps)
        q, k = self.rotary_emb(positions, q, k, **fused)
        return self.o_proj(self.attn(q, k, v, kv_stored="k_cache" in fused))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = FusedDecode(self.layers, self.norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        meta = get_forward_context()
        stack = self.fused_decode.stack_for(hidden, meta)
        if stack is not None:  # a CPU decode step in one C call (core/models/cpu_decode.py)
            return stack.run(hidden, positions, meta)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM with vLLM's model interface.

    Subclasses change only ``make_attention`` / ``make_mlp`` (one level, no deeper).
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        with default_dtype(dtype):
            layers = [LlamaDecoderLayer(config, self.make_attention(config),
                                        self.make_mlp(config, i))
                      for i in range(config.num_hidden_layers)]
            self.model = LlamaModel(config, layers)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_attention(self, config: PretrainedConfig) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, qkv_bias=bias, o_bias=bias, qk_norm=False)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size,
                        bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions`` [T] -> hidden [T, H]; attention metadata comes from
        the forward context."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> float32 logits [N, vocab] over the full vocabulary."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face named tensors (this TP rank keeps its shard)."""
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_hf_weights(self, weights, skip=skip)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
