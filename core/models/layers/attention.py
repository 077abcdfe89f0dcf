"""The attention module: store this step's K/V in the paged cache, then attend over it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bastion.core.forward_context import AttentionMetadata, get_forward_context
from bastion.ops.attention import paged_attention
from bastion.ops.kv_store import store_kvcache
from torch import nn


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_stored: bool = False) -> torch.Tensor:
        """``q`` [T, Hq*D], ``k``/``v`` [T, Hk*D] -> [T, Hq*D]. ``kv_stored``: the caller
        already stored ``k``/``v`` in the cache (fused into its rotary kernel)."""
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
            if not kv_stored:
                store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            out = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
