"""Rotary position embedding: a float32 cos/sin table indexed by position.

Supports the rope types the supported models use: ``default``, ``linear`` and ``llama3``
(Llama 3.1+). Reads both the transformers 5 ``rope_parameters`` dict and the older
``rope_theta`` / ``rope_scaling`` attributes.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from bastion.ops.rotary import apply_rotary_emb
from torch import nn
from transformers import PretrainedConfig

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """``{"rope_theta": float, "rope_type": str, ...scaling keys}`` for any config version."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slow down by ``factor``,
    short ones stay, the band in between is interpolated smoothly."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


# The tables the live models use, by their parameters (an entry goes with its last model).
_TABLES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def _cos_sin_cache(rotary_dim: int, max_position: int, base: float, rope_type: str,
                   scaling_items: tuple[tuple[str, Any], ...], device: str) -> torch.Tensor:
    """float32 [max_position, rotary_dim] on ``device`` (the default device, where the caller
    builds its model): cos then sin of each position's angles (float32 regardless of the model
    dtype; the ops cast after rotating)."""
    scaling = dict(scaling_items)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 is_neox_style: bool = True, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                             f"{', '.join(_SUPPORTED_ROPE_TYPES)}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        # NOTE: every layer of a model asks for the same table; it is built once (30 layers of
        # the embedded model took 0.27 s of each load, a restart's included). Never written:
        # the layers may share it.
        key = (rotary_dim, max_position, base, rope_type,
               tuple(sorted((scaling or {}).items(), key=lambda kv: kv[0])),
               str(torch.get_default_device()))  # a model built under a device context
        try:
            cache = _TABLES.get(key)
            shared = True
        except TypeError:  # a scaling value that cannot be a key (a list): built for this one
            cache, shared = None, False
        if cache is None:
            cache = _cos_sin_cache(*key)
            if shared:
                _TABLES[key] = cache
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                **fused: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``fused``: the per-head norm and KV-store extras of ``apply_rotary_emb``."""
        return apply_rotary_emb(positions, query, key, self.cos_sin_cache, self.head_size,
                                self.is_neox_style, **fused)


def get_rope(config: PretrainedConfig, head_size: int, max_position: int) -> RotaryEmbedding:
    """The rotary embedding a Hugging Face config describes."""
    params = rope_parameters(config)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_size * partial)
    scaling = params if params["rope_type"] != "default" else None
    return RotaryEmbedding(head_size, rotary_dim, max_position, float(params["rope_theta"]),
                           is_neox_style=True, scaling=scaling)
