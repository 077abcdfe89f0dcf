"""Finding, building and filling models and tokenizers.

Entry points: ``resolve_model`` (what to load), ``load_model``, ``load_tokenizer``,
``get_max_model_len``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from bastion.core.config import ConfigError, ModelConfig, is_inline_template
from bastion.core.loader.dummy import init_dummy_weights
from bastion.core.loader.embedded import embedded_gguf_path
from bastion.core.loader.gguf_loader import ensure_converted, is_gguf_file
from bastion.core.loader.hf_loader import count_safetensors, iter_safetensors, load_hf_config
from bastion.core.loader.tokenizer import load_tokenizer_from
from bastion.core.models.registry import get_model_class
from bastion.procs.logs import progress

logger = logging.getLogger(__name__)

_MAX_LEN_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


class ResolvedModel(NamedTuple):
    path: str  # the GGUF file or the Hugging Face folder the user named
    format: str  # gguf | hf | dummy
    hf_config: PretrainedConfig


def resolve_model(model_config: ModelConfig) -> ResolvedModel:
    """Decide what ``model_config`` points at and read its config (converting a GGUF file into
    the cache on first use). ``model=None`` is the embedded SmolLM2-135M-Instruct GGUF."""
    path = model_config.model or embedded_gguf_path()
    fmt = model_config.load_format
    if fmt == "auto":
        fmt = "gguf" if is_gguf_file(path) else "hf"
    if fmt == "gguf":
        if not is_gguf_file(path):
            raise ConfigError(f"{path} is not a GGUF file")
        folder = ensure_converted(path)
    else:
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(f"{path} is neither a GGUF file nor a model folder")
    hf_config = load_hf_config(folder, model_config.hf_overrides)
    if not getattr(hf_config, "architectures", None):
        raise ConfigError(f"{path}: config.json names no architectures")
    return ResolvedModel(str(path), fmt, hf_config)


def weights_folder(resolved: ResolvedModel) -> Path:
    return ensure_converted(resolved.path) if resolved.format == "gguf" else Path(resolved.path)


def load_model(model_config: ModelConfig, resolved: ResolvedModel) -> nn.Module:
    """Build the model on ``model_config.device`` in ``model_config.torch_dtype`` and fill it
    (this TP rank's shards); returned in eval mode."""
    start = time.perf_counter()
    model_cls = get_model_class(resolved.hf_config.architectures[0])
    device = torch.device(model_config.device)
    with torch.device(device):
        model = model_cls(resolved.hf_config, model_config.torch_dtype)
    if resolved.format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        folder = weights_folder(resolved)
        # A bar on a terminal, three plain log lines under journald.
        model.load_weights(progress(iter_safetensors(folder), count_safetensors(folder),
                                    "loading weights"))
    model.eval().requires_grad_(False)
    logger.info("loaded %s (%s, %s) on %s in %.1f s", os.path.basename(resolved.path),
                resolved.format, model_config.torch_dtype, device, time.perf_counter() - start)
    return model


def load_tokenizer(model_config: ModelConfig, resolved: ResolvedModel) -> PreTrainedTokenizerBase:
    """``model_config.tokenizer`` when given; else the model's own (GGUF: from its metadata).
    ``model_config.chat_template`` (a file or the template) replaces the tokenizer's own."""
    source = model_config.tokenizer or weights_folder(resolved)
    tokenizer = load_tokenizer_from(source)
    template = model_config.chat_template
    if template is not None:
        if not is_inline_template(template):
            template = Path(template).read_text()
        tokenizer.chat_template = template
    return tokenizer


# generation_config.json keys that become default sampling parameters, as vLLM takes them.
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                    "max_new_tokens": "max_tokens"}


def load_generation_defaults(model_config: ModelConfig, resolved: ResolvedModel
                             ) -> dict[str, float | int]:
    """Default sampling parameters from generation_config.json (``--generation-config``):
    ``auto`` reads the model's own folder, ``vllm`` none, any other value is a folder. Only the
    keys the file sets count, by their SamplingParams names (``max_new_tokens`` -> max_tokens)."""
    where = model_config.generation_config
    if where == "vllm":
        return {}
    folder = weights_folder(resolved) if where == "auto" else Path(where)
    path = folder / "generation_config.json"
    if not path.is_file():
        if where != "auto":
            raise ConfigError(f"generation_config: {path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"generation_config: {path} is not valid JSON ({exc})") from None
    defaults = {name: data[key] for key, name in _GENERATION_KEYS.items()
                if data.get(key) is not None}
    if defaults:
        logger.info("default sampling parameters from %s: %s (--generation-config vllm "
                    "ignores them)", path, defaults)
    return defaults


def get_max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    """The model's own limit by default; a larger request is an error."""
    limit = next((int(getattr(hf_config, k)) for k in _MAX_LEN_KEYS
                  if getattr(hf_config, k, None)), None)
    if limit is None:
        if requested is None:
            raise ConfigError("the model config states no maximum length; pass max_model_len")
        return requested
    if requested is None:
        return limit
    if requested > limit:
        raise ConfigError(f"max_model_len={requested} exceeds the model's limit of {limit} "
                          "(max_position_embeddings); use a value <= that")
    return requested


__all__ = [
    "ResolvedModel",
    "embedded_gguf_path",
    "get_max_model_len",
    "load_generation_defaults",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
