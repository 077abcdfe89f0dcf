"""Greedy parity of bastion's models with Hugging Face transformers.

(a) the embedded SmolLM2 GGUF loaded by bastion vs. transformers' own GGUF loading path;
(b) tiny random-weight Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints written by
``save_pretrained`` and read back by bastion's Hugging Face loader.

bastion's side runs through a paged KV cache with scattered block ids, chunked prefill (later
chunks read a cached prefix) and mixed prefill/decode batches, driven by ``PagedDriver`` below.
"""

from __future__ import annotations

import os

import pytest
import torch
from bastion.core.config import ModelConfig
from bastion.core.forward_context import build_attention_metadata, set_forward_context
from bastion.core.loader import load_model, load_tokenizer, resolve_model
from torch import nn

from tests.conftest import TINY_ARCHITECTURES, build_tiny_hf_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three prime numbers.",
]
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the river,",
    "1, 2, 3, 4,",
]


class PagedDriver:
    def __init__(self, model: nn.Module, num_blocks: int = 256, block_size: int = 4,
                 seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        for attn in model.attention_layers():
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape)
            attn.v_cache = torch.zeros(shape)
        # Block 0 stays unused so a wrong (zero-padded) block-table read cannot hit live data.
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
        self.free_blocks = (order + 1).tolist()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, chunk: int = 7,
                 stagger: int = 3) -> list[list[int]]:
        """Greedy continuations; sequence i starts at step i % stagger, prefills ``chunk``
        tokens per step, then decodes one token per step."""
        tokens = [list(p) for p in prompts]
        computed = [0] * len(prompts)  # tokens whose K/V are in the cache
        tables: list[list[int]] = [[] for _ in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        step = 0
        while any(len(o) < max_new_tokens for o in outputs):
            batch = [i for i in range(len(prompts))
                     if step >= i % stagger and len(outputs[i]) < max_new_tokens]
            step += 1
            if not batch:
                continue
            query_lens = [min(chunk, len(tokens[i]) - computed[i]) for i in batch]
            for i, q in zip(batch, query_lens):
                self._grow(tables[i], computed[i] + q)
            ids = [t for i, q in zip(batch, query_lens) for t in tokens[i][computed[i]:computed[i] + q]]
            pos = [p for i, q in zip(batch, query_lens) for p in range(computed[i], computed[i] + q)]
            seq_lens = [computed[i] + q for i, q in zip(batch, query_lens)]
            meta = build_attention_metadata(query_lens, seq_lens, [tables[i] for i in batch],
                                            self.block_size)
            with torch.no_grad(), set_forward_context(meta):
                hidden = self.model(torch.tensor(ids), torch.tensor(pos))
                last = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
                next_ids = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
            for i, q, nxt in zip(batch, query_lens, next_ids):
                computed[i] += q
                if computed[i] == len(tokens[i]):  # the prompt (or last token) is done
                    tokens[i].append(nxt)
                    outputs[i].append(nxt)
        return outputs

    def _grow(self, table: list[int], num_tokens: int) -> None:
        while len(table) * self.block_size < num_tokens:
            table.append(self.free_blocks.pop())


def hf_greedy(model: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: a transformers model's own forward with its KV cache, argmax each step."""
    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            nxt = int(result.logits[0, -1].argmax())
            out.append(nxt)
            result = model(torch.tensor([[nxt]]), cache=result.cache, use_cache=True)
    return out


# --- (a) the embedded GGUF model --------------------------------------------------------------
# The reference, ``hf_gguf_model``, is conftest's (one load per session, shared with test_llm).

@pytest.fixture(scope="module")
def bastion_embedded() -> tuple[nn.Module, object]:
    config = ModelConfig(model=None, device="cpu", dtype="float32")
    resolved = resolve_model(config)
    assert resolved.format == "gguf" and resolved.hf_config.architectures == ["LlamaForCausalLM"]
    return load_model(config, resolved), load_tokenizer(config, resolved)


def test_embedded_tokenizer_matches_transformers_gguf(tokenizer, bastion_embedded) -> None:
    # The reference, ``tokenizer``, is conftest's: AutoTokenizer.from_pretrained(folder,
    # gguf_file=name) of the embedded GGUF, one load per session.
    reference = tokenizer
    _, tokenizer = bastion_embedded
    for text in CHAT_PROMPTS + RAW_PROMPTS:
        assert tokenizer(text).input_ids == reference(text).input_ids
    messages = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == reference.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_embedded_gguf_greedy_parity(embedded_prompt_ids, embedded_hf_greedy,
                                     bastion_embedded) -> None:
    """The model alone (paged attention, chunked prefill) against transformers' greedy tokens
    (the reference test_llm's engine tests share)."""
    model, tokenizer = bastion_embedded
    got = PagedDriver(model, num_blocks=160, block_size=16).generate(embedded_prompt_ids, 32,
                                                                     chunk=11)
    assert got == embedded_hf_greedy
    assert "Paris" in tokenizer.decode(got[0])  # the GGUF model really is SmolLM2-Instruct


# --- (b) tiny random-weight checkpoints --------------------------------------------------------

TINY_PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11], [1, 2, 3], [300, 200, 100, 50, 25, 12, 6],
                [77] * 19]


