"""The CPU's fused decode path for Llama-shaped models (``ops/cpu/decoder_layers.c``): a pure
decode step of up to 16 rows through every decoder layer and the final norm in one C call,
where the op-by-op path makes ~10 torch ops and 7 ctypes calls a layer.

It runs where the C kernels are on, activations are float32, every linear layer is int4 in
``pack_q4``'s layout without bias, LoRA or tensor parallelism, there are no per-head q/k norms
(Qwen3) and the MLP is dense (not Qwen3-MoE), and the step has one new token per sequence.
Below ``DENSE_MIN_ROWS`` rows it computes exactly what the op-by-op path would; from there to
``decoder_layers.MAX_ROWS`` its linear layers keep the int4 kernel (16-bit activations) where
the op-by-op path's take the dense bfloat16 GEMM (bfloat16 activations), each row the same as
it would be in a step of fewer rows. Anywhere else the model's own loop runs, unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from bastion import envs
from bastion.core.models.layers.quantization import Int4WeightOnlyMethod
from bastion.core.models.layers.rotary_embedding import RotaryEmbedding
from bastion.ops.attention_metadata import AttentionMetadata
from bastion.ops.cpu import decoder_layers
from bastion.ops.cpu.decoder_layers import DecoderStack, LayerWeights


class FusedDecode:
    """The model's ``DecoderStack``, built at the first step it can run and again whenever the
    KV caches are reallocated (``layers``: the model's decoder layers)."""

    def __init__(self, layers: nn.ModuleList, final_norm: nn.Module) -> None:
        self.layers, self.final_norm = layers, final_norm
        self._attention: list[nn.Module] = []  # each layer's Attention, once supported
        # NOTE: the stack holds its caches, so a stale one keeps the old caches alive until
        # the next decode step rebuilds it; the identity test below stays sound because of it.
        self._stack: DecoderStack | None = None
        self._is_supported: bool | None = None  # of the weights: decided once

    def stack_for(self, hidden: torch.Tensor, meta: AttentionMetadata | None
                  ) -> DecoderStack | None:
        """The stack when this step can take it (``hidden`` [T, H], the embeddings), else
        None."""
        if (meta is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu"
                or not 1 <= hidden.shape[0] <= decoder_layers.MAX_ROWS or meta.max_query_len != 1
                or meta.num_seqs != hidden.shape[0] or decoder_layers.kernel() is None
                or not envs.get("BASTION_CPU_FUSED_DECODE")):
            return None
        if self._is_supported is None:
            self._is_supported = _is_supported(self.layers, self.final_norm)
            if self._is_supported:
                self._attention = [layer.self_attn.attn for layer in self.layers]
        if not self._is_supported:
            return None
        cache = self._attention[0].k_cache  # empty before the runner sizes it, None after a
        if cache is None or cache.numel() == 0:  # profiling run
            return None
        stack = self._stack
        if stack is None or not all(a.k_cache is w.k_cache and a.v_cache is w.v_cache
                                    for a, w in zip(self._attention, stack.layers)):
            self._stack = stack = self._build()
        return stack

    def _build(self) -> DecoderStack:
        first = self.layers[0].self_attn
        return DecoderStack(
            [LayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          layer.self_attn.qkv_proj.quant_method.q4,
                          layer.self_attn.o_proj.quant_method.q4,
                          layer.mlp.gate_up_proj.quant_method.q4,
                          layer.mlp.down_proj.quant_method.q4,
                          layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)
             for layer in self.layers],
            self.final_norm.weight, num_q_heads=first.attn.num_heads,
            num_kv_heads=first.attn.num_kv_heads, head_dim=first.head_dim,
            eps=self.final_norm.eps, scale=first.attn.scale,
            cos_sin_cache=first.rotary_emb.cos_sin_cache,
            levels=first.qkv_proj.quant_method.q4_levels)


def _is_supported(layers: nn.ModuleList, final_norm: nn.Module) -> bool:
    """Whether every layer is the plain Llama layer with int4 weights the C call reads, with
    the final norm's eps and the first layer's levels and rotary table."""
    from bastion.core.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    first = layers[0]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention
                or type(mlp) is not LlamaMLP or attn.q_norm is not None
                or type(attn.rotary_emb) is not RotaryEmbedding
                or not attn.rotary_emb.is_neox_style
                or not torch.equal(attn.rotary_emb.cos_sin_cache,
                                   first.self_attn.rotary_emb.cos_sin_cache)
                or layer.input_layernorm.eps != final_norm.eps
                or layer.post_attention_layernorm.eps != final_norm.eps):
            return False
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            method = linear.quant_method
            if (not isinstance(method, Int4WeightOnlyMethod) or method.q4 is None
                    or method.q4_levels != first.self_attn.qkv_proj.quant_method.q4_levels
                    or linear.bias is not None or linear.lora is not None
                    or linear.tp.world_size != 1):
                return False
    return True
