"""Multi-LoRA under CUDA graphs on a GPU against the same engine run eagerly.

The CPU suite checks bastion's LoRA against transformers + PEFT (tests/test_lora.py); on a GPU
the adapter kernels run inside the captured decode graphs, where each layer's shrink overlaps
its base matmul on a side stream (core/lora/layers.py). This test runs one batch mixing the base
model and two rank-16 adapters on the Qwen3 of test_gpu_parity (hidden 1024, 4 layers) in
float32, captured and eager: the greedy tokens must be identical and the chosen tokens'
logprobs within 1e-3 nats (the two paths differ only in float32 summation order: the shrink's
split-K atomics), and the captured run's decode steps must have replayed the graphs that hold
the adapter kernels.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from bastion import LLM, LoRARequest, SamplingParams
from tests.gpu.test_gpu_parity import build_qwen3, count_graph_runs, make_prompts, release

CUDA = torch.cuda.is_available()
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts")


def run(folder: Path, adapters: list[str], enforce_eager: bool
        ) -> tuple[list[list[int]], list[list[float]], list[int]]:
    llm = LLM(str(folder), load_format="hf", dtype="float32", skip_tokenizer_init=True,
              max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=1 << 30,
              enable_lora=True, max_loras=2, max_lora_rank=16, enforce_eager=enforce_eager)
    calls = [] if enforce_eager else count_graph_runs(llm)
    # Each prompt twice, once without an adapter: the adapters must move the output.
    prompts = [p for p in make_prompts(32768)[:3] for _ in range(2)]
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    per_prompt = [None, loras[0], None, loras[1], None, loras[0]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=per_prompt, use_tqdm=False)
    release(llm)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, toks)]
                for o, toks in zip(outs, tokens)]
    return tokens, logprobs, calls


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_mixed_adapters_under_cuda_graphs_match_eager(tmp_path: Path) -> None:
    sys.path.insert(0, SCRIPTS)
    from bench_lora import write_random_adapter

    folder = tmp_path / "qwen3"
    model = build_qwen3()
    model.save_pretrained(folder)
    adapters = [write_random_adapter(str(tmp_path / f"a{i}"), model.config, 16, seed=i)
                for i in range(2)]
    del model
    eager_tokens, eager_lps, _ = run(folder, adapters, enforce_eager=True)
    tokens, lps, calls = run(folder, adapters, enforce_eager=False)
    assert len(calls) == 19 and calls[0] == 6  # every decode step replayed a graph
    assert tokens == eager_tokens
    worst = max(abs(a - b) for x, y in zip(lps, eager_lps) for a, b in zip(x, y))
    assert worst < 1e-3, worst
    for base, adapted in zip(lps[0::2], lps[1::2]):
        assert max(abs(a - b) for a, b in zip(base, adapted)) > 1e-2
