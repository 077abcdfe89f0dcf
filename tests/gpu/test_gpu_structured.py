"""Structured outputs on a GPU: a decode step under CUDA graphs samples its grammar rows under
their bitmask inside the sampling kernel (``ops/triton/sample.py``), replayed from a captured
sampling graph that reads the bitmask and its row map where one transfer put them. A tiny Qwen3 with random weights (float32) and a stand-in vocabulary
of 512 tokens (printable ASCII, then seeded pieces of JSON; the last token is the grammar's
stop token).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from bastion import LLM, SamplingParams
from bastion.core import model_runner
from bastion.ipc.messages import StructuredOutputsParams
from tests.conftest import tiny_config

CUDA = torch.cuda.is_available()
VOCAB = 512
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["a", "bb", "ccc"]}, "ok": {"type": "boolean"},
    "inner": {"type": "object", "properties": {"tag": {"enum": ["x", "yz"]}},
              "required": ["tag"], "additionalProperties": False}},
    "required": ["kind", "ok", "inner"], "additionalProperties": False}
REGEX = "[a-c]{3}-[0-9]{2}"


def stand_in_vocabulary() -> list[str]:
    pieces = [chr(c) for c in range(32, 127)]
    rng = random.Random(3)
    parts = ['{"', '":', '",', '"}', "true", "false", "kind", "inner", "tag", "ok", "bb", "ccc"]
    while len(pieces) < VOCAB - 1:
        pieces.append(rng.choice(parts) + rng.choice(pieces[:95] + parts))
    return pieces + ["</s>"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_grammar_rows_sample_under_their_bitmask_inside_the_sampling_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed batch (JSON schema, regex and unconstrained rows, greedy): every decode step
    with a grammar row replays the masked sampling graph; the tokens equal those of the same
    batch sampled eagerly with the logits masked first and an unmasked argmax; the
    unconstrained rows equal a batch of them alone; every constrained output parses and
    validates."""
    llm, vocab, graphs, prompts, spec = _tiny_llm(tmp_path)
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=s) for s in spec]

    sample_plain, replayed = graphs.sample_plain, []

    def recorded(num_rows, masked, temperatures=None):
        tokens = sample_plain(num_rows, masked, temperatures)
        replayed.append((masked, tokens is not None and temperatures is None))
        return tokens

    monkeypatch.setattr(graphs, "sample_plain", recorded)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # Every decode step replayed its sampling; those with a grammar row (none once they
    # finish) under the bitmask.
    assert replayed and all(ok for _, ok in replayed)
    assert sum(masked for masked, _ in replayed) >= 10

    greedy = model_runner.greedy_tokens

    def masked_first(logits, mask=None):
        if mask is not None:
            mask.apply(logits)
        return greedy(logits)

    graphs._samplers.clear()  # sample eagerly from here on
    monkeypatch.setattr(model_runner, "greedy_tokens", masked_first)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[4:], params[4:],
                                                          use_tqdm=False)]
    llm.shutdown()
    assert fused == reference
    assert fused[4:] == alone
    _check_outputs(vocab, fused)


def _tiny_llm(folder: Path, **kwargs):
    """(LLM of a tiny random float32 Qwen3 under CUDA graphs with the stand-in vocabulary,
    the vocabulary, its decode graph runner, six prompts, their grammars: three JSON schema,
    one regex, two none)."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab_size=VOCAB),
                                     dtype=torch.float32).save_pretrained(folder)
    llm = LLM(str(folder), load_format="hf", dtype="float32", skip_tokenizer_init=True,
              max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=1 << 28, **kwargs)
    vocab = stand_in_vocabulary()
    llm.engine.structured_output.use_tokenizer(
        xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[VOCAB - 1]))
    graphs = llm.engine.executor.runner.graph_runner
    assert graphs.is_captured and graphs.mask_target is not None
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (5, 9, 13, 17, 21, 25)]
    spec = [StructuredOutputsParams(json=json.dumps(SCHEMA))] * 3 + [
        StructuredOutputsParams(regex=REGEX), None, None]
    return llm, vocab, graphs, prompts, spec


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_rows_drawn_at_a_temperature_replay_the_drawing_sampling_graphs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same mixed batch drawn at temperature 0.8 (no seed, nothing else): every decode
    step replays a drawing sampling graph with each row's temperature, under the bitmask while
    a grammar row is in the batch; the constrained outputs parse and validate; the same global
    seed gives the same tokens again once the grammars are cached (the graphs' seeds come from
    the global RNG; a first run schedules the grammar rows only when their compile ends, so
    its batches differ); the draws are not the greedy tokens."""
    llm, vocab, graphs, prompts, spec = _tiny_llm(tmp_path, enable_prefix_caching=False)
    sample_plain, replayed = graphs.sample_plain, []

    def recorded(num_rows, masked, temperatures=None):
        tokens = sample_plain(num_rows, masked, temperatures)
        replayed.append((masked, tokens is not None, temperatures))
        return tokens

    monkeypatch.setattr(graphs, "sample_plain", recorded)

    def run(temperature: float) -> list[list[int]]:
        params = [SamplingParams(temperature=temperature, max_tokens=80, structured_outputs=s)
                  for s in spec]
        torch.manual_seed(5)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    run(0.8)  # compiles the grammars: the first run schedules their rows once compiled
    replayed.clear()
    drawn = run(0.8)
    assert replayed and all(ok and t is not None and set(t) == {0.8}
                            for _, ok, t in replayed)
    assert sum(masked for masked, _, _ in replayed) >= 10
    again = run(0.8)
    greedy = run(0.0)
    llm.shutdown()
    assert again == drawn
    assert sum(a != b for a, b in zip(drawn, greedy)) >= 4
    _check_outputs(vocab, drawn)


def _check_outputs(vocab: list[str], outputs: list[list[int]]) -> None:
    """Rows 0-2 parse and validate against SCHEMA, row 3 matches REGEX."""
    import re

    def text(tokens: list[int]) -> str:
        return "".join(vocab[t] for t in tokens if t != VOCAB - 1)

    for tokens in outputs[:3]:
        jsonschema.validate(json.loads(text(tokens)), SCHEMA)
    assert re.fullmatch(REGEX, text(outputs[3]))
