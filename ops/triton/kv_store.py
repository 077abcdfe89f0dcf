"""Scatter the new tokens' keys and values into the paged KV cache (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_h,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    # NOTE: slot -1 marks a padding token (CUDA-graph batch padding); it owns no cache slot.
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        key_ptr + tok * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + tok * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask
    )
    kc = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_off
    vc = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_off
    tl.store(kc + offs_h[:, None] * stride_kc_h + offs_d[None, :], k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vc_h + offs_d[None, :], v, mask=mask)


def store_kvcache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [T, Hk, D] into ``k_cache``/``v_cache`` [num_blocks, block_size,
    Hk, D] at ``slot_mapping`` [T] (int64, block_id * block_size + offset); slots < 0 are
    skipped. Key/value may be strided views (e.g. slices of a fused QKV output)."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [T, Hk, D]; got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"caches must be [num_blocks, block_size, Hk, D] matching key {tuple(key.shape)}; "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 [{key.shape[0]}]; got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: key {key.dtype}, cache {k_cache.dtype}")
    if (
        key.stride(2) != 1
        or value.stride(2) != 1
        or k_cache.stride(3) != 1
        or v_cache.stride(3) != 1
    ):
        raise ValueError("store_kvcache needs the head dim contiguous (stride 1)")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )  # fmt: skip
