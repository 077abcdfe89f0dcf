"""Rotary position embedding applied to query and key."""

from __future__ import annotations

import torch
from bastion.ops._dispatch import triton_launcher, use_triton


def apply_rotary_emb(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int,
                     is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` [T, Hq*D] and ``key`` [T, Hk*D] by their ``positions`` [T].

    ``cos_sin_cache`` [max_pos, rotary_dim] holds cos in its first half and sin in its second
    (float32); only the first ``rotary_dim <= head_size`` dims of each head rotate. Neox style
    rotates the two halves of those dims (Llama/Qwen in Hugging Face), GPT-J style interleaved pairs.
    """
    if use_triton(query, key):
        launcher = triton_launcher("rotary", "apply_rotary_emb_triton")
        if launcher is not None:
            return launcher(positions, query, key, cos_sin_cache, head_size, is_neox_style)
    return apply_rotary_emb_ref(positions, query, key, cos_sin_cache, head_size, is_neox_style)


def apply_rotary_emb_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int,
                         is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, rot/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (_rotate(query, cos, sin, head_size, is_neox_style),
            _rotate(key, cos, sin, head_size, is_neox_style))


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
