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
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab_size=VOCAB),
                                     dtype=torch.float32).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="hf", dtype="float32", skip_tokenizer_init=True,
              max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=1 << 28)
    vocab = stand_in_vocabulary()
    llm.engine.structured_output.use_tokenizer(
        xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[VOCAB - 1]))
    graphs = llm.engine.executor.runner.graph_runner
    assert graphs.is_captured and graphs.mask_target is not None
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (5, 9, 13, 17, 21, 25)]
    spec = [StructuredOutputsParams(json=json.dumps(SCHEMA))] * 3 + [
        StructuredOutputsParams(regex=REGEX), None, None]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=s) for s in spec]

    sample_greedy, replayed = graphs.sample_greedy, []

    def recorded(num_rows, masked):
        tokens = sample_greedy(num_rows, masked)
        replayed.append((masked, tokens is not None))
        return tokens

    monkeypatch.setattr(graphs, "sample_greedy", recorded)
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

    def text(tokens: list[int]) -> str:
        return "".join(vocab[t] for t in tokens if t != VOCAB - 1)

    for tokens in fused[:3]:
        jsonschema.validate(json.loads(text(tokens)), SCHEMA)
    import re

    assert re.fullmatch(REGEX, text(fused[3]))
