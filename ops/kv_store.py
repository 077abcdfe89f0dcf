"""Writing new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
from bastion.ops._dispatch import triton_launcher, use_triton


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` [T, Hk, D] at ``slot_mapping`` [T] of the caches
    [num_blocks, block_size, Hk, D], in place; slots < 0 (padding) are skipped."""
    if use_triton(key, k_cache):
        launcher = triton_launcher("kv_store", "store_kvcache_triton")
        if launcher is not None:
            launcher(key, value, k_cache, v_cache, slot_mapping)
            return
    store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    # NOTE: the caches are allocated contiguous, so a flat [slots, Hk, D] view aliases them.
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
