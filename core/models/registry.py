"""Architecture name (``config.architectures[0]``) -> model class."""

from __future__ import annotations

from bastion.core.models.llama import LlamaForCausalLM
from bastion.core.models.qwen2 import Qwen2ForCausalLM
from bastion.core.models.qwen3 import Qwen3ForCausalLM
from bastion.core.models.qwen3_moe import Qwen3MoeForCausalLM
from torch import nn

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}") from None
