"""Rotary position embedding applied to query and key, optionally fused with Qwen3's per-head
q/k RMSNorm before it and the KV-cache store after it.

On a GPU one Triton kernel does all three; on the CPU a C kernel rotates and stores float32
rows in one pass (``cpu/rotary.c``; neox style without the norms), the torch reference the rest.
"""

from __future__ import annotations

import torch
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.cpu import rotary as cpu_rotary
from bastion.ops.kv_store import store_kvcache_ref
from bastion.ops.layernorm import rms_norm_ref


def apply_rotary_emb(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int, is_neox_style: bool = True,
                     **fused: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` [T, Hq*D] and ``key`` [T, Hk*D] by their ``positions`` [T].

    ``cos_sin_cache`` [max_pos, rotary_dim] holds cos in its first half and sin in its second
    (float32); only the first ``rotary_dim <= head_size`` dims of each head rotate. Neox style
    rotates the two halves of those dims (Llama/Qwen in Hugging Face), GPT-J style interleaved pairs.

    Keyword-only extras (see ``apply_rotary_emb_ref``): ``q_weight``/``k_weight``/``eps`` RMS-
    normalise each head first; ``value``/``k_cache``/``v_cache``/``slot_mapping`` also store the
    rotated key and the value in the paged KV cache.
    """
    if use_triton(query, key):
        launcher = triton_launcher("rotary", "apply_rotary_emb_triton")
        if launcher is not None:
            return launcher(positions, query, key, cos_sin_cache, head_size, is_neox_style,
                            **fused)
    if cpu_rotary.can_run(query, key, is_neox_style, fused):
        return cpu_rotary.rotary_store_cpu(positions, query, key, cos_sin_cache, head_size,
                                           **fused)
    return apply_rotary_emb_ref(positions, query, key, cos_sin_cache, head_size, is_neox_style,
                                **fused)


def apply_rotary_emb_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int,
                         is_neox_style: bool = True, *, q_weight: torch.Tensor | None = None,
                         k_weight: torch.Tensor | None = None, eps: float = 0.0,
                         value: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                         v_cache: torch.Tensor | None = None,
                         slot_mapping: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = query.shape[0]
    if q_weight is not None:
        query = rms_norm_ref(query.reshape(num_tokens, -1, head_size), q_weight, eps)
        key = rms_norm_ref(key.reshape(num_tokens, -1, head_size), k_weight, eps)
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, rot/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    query = _rotate(query, cos, sin, head_size, is_neox_style)
    key = _rotate(key, cos, sin, head_size, is_neox_style)
    if k_cache is not None:
        kv_shape = (num_tokens, -1, head_size)
        store_kvcache_ref(key.view(kv_shape), value.reshape(kv_shape), k_cache, v_cache,
                          slot_mapping)
    return query, key


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int,
            is_neox_style: bool) -> torch.Tensor:
    num_tokens = x.shape[0]
    heads = x.reshape(num_tokens, -1, head_size)
    rotary_dim = cos.shape[-1] * 2
    rot = heads[..., :rotary_dim].float()
    if is_neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    out = torch.cat((rotated.to(x.dtype), heads[..., rotary_dim:]), dim=-1)
    return out.reshape(num_tokens, -1)
