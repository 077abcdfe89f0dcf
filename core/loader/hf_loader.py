"""Hugging Face folders: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig


def load_hf_config(folder: str | Path, overrides: dict[str, Any] | None = None
                   ) -> PretrainedConfig:
    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json; a model folder needs config.json "
                                "and *.safetensors, or pass a .gguf file")
    config = AutoConfig.from_pretrained(str(folder))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def count_safetensors(folder: str | Path) -> int:
    """How many tensors ``iter_safetensors`` will yield (headers only, no data read)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))  # noqa: SIM118 (safe_open is not a dict)
    return total


def iter_safetensors(folder: str | Path, skip: Container[str] = ()
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every ``*.safetensors`` file in ``folder`` but those named in ``skip``
    (never read), on the CPU."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weight files (use "
                                "load_format='dummy' for random weights)")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in skip:
                    yield name, f.get_tensor(name)
