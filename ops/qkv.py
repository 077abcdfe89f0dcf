"""A decoder layer's attention input: residual add and input RMSNorm, QKV projection, Qwen3's
per-head q/k norm, rotary embedding and the store of the new K/V in the paged cache.

Decode-sized batches on a GPU take one fused Triton kernel (``ops/triton/qkv_rope.py``);
everything else runs the unfused ops (which pick their own Triton kernels).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.layernorm import fused_add_rms_norm, rms_norm
from bastion.ops.rotary import apply_rotary_emb

# Batches of at most this many tokens take the fused kernel (env BASTION_FUSED_QKV_MAX_TOKENS,
# 0 turns it off): above it cuBLAS's GEMM beats the fused kernel's by more than the launches
# the fusion saves.
FUSED_MAX_TOKENS = int(os.environ.get("BASTION_FUSED_QKV_MAX_TOKENS", "256"))


def norm_qkv_rope(hidden: torch.Tensor, residual: torch.Tensor | None,
                  norm_weight: torch.Tensor, norm_eps: float, qkv_weight: torch.Tensor,
                  positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_q_heads: int,
                  num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  qk_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, Hq * D], new residual)`` for a pre-norm decoder layer (neox rotary over the
    whole head, no QKV bias). The new residual is ``hidden + residual``, or ``hidden`` when
    ``residual`` is None (the first layer). Keys (normed with ``k_weight`` when given, then
    rotated) and values are stored in the caches at ``slot_mapping`` (slots < 0 skipped)."""
    args = (hidden, residual, norm_weight, norm_eps, qkv_weight, positions, cos_sin_cache,
            num_q_heads, num_kv_heads, head_dim, k_cache, v_cache, slot_mapping, q_weight,
            k_weight, qk_eps)
    if 0 < hidden.shape[0] <= FUSED_MAX_TOKENS and use_triton(hidden, k_cache):
        launcher = triton_launcher("qkv_rope", "norm_qkv_rope_triton")
        if launcher is not None:
            return launcher(*args)
    return norm_qkv_rope_ref(*args)


def norm_qkv_rope_ref(hidden: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, norm_eps: float, qkv_weight: torch.Tensor,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_q_heads: int,
                      num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      q_weight: torch.Tensor | None = None,
                      k_weight: torch.Tensor | None = None,
                      qk_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with the unfused ops."""
    if residual is None:
        x, residual = rms_norm(hidden, norm_weight, norm_eps), hidden
    else:
        x, residual = fused_add_rms_norm(hidden, residual, norm_weight, norm_eps)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, v = F.linear(x, qkv_weight).split([q_size, kv_size, kv_size], dim=-1)
    norm = {} if q_weight is None else {"q_weight": q_weight, "k_weight": k_weight,
                                        "eps": qk_eps}
    q, _ = apply_rotary_emb(positions, q, k, cos_sin_cache, head_dim, True, value=v,
                            k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, **norm)
    return q, residual
