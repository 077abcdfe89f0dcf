"""Tokenizers from a Hugging Face folder (a converted GGUF cache folder is one too)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer_from(source: str | Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no tokenizer in {source} ({exc}); pass --tokenizer with a "
                                "folder holding tokenizer.json / tokenizer_config.json") from exc
