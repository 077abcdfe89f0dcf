"""One batch-1 token's int4 matmuls of SmolLM2-135M (30 layers x QKV 960x576, o 576x576,
gate_up 3072x576, down 576x1536: 120 calls, every layer its own weights as in the model):
torch's ``_weight_int4pack_mm_for_cpu`` as the int4 method ran it (float32 -> bfloat16 ->
float32 casts included), the kernel alone, and ``ops/cpu/quant_gemv4.c``, each next to its bytes
over the measured read bandwidth (the floor).

    PYTHONPATH=<dir holding bastion> python scripts/bench_int4_gemv.py [--threads 1] [--rows 1]

Prints the median and best over ``--repeats`` tokens of wall and thread CPU time (a shared
machine deschedules the process; CPU time is what the code itself costs).

``--model``: the same A/B on the embedded model instead, in one process: the offline ``LLM``
(bastion's CPU default), 128 greedy tokens after one 64-token prompt, the C int4 kernel's
``can_run`` switched off and on in turn; tok/s over the wall and over the thread CPU time of each
``generate`` (the model runs on the calling thread), median and best, and the thread CPU time
spent inside the int4 layers' ``apply`` (casts and launcher included) a token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bastion.core.models.layers.quantization import (
    INT4_GROUP_SIZE,
    Int4WeightOnlyMethod,
    _WeightOnlyMethod,
)
from bastion.ops.cpu import quant_gemv4

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NUM_LAYERS = 30


def _read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes a second one ``sum`` over a float32 tensor far larger than the caches reads."""
    big = torch.ones(nbytes // 4)
    big.sum()
    best = min(_timed(big.sum)[0] for _ in range(5))
    return nbytes / best


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def model_ab(threads: int, repeats: int, new_tokens: int = 128) -> None:
    import random

    from bastion.ipc.messages import SamplingParams
    from bastion.procs.llm import LLM

    llm = LLM(max_model_len=512, cpu_threads=threads, enable_prefix_caching=False)
    rng = random.Random(0)
    prompt = [{"prompt_token_ids": [rng.randint(1000, 40000) for _ in range(64)]}]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    can_run = quant_gemv4.can_run
    paths = {"torch int4 (bf16 casts)": lambda x: False, "quant_gemv4.c": can_run}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    inside: dict[str, list[float]] = {name: [] for name in paths}  # in the int4 layers
    tokens: dict[str, list[int]] = {}
    apply = Int4WeightOnlyMethod.apply
    spent = [0.0]

    def timed_apply(self, layer, x, bias=None):
        start = time.thread_time()
        try:
            return apply(self, layer, x, bias)
        finally:
            spent[0] += time.thread_time() - start

    Int4WeightOnlyMethod.apply = timed_apply
    for _ in range(repeats):
        for name, fn in paths.items():
            quant_gemv4.can_run = fn
            spent[0] = 0.0
            wall, cpu = time.perf_counter(), time.thread_time()
            out = llm.generate(prompt, params, use_tqdm=False)
            times[name].append((time.perf_counter() - wall, time.thread_time() - cpu))
            inside[name].append(spent[0])
            tokens[name] = out[0].outputs[0].token_ids
    quant_gemv4.can_run, Int4WeightOnlyMethod.apply = can_run, apply
    print(f"embedded model, batch 1, {threads} thread(s), {new_tokens} tokens (prefill included)")
    for name, runs in times.items():
        wall = [new_tokens / t[0] for t in runs]
        cpu = [new_tokens / t[1] for t in runs]
        int4 = statistics.median(inside[name]) / new_tokens * 1e3
        print(f"{name:<26} tok/s wall {statistics.median(wall):6.1f} (best {max(wall):6.1f})  "
              f"CPU time {statistics.median(cpu):6.1f} (best {max(cpu):6.1f})  "
              f"int4 layers {int4:5.2f} ms a token (CPU time, prefill included)")
    same = sum(a == b for a, b in zip(*tokens.values()))
    print(f"same greedy tokens both ways: {same} of {new_tokens}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", action="store_true")
    args = parser.parse_args()
    if args.model:
        return model_ab(args.threads, args.repeats)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(NUM_LAYERS):
        for n, k in SHAPES.values():
            codes = torch.randint(0, 16, (n, k), generator=gen)
            scale = torch.rand(n, k // INT4_GROUP_SIZE, generator=gen) * 0.01
            zero = (torch.rand(n, k // INT4_GROUP_SIZE, generator=gen) - 0.5) * 0.05
            method = Int4WeightOnlyMethod(codes, scale, zero)
            method.dense = None  # not read at decode; 66 MB of memory less
            layers.append((method, method.q4, k))
    xs = {k: torch.randn(args.rows, k, generator=gen) for _, k in SHAPES.values()}
    xs_bf16 = {k: x.to(torch.bfloat16) for k, x in xs.items()}
    torch_bytes = sum(m.weight_bytes for m, _, _ in layers)
    if layers[0][1] is None:
        raise SystemExit("the C int4 kernel is not built here (AVX-512 VNNI and a C compiler)")
    mine_bytes = sum(p.nbytes for _, p, _ in layers)

    module = nn.Module()

    def torch_method() -> None:  # the method's torch path: casts around torch's kernel
        for method, _, k in layers:
            _WeightOnlyMethod.apply(method, module, xs[k])

    def torch_kernel() -> None:
        for method, _, k in layers:
            method._mm(xs_bf16[k])

    def mine_method() -> None:  # the method as the model calls it, taking the C kernel
        for method, _, k in layers:
            method.apply(module, xs[k])

    kernel = quant_gemv4._kernel()
    outs = {n: torch.empty(args.rows, n) for n, _ in SHAPES.values()}

    def raw_calls(levels: int):  # the ctypes call alone
        calls = [(xs[k].data_ptr(), args.rows, k, packed.data_ptr(), packed.shape[0], k, levels,
                  outs[packed.shape[0]].data_ptr(), packed.shape[0], args.threads)
                 for _, packed, k in layers]
        return lambda: [kernel(*a) for a in calls]

    bandwidth = _read_bandwidth()
    print(f"{args.rows} row(s), {args.threads} thread(s), 120 matmuls; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (sum over 256 MB)")
    print(f"{'path':<34} {'MB':>6} {'floor ms':>8} {'wall med/best':>14} {'CPU med/best':>14}")
    runs = [("torch int4 (as the method: casts)", torch_method, torch_bytes),
            ("torch int4 kernel alone (bf16 in)", torch_kernel, torch_bytes),
            ("quant_gemv4.c (as the method)", mine_method, mine_bytes),
            ("quant_gemv4.c alone, int16 x", raw_calls(2), mine_bytes),
            ("quant_gemv4.c alone, int8 x", raw_calls(1), mine_bytes)]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in runs}
    for _ in range(args.repeats):  # interleaved, so that load changes hit every path alike
        for name, fn, _ in runs:
            times[name].append(_timed(fn))
    for name, _, nbytes in runs:
        wall = [t[0] * 1e3 for t in times[name]]
        cpu = [t[1] * 1e3 for t in times[name]]
        print(f"{name:<34} {nbytes / 1e6:6.1f} {nbytes / bandwidth * 1e3:8.2f} "
              f"{statistics.median(wall):6.2f}/{min(wall):<6.2f} "
              f"{statistics.median(cpu):6.2f}/{min(cpu):<6.2f}")


if __name__ == "__main__":
    main()
