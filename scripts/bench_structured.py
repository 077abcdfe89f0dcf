"""Structured outputs: engine step time with every request under a JSON schema against the same
batch unconstrained, at several batch sizes (issue #21's target: at most +10 % at batch 32 on
a GPU, the bitmask filled on the host while the device runs the forward).

CPU, the embedded SmolLM2-135M-Instruct (its own tokenizer):

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_structured.py

GPU, the Qwen3-0.6B architecture with dummy weights. configs/ holds no tokenizer, so the
grammar compiles against a stand-in vocabulary of Qwen3's size (151,936): SmolLM2's 49,152
tokens, then pairs of them joined (seeded), so the matcher sees as many byte-level tokens as
Qwen3's would:

    python scripts/bench_structured.py --device cuda --model configs/qwen3-0.6b \\
        --load-format dummy --dtype bfloat16

Each configuration runs a warm-up batch (grammars compiled, kernels built), then a timed batch
of ``batch`` requests driven step by step through ``EngineCore``; a step counts when every
request of the batch is running (no prefill, no tail). Prints the median step time, the median
host time of the bitmask fill, and the overhead against unconstrained.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from bastion.procs.llm import LLM
from bastion.ipc.messages import EngineCoreRequest, SamplingParams, StructuredOutputsParams

# Unbounded, so a request keeps decoding under it up to max_tokens (the mask is filled every
# step; a request whose grammar completes stops early and its steps are not counted).
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}


def stand_in_vocabulary(vocab_size: int, tokenizer: str | None = None):
    """-> xgrammar.TokenizerInfo: the tokens of ``tokenizer`` (a folder with a tokenizer; the
    embedded model's by default), then seeded pairs of them up to ``vocab_size``."""
    import xgrammar as xgr

    from bastion.core.config import ModelConfig
    from bastion.core.loader import load_tokenizer, resolve_model

    model = ModelConfig(model=tokenizer)
    base = xgr.TokenizerInfo.from_huggingface(load_tokenizer(model, resolve_model(model)))
    vocab = list(base.decoded_vocab)
    pieces = vocab[256:]  # past the byte tokens
    rng = random.Random(0)
    vocab += [rng.choice(pieces) + rng.choice(pieces) for _ in range(vocab_size - len(vocab))]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[vocab_size - 1])


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_batch(llm: LLM, batch: int, prompt: list[int], max_tokens: int,
                spec: StructuredOutputsParams | None, tag: str) -> tuple[list[float], list[float]]:
    engine = llm.engine
    fills: list[float] = []
    fill = engine.scheduler.grammar_bitmask

    def timed_fill(sched):
        start = time.perf_counter()
        result = fill(sched)
        fills.append(time.perf_counter() - start)
        return result

    engine.scheduler.grammar_bitmask = timed_fill
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=spec)
    for i in range(batch):
        engine.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params,
                                             eos_token_id=llm.eos_token_id))
    steps = []
    # NOTE: no device sync per step: with async scheduling a step() returns while the next
    # one runs on the device, and that overlap is what is measured (the interval per step).
    synchronize(llm.config.model.device)
    last = time.perf_counter()
    while engine.has_unfinished_requests:
        out = engine.step()
        now = time.perf_counter()
        if out.stats.num_running_reqs == batch and out.stats.num_waiting_reqs == 0:
            steps.append(now - last)
        last = now
    synchronize(llm.config.model.device)
    del engine.scheduler.grammar_bitmask
    # The first steps of the batch are its prefill; the steady state is what is compared.
    return steps[2:], fills


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokenizer", default=None,
                   help="a folder with a tokenizer for the stand-in vocabulary of a dummy model "
                        "(default: the embedded model's)")
    args = p.parse_args()
    dummy = args.load_format == "dummy"
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_model_len=512, max_num_seqs=max(args.batch_sizes),
              skip_tokenizer_init=dummy)
    if dummy:
        vocab_size = llm.engine.executor.runner.vocab_size
        llm.engine.structured_output.use_tokenizer(stand_in_vocabulary(vocab_size, args.tokenizer))
        llm.eos_token_id = vocab_size - 1
    prompt = [random.Random(1).randint(300, 10000) for _ in range(args.prompt_len)]
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    rows = []
    for batch in args.batch_sizes:
        medians = {}
        fill_ms = 0.0
        for name, s in (("none", None), ("json", spec)):
            timed_batch(llm, batch, prompt, 8, s, f"warm-{name}-{batch}")
            steps, fills = timed_batch(llm, batch, prompt, args.max_tokens, s, f"{name}-{batch}")
            medians[name] = statistics.median(steps) * 1e3
            if fills:
                fill_ms = statistics.median(fills) * 1e3
        rows.append((batch, medians["none"], medians["json"], fill_ms,
                     100 * (medians["json"] / medians["none"] - 1)))
    print(f"\n{args.model or 'embedded SmolLM2-135M'} on {args.device}, {args.dtype}, "
          f"{args.max_tokens} tokens per request, prompt {args.prompt_len}")
    print(f"{'batch':>5} | {'step ms (none)':>14} | {'step ms (json)':>14} | "
          f"{'fill ms':>7} | {'overhead':>8}")
    for batch, none, js, fill_ms, pct in rows:
        print(f"{batch:>5} | {none:>14.2f} | {js:>14.2f} | {fill_ms:>7.2f} | {pct:>+7.1f}%")
    llm.shutdown()


if __name__ == "__main__":
    main()
