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
from bastion.core.models.layers.quantization import cpu_has_bf16_kernels
from bastion.core.models.registry import get_model_class
from bastion.core.progress import progress

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


def keeps_gguf_quantized(model_config: ModelConfig, resolved: ResolvedModel,
                         tp_size: int = 1) -> bool:
    """Whether the GGUF weights stay quantized (``ModelConfig.quantization``)."""
    if model_config.quantization == "none" or resolved.format != "gguf":
        if model_config.quantization == "gguf":
            raise ConfigError(f"quantization=gguf needs a GGUF file; {resolved.path} is "
                              f"{resolved.format}")
        return False
    if model_config.quantization == "gguf":
        if tp_size > 1:
            raise ConfigError("quantization=gguf runs with tensor_parallel_size=1 only; use "
                              "quantization=none with tensor parallelism")
        return True
    return (model_config.device == "cpu" and tp_size == 1 and cpu_has_bf16_kernels()
            and model_config.dtype not in _EXACT_DTYPES)


# dtype names that ask for dense weights: float32 is the exact (parity) path; float16 has no
# fast weight-only CPU kernel.
_EXACT_DTYPES = ("float32", "fp32", "float", "float16", "fp16", "half")


def load_model(model_config: ModelConfig, resolved: ResolvedModel,
               tp_size: int = 1) -> nn.Module:
    """Build the model on ``model_config.device`` in ``model_config.torch_dtype`` and fill it
    (this TP rank's shards); returned in eval mode."""
    start = time.perf_counter()
    hf_config = resolved.hf_config
    model_cls = get_model_class(hf_config.architectures[0])
    device = torch.device(model_config.device)
    with torch.device(device):
        model = model_cls(hf_config, model_config.torch_dtype)
    weights_format = f"dense {str(model_config.torch_dtype).removeprefix('torch.')}"
    if resolved.format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        skip: set[str] = set()
        if keeps_gguf_quantized(model_config, resolved, tp_size):
            from bastion.core.loader.gguf_quant import quantize_linear_layers

            quantized = quantize_linear_layers(
                model, resolved.path, hf_config.model_type, hf_config.num_attention_heads,
                getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                bool(getattr(hf_config, "tie_word_embeddings", False)))
            skip = quantized.consumed
            weights_format = f"GGUF kept quantized: {quantized.summary}"
        folder = weights_folder(resolved)
        # A bar on a terminal, three plain log lines under journald.
        model.load_weights(progress(iter_safetensors(folder, skip),
                                    count_safetensors(folder) - len(skip),
                                    "loading weights"))
    model.eval().requires_grad_(False)
    logger.info("loaded %s (%s, activations %s) on %s in %.1f s; weights: %s, %.1f MB read per "
                "decode step", os.path.basename(resolved.path), resolved.format,
                str(model_config.torch_dtype).removeprefix("torch."), device,
                time.perf_counter() - start, weights_format, weight_bytes_per_step(model) / 1e6)
    return model


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer's weight (quantized or dense)
    and the norms; the embedding table counts only for a tied LM head that reads it densely."""
    total = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and method.weight_bytes:
            total += method.weight_bytes
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen or (param_name == "weight" and name.endswith("embed_tokens")):
                continue
            seen.add(id(param))
            total += param.nbytes
    return total


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
    "keeps_gguf_quantized",
    "load_generation_defaults",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
