"""The cost of a speculative verify step against a plain decode step, on a GPU (issue #22).

A verify step feeds every sequence its last token and ``k`` drafts (``k + 1`` query tokens) in
one target forward, then verifies. With dummy weights acceptance means nothing, so this measures
what acceptance has to pay for: the step-time ratio. A verify step that costs ``r`` decode steps
gains when it emits more than ``r`` tokens on average (mean acceptance length + 1 > r).

    python scripts/bench_spec_gpu.py                      # Llama-3.1-8B architecture, bf16
    python scripts/bench_spec_gpu.py --batches 1 8 32 --ks 2 4 --context 512

Both steps run as the engine runs them under CUDA graphs: the decode graphs (one token per
sequence) and the verify graphs (``k + 1``), each followed by the LM head over the rows that
are sampled, then the host step that turns logits into tokens (greedy argmax for decode; for
verify, ``verify()`` with every draft checked). Each row is the median over ``--iters`` steps
with every sequence at ``--context`` cached tokens, beside the step's bandwidth floor (weights
plus the KV read, over the device-to-device copy bandwidth measured in the same run).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_latency import copy_bandwidth, model_bytes

from bastion.core.cuda_graphs import DecodeInputs
from bastion.procs.llm import LLM
from bastion.core.spec_decode.rejection_sampler import VerifyRequest, verify
from bastion.ipc.messages import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_inputs(batch: int, q: int, context: int, block_size: int, vocab: int,
                rng: np.random.Generator) -> DecodeInputs:
    """``batch`` sequences of ``context`` cached tokens, ``q`` new tokens each, in disjoint
    blocks (the cache holds junk: only the shapes and bytes matter here)."""
    blocks_per_seq = -(-(context + q) // block_size)
    table = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    positions = (context + np.arange(q))[None, :].repeat(batch, 0).reshape(-1).astype(np.int64)
    rows = np.repeat(np.arange(batch), q)
    slots = (table[rows, positions // block_size].astype(np.int64) * block_size
             + positions % block_size)
    ids = rng.integers(0, vocab, size=batch * q, dtype=np.int64)
    return DecodeInputs(ids, positions, slots, table)


def time_steps(step, iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()  # ends with tokens on the host, as the engine's step does
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(args: argparse.Namespace, k: int, results: dict) -> None:
    llm = LLM(model=args.model, load_format="dummy", dtype=args.dtype, max_model_len=2048,
              skip_tokenizer_init=True, max_num_seqs=max(args.batches),
              kv_cache_memory_bytes=args.kv_gib << 30,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    runner = llm.engine.executor.runner
    decode_runner, verify_runner = runner.graph_runner, runner.verify_graph_runner
    if decode_runner is None or not decode_runner.is_captured:
        raise SystemExit("the decode CUDA graphs were not captured")
    if verify_runner is None or not verify_runner.is_captured:
        raise SystemExit("the verify CUDA graphs were not captured")
    model, vocab, bs = runner.model, runner.model.config.vocab_size, runner.block_size
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=4096)
    for batch in args.batches:
        if ("decode", batch) not in results:
            inputs = step_inputs(batch, 1, args.context, bs, vocab, rng)

            def decode_step(inputs=inputs):
                logits = model.compute_logits(decode_runner.run(inputs))
                return logits.argmax(dim=-1).tolist()

            results[("decode", batch)] = time_steps(decode_step, args.iters)
        inputs = step_inputs(batch, k + 1, args.context, bs, vocab, rng)
        drafts = [inputs.input_ids[i * (k + 1) + 1:(i + 1) * (k + 1)].tolist()
                  for i in range(batch)]
        requests = [VerifyRequest(greedy, [1] * args.context, [], None, None, d, None)
                    for d in drafts]

        def verify_step(inputs=inputs, requests=requests):
            logits = model.compute_logits(verify_runner.run(inputs))
            return verify(logits, requests).token_ids

        results[("verify", batch, k)] = time_steps(verify_step, args.iters)
        print(f"k={k} batch {batch}: decode {results[('decode', batch)] * 1e3:.3f} ms, verify "
              f"{results[('verify', batch, k)] * 1e3:.3f} ms", flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(REPO, "configs", "llama-3.1-8b"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--kv-gib", type=int, default=8)
    args = parser.parse_args(argv)
    results: dict = {}
    for k in args.ks:
        measure(args, k, results)
    dtype = getattr(torch, args.dtype)
    mb = model_bytes(args.model, dtype)
    bw = copy_bandwidth()
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; weights read per step "
          f"{mb.weights_per_step / 1e9:.2f} GB; context {args.context} tokens per sequence")
    print(f"{'batch':>5} {'decode ms':>10} {'floor ms':>9} " + " ".join(
        f"{'k=' + str(k) + ' ms':>9} {'ratio':>6}" for k in args.ks))
    for batch in args.batches:
        decode = results[("decode", batch)]
        floor = (mb.weights_per_step + batch * args.context * mb.kv_per_token) / bw
        cells = " ".join(f"{results[('verify', batch, k)] * 1e3:9.3f} "
                         f"{results[('verify', batch, k)] / decode:6.2f}" for k in args.ks)
        print(f"{batch:5d} {decode * 1e3:10.3f} {floor * 1e3:9.3f} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