@pytest.mark.parametrize("kind", TINY_ARCHITECTURES)
def test_tiny_hf_checkpoint_greedy_parity(kind: str, tmp_path) -> None:
    hf_model = build_tiny_hf_model(kind)
    hf_model.save_pretrained(tmp_path)
    config = ModelConfig(model=str(tmp_path), device="cpu", dtype="float32")
    resolved = resolve_model(config)
    assert resolved.format == "hf"
    model = load_model(config, resolved)
    expected = [hf_greedy(hf_model, p, 16) for p in TINY_PROMPTS]
    assert len({tuple(e) for e in expected}) > 1  # the reference is not degenerate
    assert PagedDriver(model, block_size=4).generate(TINY_PROMPTS, 16, chunk=5) == expected


def test_qwen3_moe_loads_fused_expert_names() -> None:
    """transformers 5 keeps experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]); bastion accepts those names too."""
    hf_model = build_tiny_hf_model("qwen3_moe", seed=1)
    names = dict(hf_model.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    from bastion.core.models.registry import get_model_class

    model = get_model_class("Qwen3MoeForCausalLM")(hf_model.config, torch.float32)
    model.load_weights(hf_model.state_dict().items())
    expected = [hf_greedy(hf_model, p, 8) for p in TINY_PROMPTS]
    assert PagedDriver(model, block_size=8).generate(TINY_PROMPTS, 8, chunk=64) == expected


def test_unknown_checkpoint_tensor_is_an_error() -> None:
    hf_model = build_tiny_hf_model("llama")
    from bastion.core.models.registry import get_model_class

    model = get_model_class("LlamaForCausalLM")(hf_model.config, torch.float32)
    weights = list(hf_model.state_dict().items())
    with pytest.raises(KeyError, match="extra.weight"):
        model.load_weights(weights + [("model.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="missing 1 parameters: model.norm.weight"):
        model.load_weights([(n, t) for n, t in weights if n != "model.norm.weight"])
    with pytest.raises(ValueError, match="not supported; supported: LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_gguf_cache_folder_is_keyed_by_content(tmp_path, monkeypatch) -> None:
    """Copies of one GGUF file at other paths, with other mtimes, share one converted folder; a
    changed byte gets its own (a folder per path filled CI's disk with converted weights)."""
    from bastion.core.loader.gguf_loader import converted_dir

    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path / "cache"))
    body = b"GGUF" + bytes(range(256)) * 64
    first, second, changed = (tmp_path / d / "m.gguf" for d in ("a", "b", "c"))
    for path, data in ((first, body), (second, body), (changed, body[:-1] + b"\x01")):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(1_000_000_000, 1_000_000_000))
    folder = converted_dir(str(first))
    assert folder.parent == tmp_path / "cache" / "gguf" and folder.name.startswith("m-")
    assert converted_dir(str(second)) == folder
    assert converted_dir(str(changed)) != folder
