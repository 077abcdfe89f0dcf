"""The attention module: store this step's K/V in the paged cache, then attend over it."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from bastion.core.forward_context import AttentionMetadata, get_forward_context
from bastion.ops.attention import DecodeRope, paged_attention
from bastion.ops.kv_store import store_kvcache
from torch import nn

# Decode batches rotate q and k and store the new K/V inside the attention kernel (one launch a
# layer fewer). "0" keeps the separate rotary kernel, for A/B runs of the whole engine.
_ROPE_IN_ATTENTION = os.environ.get("BASTION_DECODE_ROPE_IN_ATTENTION", "1") != "0"


class Attention(nn.Module):
    """Paged causal attention for one layer, local to this TP rank.

    The model runner assigns ``k_cache`` and ``v_cache`` ([num_blocks, block_size,
    num_kv_heads, head_dim], contiguous) after it sizes the KV cache. Without a forward context
    (or before the caches exist, e.g. a profiling run) all tokens are treated as one causal
    sequence and nothing is stored.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def _paged_context(self) -> AttentionMetadata | None:
        """The step's metadata when this layer attends over its paged cache; None without a
        forward context or before the cache exists (then all tokens are one sequence)."""
        meta = get_forward_context()
        return None if meta is None or self.k_cache.numel() == 0 else meta

    def kv_store_args(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """What ``apply_rotary_emb`` needs to store this step's keys and ``v`` in this layer's
        cache as it rotates them (empty when nothing is stored: no context or no cache)."""
        meta = self._paged_context()
        if meta is None:
            return {}
        return {"value": v, "k_cache": self.k_cache, "v_cache": self.v_cache,
                "slot_mapping": meta.slot_mapping}

    def decode_rope(self, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
                    is_neox_style: bool, q_norm: nn.Module | None = None,
                    k_norm: nn.Module | None = None) -> DecodeRope | None:
        """What ``forward`` needs to rotate q and k itself (after ``q_norm``/``k_norm``, per
        head) and store the new K/V, when this step is decode-only and the rotation is neox
        style over whole power-of-two heads; None otherwise (the caller rotates and stores)."""
        meta = self._paged_context()
        head_dim = self.head_dim
        if (not _ROPE_IN_ATTENTION or meta is None or not meta.is_decode_only
                or not is_neox_style or cos_sin_cache.shape[1] != head_dim
                or head_dim < 16 or head_dim & (head_dim - 1)):
            return None
        if q_norm is None:
            return DecodeRope(k, v, cos_sin_cache)
        return DecodeRope(k, v, cos_sin_cache, q_norm.weight, k_norm.weight, q_norm.eps)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_stored: bool = False, rope: DecodeRope | None = None) -> torch.Tensor:
        """``q`` [T, Hq*D], ``k``/``v`` [T, Hk*D] -> [T, Hq*D]. ``kv_stored``: the caller
        already stored ``k``/``v`` in the cache (fused into its rotary kernel). ``rope`` (from
        ``decode_rope``): ``q`` and ``k`` are not rotated yet and nothing is stored."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        meta = self._paged_context()
        if meta is None:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads).transpose(0, 1)
        else:
            if not kv_stored and rope is None:
                store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            out = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, rope)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
