"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and checking
it against the base model before any of it reaches a device."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

from bastion.core.models.llama import head_dim_of

# PEFT's module names, each with its input and output features in the base model.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])\.weight$"
)
# Options that change what the adapter computes and that bastion does not implement; a value
# other than the default is refused rather than ignored.
_UNSUPPORTED = {
    "use_dora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "use_qalora": False,
    "lora_bias": False,
}


class LoRAError(ValueError):
    """An adapter that cannot run on this model; the message names what is wrong."""


@dataclass
class LoRAWeights:
    """One adapter in host memory, full (unsharded) tensors in float32.

    ``modules[(layer, name)] = (A [r, in], B [out, r])``; ``scale`` is alpha / r (alpha / sqrt(r)
    with rsLoRA)."""

    rank: int
    scale: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(input features, output features) of each LoRA-capable module of the base model."""
    head_dim = head_dim_of(config)
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def load_peft_adapter(
    path: str, config: PretrainedConfig, max_rank: int, mlp_layers: set[int] | None = None
) -> LoRAWeights:
    """Read and check the adapter in ``path`` against the base model of ``config``.

    ``mlp_layers``: the layers whose MLP is dense (gate/up/down may be adapted there); None:
    every layer."""
    adapter_config = _read_config(path)
    rank = adapter_config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter {path}: 'r' must be a positive integer; got {rank!r}")
    if rank > max_rank:
        raise LoRAError(
            f"adapter {path} has rank {rank}, above --max-lora-rank {max_rank}; "
            f"restart with --max-lora-rank {_next_rank(rank)} or more"
        )
    alpha = adapter_config.get("lora_alpha", 8)
    scale = alpha / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank)
    _check_targets(path, adapter_config.get("target_modules"))
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        found = ", ".join(sorted(os.listdir(path)))
        raise LoRAError(
            f"adapter {path} has no adapter_model.safetensors (found: {found}); "
            "save it with save_pretrained(safe_serialization=True)"
        )
    tensors = load_file(weights_file)
    shapes = module_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise LoRAError(
                f"adapter {path}: tensor {name!r} is not a LoRA weight of "
                f"{', '.join(SUPPORTED_MODULES)}"
            )
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes:
            raise LoRAError(
                f"adapter {path}: module {module!r} ({name}) is not supported; "
                f"LoRA applies to {', '.join(SUPPORTED_MODULES)}"
            )
        if layer >= config.num_hidden_layers:
            raise LoRAError(
                f"adapter {path}: {name} is for layer {layer} but the base model has "
                f"{config.num_hidden_layers} layers"
            )
        if (
            mlp_layers is not None
            and module.endswith(("gate_proj", "up_proj", "down_proj"))
            and layer not in mlp_layers
        ):
            raise LoRAError(
                f"adapter {path}: {name} adapts an MoE layer's MLP, which is not supported"
            )
        parts.setdefault((layer, module), {})[which] = tensor.float()
    modules = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {path}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoRAError(
                f"adapter {path} does not fit this base model: layer {layer} {module} has "
                f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, the model needs "
                f"{(rank, fan_in)} and {(fan_out, rank)} (an adapter for another model?)"
            )
        modules[(layer, module)] = (a, b)
    if not modules:
        raise LoRAError(f"adapter {path} holds no LoRA weights")
    return LoRAWeights(rank, scale, modules)


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise LoRAError(f"no LoRA adapter at {path}: adapter_config.json is missing")
    with open(config_file, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise LoRAError(f"adapter {path}: adapter_config.json is not JSON ({exc})") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"adapter {path} is a {peft_type} adapter; only LORA is supported")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None) and not (isinstance(default, dict) and not value):
            raise LoRAError(
                f"adapter {path}: {key}={value!r} is not supported (only {key}={default!r})"
            )
    return config


def _check_targets(path: str, targets: object) -> None:
    # A string is PEFT's regex or "all-linear": the weights themselves say which modules.
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_MODULES]
        if unknown:
            raise LoRAError(
                f"adapter {path}: target module(s) {', '.join(map(str, unknown))} "
                f"not supported; LoRA applies to {', '.join(SUPPORTED_MODULES)}"
            )


def _next_rank(rank: int) -> int:
    from bastion.core.config import _LORA_RANKS

    return next((r for r in _LORA_RANKS if r >= rank), rank)
