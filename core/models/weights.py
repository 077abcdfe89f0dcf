"""Mapping Hugging Face parameter names onto bastion's fused, sharded parameters."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator

import torch
from bastion.core.models.layers.linear import default_weight_loader
from torch import nn

# (fused param piece, Hugging Face piece, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# Classic per-expert names (what save_pretrained writes) ...
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SHARD = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"),
                 "down_proj": ("w2_weight", "w2")}
# ... and transformers 5's in-memory fused expert tensors ([E, 2I, H] gate then up; [E, H, I]).
_FUSED_EXPERT_RE = re.compile(r"\.experts\.(gate_up_proj|down_proj)(\.weight)?$")
_FUSED_EXPERT_SHARD = {"gate_up_proj": ("w13_weight", "w13"), "down_proj": ("w2_weight", "w2")}

_IGNORED = ("rotary_emb.inv_freq",)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get ``dtype`` (layers allocate with ``torch.empty``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def map_weight_name(name: str) -> tuple[str, tuple[object, ...]]:
    """Hugging Face name -> (bastion parameter name, extra weight_loader arguments)."""
    match = _EXPERT_RE.search(name)
    if match:
        param, shard = _EXPERT_SHARD[match.group(2)]
        return name[: match.start()] + ".experts." + param, (shard, int(match.group(1)))
    match = _FUSED_EXPERT_RE.search(name)
    if match:
        param, shard = _FUSED_EXPERT_SHARD[match.group(1)]
        return name[: match.start()] + ".experts." + param, (shard,)
    for fused, piece, shard_id in STACKED_PARAMS:
        if piece in name:
            return name.replace(piece, fused), (shard_id,)
    return name, ()


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    skip: Iterable[str] = ()) -> None:
    """Copy every checkpoint tensor into its parameter; fail on unknown names and on
    parameters the checkpoint never filled."""
    params = dict(model.named_parameters())
    skip = set(skip)
    filled: set[str] = set()
    for name, tensor in weights:
        if name in skip or any(part in name for part in _IGNORED):
            continue
        target, args = map_weight_name(name)
        param = params.get(target)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            loader(param, tensor.to(param.dtype), *args)
        filled.add(target)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} parameters: {shown}")
