"""Speculative decoding on a GPU: greedy tokens identical to plain decoding under CUDA graphs.

Qwen3-0.6B architecture with dummy (random) weights, float32 so that the verify forward (many
tokens per row) and plain decode (one per row, graph replay) agree to the last bit of argmax:

    python scripts/gpu_spec_check.py

Checks: plain decode replays CUDA graphs, verify steps the verify graphs; ngram and
draft_model (the target's own config and seed as the draft, so every draft is accepted) give
the same tokens; prints tok/s of each.

NOTE: each LLM gets a fixed 2 GiB KV pool: with ``gpu_memory_utilization`` a later LLM of the
same process found no memory for its KV cache (docs/runs/gpu_s11_call10_spec_check.log).
"""

from __future__ import annotations

import gc
import os
import time

import torch
from bench_spec import count_spec_stats  # scripts/ is this script's folder

from bastion.procs.llm import LLM
from bastion.ipc.messages import SamplingParams

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3-0.6b")


def main() -> None:
    totals = count_spec_stats()
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 10 for j in range(40 + 9 * i)]}
               for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    common = {"model": CONFIG, "load_format": "dummy", "dtype": "float32",
              "max_model_len": 1024, "skip_tokenizer_init": True,
              # A fixed pool: the previous run's memory is still counted as used in this
              # process, so profiling would leave the next LLM no KV cache (seen on the H200).
              "kv_cache_memory_bytes": 2 << 30}
    results = {}
    for name, spec in (("plain", None),
                       ("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
                       ("draft_model", {"method": "draft_model", "model": CONFIG,
                                        "num_speculative_tokens": 3})):
        llm = LLM(**common, **({"speculative_config": spec} if spec else {}))
        runner = llm.engine.executor.runner
        replays = [0, 0]  # decode graphs, verify graphs
        for which, graphs in enumerate((runner.graph_runner, runner.verify_graph_runner)):
            if graphs is None:
                continue

            def counting_run(inputs, *args, _run=graphs.run, _which=which, _replays=replays,
                             **kwargs):
                _replays[_which] += 1
                return _run(inputs, *args, **kwargs)

            graphs.run = counting_run
        for key in totals:
            totals[key] = 0
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))
        for batch in (1, 8):
            start = time.perf_counter()
            outs = llm.generate(prompts[:batch], params)
            elapsed = time.perf_counter() - start
            tokens = [o.outputs[0].token_ids for o in outs]
            results[(name, batch)] = tokens
            same = tokens == results[("plain", batch)]
            print(f"{name:12s} batch {batch}: {64 * batch / elapsed:8.1f} tok/s, identical to "
                  f"plain: {same}, graph replays so far {replays[0]} decode, {replays[1]} "
                  f"verify, drafts {totals}",
                  flush=True)
        print(f"{name}: free blocks {llm.engine.scheduler.kv.num_free_blocks} of "
              f"{llm.engine.num_blocks}", flush=True)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
