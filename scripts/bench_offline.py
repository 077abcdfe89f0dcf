"""Offline throughput: bastion's ``LLM`` against Hugging Face transformers on one workload.

The workload is nano-vllm's ``bench.py``: ``random.seed(seed)``, then for every sequence a prompt
of ``randint(min_input, max_input)`` random token ids in [0, 10000], then one
``max_tokens = randint(min_output, max_output)`` per sequence, EOS ignored. nano-vllm's exact
run (256 sequences, lengths in [100, 1024], seed 0) has 142,827 prompt and 133,966 output tokens.

CPU (default, scaled for a small machine):

    .venv/bin/python scripts/bench_offline.py

GPU (nano-vllm's workload):

    python scripts/bench_offline.py --model /path/to/Qwen3-0.6B --dtype bfloat16 \\
        --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024

Hugging Face runs ``generate`` on the same prompts, batched with left padding and
``max_new_tokens = min_new_tokens =`` the longest requested output (so it does at least as much
work); only the requested tokens of each sequence are counted for both engines.
``--hf-continuous-batching`` uses transformers' ``init_continuous_batching`` manager instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import torch

NANO_VLLM_TOTALS = (142_827, 133_966)  # prompt, output tokens of nano-vllm's seed-0 workload


class Workload(NamedTuple):
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


class Result(NamedTuple):
    engine: str
    num_seqs: int
    num_output_tokens: int
    seconds: float

    @property
    def throughput(self) -> float:
        return self.num_output_tokens / self.seconds


def make_workload(num_seqs: int, min_input: int, max_input: int, min_output: int,
                  max_output: int, seed: int) -> Workload:
    """nano-vllm's generator, draw for draw: all prompts first, then all output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_input, max_input))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_output, max_output) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens)


def check_nano_vllm_totals() -> None:
    """Our generator must reproduce nano-vllm's token totals exactly."""
    w = make_workload(256, 100, 1024, 100, 1024, 0)
    got = (w.num_prompt_tokens, w.num_output_tokens)
    assert got == NANO_VLLM_TOTALS, f"workload generator drifted: {got} != {NANO_VLLM_TOTALS}"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _WaitTimer:
    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.steps: list[tuple[int, float, float]] = []  # (batch, end time, seconds waited)

    def print_timeline(self, start: float, prefill_steps: int = 12) -> None:
        """Where the run's time went, by phase and batch size: a step's wall time is from the
        previous step's tokens to its own; what it did not spend waiting on the device is host
        work (a step whose wait is near zero is limited by the host)."""
        rows: dict[str, list[float]] = {}
        previous = start
        for i, (batch, end, waited) in enumerate(self.steps):
            if i < prefill_steps:
                key = f"steps 1-{prefill_steps}"
            else:
                low = next(b for b in (192, 128, 64, 32, 16, 0) if batch >= b)
                key = f"batch >= {low:3d}"
            row = rows.setdefault(key, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += end - previous
            row[2] += waited
            previous = end
        print(f"{'phase':>14} {'steps':>6} {'seconds':>8} {'ms a step':>9} {'waited ms':>9} "
              f"{'host ms':>8}")
        for key, (n, wall, waited) in rows.items():
            print(f"{key:>14} {n:>6} {wall:>8.3f} {wall / n * 1e3:>9.2f} {waited / n * 1e3:>9.2f} "
                  f"{(wall - waited) / n * 1e3:>8.2f}")
        ends = [start] + [end for _, end, _ in self.steps[:prefill_steps]]
        print("first steps (batch, ms, waited ms): " + ", ".join(
            f"({b}, {(ends[i + 1] - ends[i]) * 1e3:.1f}, {w * 1e3:.1f})"
            for i, (b, _, w) in enumerate(self.steps[:prefill_steps])))


def _time_device_waits() -> _WaitTimer:
    """Count steps and the host's time blocked on their sampled tokens (everything else in a
    step is host work: scheduling, input preparation, launches, output handling)."""
    from bastion.core.model_runner import StepHandle

    timer = _WaitTimer()
    original = StepHandle.output
    if hasattr(original, "timer"):
        original = original.original

    def output(self):  # noqa: ANN001, ANN202
        if self._output is None:
            timer.calls += 1
            start = time.perf_counter()
            result = original(self)
            end = time.perf_counter()
            timer.seconds += end - start
            timer.steps.append((len(self.states), end, end - start))
            return result
        return original(self)

    output.timer, output.original = timer, original
    StepHandle.output = output
    return timer


def _around_steps(llm, first: int, last: int, begin, end) -> None:  # noqa: ANN001
    """Call ``begin()`` before engine step ``first`` and ``end(seconds)`` after step ``last``
    (steps counted from 1; ``seconds`` is their wall time)."""
    engine = llm.engine
    original = engine.step
    state = {"n": 0, "t0": 0.0}

    def step():  # noqa: ANN202
        n = state["n"] = state["n"] + 1
        if n == first:
            begin()
            state["t0"] = time.perf_counter()
        out = original()
        if n == last:
            end(time.perf_counter() - state["t0"])
        return out

    engine.step = step


def _cprofile_steps(llm, count: int) -> None:  # noqa: ANN001
    """cProfile the host from the first engine step through step ``count`` and print where its
    time went (the prefill phase, when ``count`` covers it)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()

    def end(seconds: float) -> None:
        prof.disable()
        print(f"cprofile of steps 1..{count}: {seconds * 1e3:.1f} ms under the profiler")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumtime").print_stats(40)

    _around_steps(llm, 1, count, prof.enable, end)


def _profile_steps(llm, first: int, count: int, trace: str | None = None) -> None:  # noqa: ANN001
    """Profile engine steps ``first .. first + count - 1`` (device kernels and host calls) and
    print the kernels that take the device's time, with its busy time per step."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def end(seconds: float) -> None:
        synchronize(llm.config.model.device)
        prof.__exit__(None, None, None)
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        batch = len(llm.engine.scheduler.running)
        print(f"torch profile: steps {first}..{first + count - 1} (batch {batch}): "
              f"{seconds / count * 1e3:.2f} ms a step wall, {device_us / count / 1e3:.2f} ms "
              "a step of device kernels")
        print(events.table(sort_by="self_device_time_total", row_limit=18,
                           max_name_column_width=60))
        # Without --profile-trace the trace (tens of MB) goes to a folder removed afterwards.
        with tempfile.TemporaryDirectory() as tmp:
            path = trace or os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            _print_device_gaps(path, count)

    _around_steps(llm, first, first + count - 1, prof.__enter__, end)


def _kind(name: str) -> str:
    """A device event's family, for the gap table."""
    if name.startswith(("Memcpy", "Memset")):
        return " ".join(name.split()[:2])
    if name.startswith("_") and name.endswith("_kernel"):
        return name  # a Triton kernel of ops/triton
    if any(tag in name for tag in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "cuBLAS GEMM"
    return "other: " + name[:40]


def _print_device_gaps(trace: str, steps: int) -> None:
    """From a Chrome trace: how much of the profiled window the device was busy, and the idle
    gaps between its kernels and copies, by what ran after each gap (under a CUDA graph a gap
    before a kernel is that kernel's launch latency; long gaps are the device waiting for the
    host)."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not device:
        print("device gaps: no device events in the trace")
        return
    busy, short, long_, by_kind = 0.0, 0.0, 0.0, {}
    end = device[0][0]
    for start, stop, name in device:
        gap = start - end
        if gap > 0:
            kind = _kind(name)
            if gap > 20.0:  # us: not a launch gap; the device waited for the host
                long_ += gap
                kind = "(host wait > 20 us)"
            else:
                short += gap
            n, total = by_kind.get(kind, (0, 0.0))
            by_kind[kind] = (n + 1, total + gap)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    window = end - device[0][0]
    print(f"device gaps: window {window / steps / 1e3:.3f} ms a step, busy {busy / steps / 1e3:.3f}, "
          f"launch gaps (<= 20 us) {short / steps / 1e3:.3f}, host waits {long_ / steps / 1e3:.3f}; "
          f"{len(device) / steps:.0f} device events a step")
    print(f"{'gap before':<48} {'a step':>7} {'us a step':>9} {'mean us':>8}")
    for kind, (n, total) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"{kind:<48} {n / steps:>7.1f} {total / steps:>9.1f} {total / n:>8.2f}")
    # The host's CUDA API calls in the same window: a call that blocks (a synchronize, a
    # cudaFree, a pageable copy) shows as a long one; launches are a few us each.
    calls: dict[str, tuple[int, float, float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and device[0][0] <= e["ts"] <= end:
            n, total, longest = calls.get(e["name"], (0, 0.0, 0.0))
            dur = e.get("dur", 0.0)
            calls[e["name"]] = (n + 1, total + dur, max(longest, dur))
    print(f"{'host CUDA call':<48} {'a step':>7} {'us a step':>9} {'max us':>8}")
    for name, (n, total, longest) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"{name[:48]:<48} {n / steps:>7.1f} {total / steps:>9.1f} {longest:>8.1f}")


def _allocator_counts(device: str) -> dict[str, int]:
    """The CUDA caching allocator's counters that mean host stalls: cudaMalloc and cudaFree
    calls (a free synchronises the device), and retries after freeing the cache."""
    if not str(device).startswith("cuda"):
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0))
            for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                      "num_sync_all_streams")}


def _count_new_kernel_variants() -> dict[str, int]:
    """Counts Triton kernel variants built (compiled, or loaded from the disk cache) from now
    on: one met first inside a timed run means compile time may be inside the figure."""
    counter = {"n": 0}
    try:
        from triton import knobs
    except ImportError:
        return counter
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        counter["n"] += 1
        return previous(*args, **kwargs) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    return counter


def warm_up(llm, args: argparse.Namespace) -> None:  # noqa: ANN001
    """A short run of other prompts drawn like the workload's (so no prefix-cache hits): it
    compiles the Triton kernels for the prefill shapes the timed run will meet, which a cold
    kernel cache would otherwise charge to the first run (3 s on an H200)."""
    from bastion import SamplingParams

    n = min(args.num_seqs, 64)
    work = make_workload(n, args.min_input, args.max_input, 1, 1, args.seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in work.prompts],
                 SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.scheduler.kv.pool.reset_prefix_cache()


def run_bastion(args: argparse.Namespace, work: Workload) -> Result:
    from bastion import LLM, SamplingParams

    max_len = max(len(p) for p in work.prompts) + max(work.max_tokens)
    kwargs = {"model": args.model, "load_format": args.load_format, "dtype": args.dtype,
              "max_model_len": max(args.max_model_len or 0, max_len),
              "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "async_scheduling": args.async_scheduling}
    if args.device:
        kwargs["device"] = args.device
    if args.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.load_format == "dummy":
        kwargs["skip_tokenizer_init"] = True
    llm = LLM(**kwargs)
    device = llm.config.model.device
    warm_up(llm, args)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
              for n in work.max_tokens]
    wait = _time_device_waits()
    variants = _count_new_kernel_variants()
    if args.torch_profile:
        _profile_steps(llm, *map(int, args.torch_profile.split(":")), trace=args.profile_trace)
    if args.cprofile_steps:
        _cprofile_steps(llm, args.cprofile_steps)
    prof = None
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
    synchronize(device)
    alloc_before = _allocator_counts(device)
    start = time.perf_counter()
    if prof is not None:
        prof.enable()
    outputs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params)
    synchronize(device)
    seconds = time.perf_counter() - start
    if prof is not None:
        import pstats

        prof.disable()
        steps = llm.engine.scheduler.step_id
        print(f"cprofile: {steps} scheduler steps, {seconds / max(steps, 1) * 1e3:.2f} ms a "
              "step (under the profiler)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == work.num_output_tokens, (num_tokens, work.num_output_tokens)
    steps = wait.calls
    print(f"bastion steps: {steps}, {seconds / max(steps, 1) * 1e3:.2f} ms a step, of which "
          f"{wait.seconds / max(steps, 1) * 1e3:.2f} ms waiting for the device's tokens "
          f"(async scheduling {'on' if llm.engine.async_scheduling else 'off'}); "
          f"Triton kernel variants first built inside the timed run: {variants['n']}")
    wait.print_timeline(start)
    alloc = _allocator_counts(device)
    if alloc:
        print("caching allocator in the timed run: " + ", ".join(
            f"{k} {alloc[k] - alloc_before.get(k, 0)}" for k in alloc))
    del llm
    gc.collect()
    return Result("bastion LLM", len(work.prompts), num_tokens, seconds)


def run_bastion_dp(args: argparse.Namespace, work: Workload) -> Result:
    """Data parallel: one process per GPU, each with its own ``LLM`` and every N-th prompt;
    all start generating together, the wall time is the slowest rank's."""
    size = args.data_parallel_size
    go = os.path.join(tempfile.mkdtemp(prefix="bench-dp-"), "go")
    procs = []
    for rank in range(size):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)}
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--dp-rank", str(rank),
               "--dp-go-file", go]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    ready = [p.stdout.readline() for p in procs]
    assert all(line.startswith("READY") for line in ready), ready
    open(go, "w").close()
    results = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in procs]
    for p in procs:
        assert p.wait() == 0
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    copies = size if args.dp_whole_workload else 1
    assert tokens == copies * work.num_output_tokens, (tokens, work.num_output_tokens)
    for rank, r in enumerate(results):
        seconds, steps = r["end"] - r["start"], max(r["steps"], 1)
        print(f"bastion steps, rank {rank}: {r['steps']} in {seconds:.2f} s, "
              f"{seconds / steps * 1e3:.2f} ms a step, of which "
              f"{r['wait_s'] / steps * 1e3:.2f} ms waiting for the device's tokens")
    name = f"bastion LLM x DP={size}" + (", each the whole workload" if copies > 1 else "")
    return Result(name, copies * len(work.prompts), tokens, end - start)


def dp_rank_main(args: argparse.Namespace, work: Workload) -> None:
    """A DP rank: load, say READY, wait for the go file, generate its share, print JSON."""
    from bastion import LLM, SamplingParams

    rank, size = args.dp_rank, args.data_parallel_size
    share = slice(None) if args.dp_whole_workload else slice(rank, None, size)
    prompts, max_tokens = work.prompts[share], work.max_tokens[share]
    max_len = max(len(p) for p in work.prompts) + max(work.max_tokens)
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              max_model_len=max(args.max_model_len or 0, max_len),
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              skip_tokenizer_init=args.load_format == "dummy")
    warm_up(llm, args)
    print("READY", flush=True)
    while not os.path.exists(args.dp_go_file):
        time.sleep(0.001)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
              for n in max_tokens]
    wait = _time_device_waits()
    start = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    synchronize(llm.config.model.device)
    end = time.time()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"start": start, "end": end, "tokens": tokens, "steps": wait.calls,
                      "wait_s": wait.seconds}), flush=True)


def load_hf_model(args: argparse.Namespace, device: str, attn: str | None = None):
    from bastion.core.config import parse_dtype
    from bastion.core.loader.embedded import embedded_gguf_path
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = parse_dtype(args.dtype, device)
    extra = {"attn_implementation": attn} if attn else {}
    path = args.model or embedded_gguf_path()
    if args.load_format == "dummy":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                                 **extra)
    elif path.endswith(".gguf"):
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, **extra)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    return model.to(device).eval()


def run_hf_generate(args: argparse.Namespace, work: Workload, device: str) -> Result:
    """Static batches, left-padded; every sequence generates the longest requested length."""
    model = load_hf_model(args, device)
    pad_id = 0
    max_new = max(work.max_tokens)
    batch_size = args.hf_batch_size or len(work.prompts)
    sample = ({"do_sample": True, "temperature": args.temperature} if args.temperature > 0
              else {"do_sample": False})

    def generate(prompts: list[list[int]], num_new: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=device)
        return model.generate(ids, attention_mask=mask, max_new_tokens=num_new,
                              min_new_tokens=num_new, pad_token_id=pad_id, eos_token_id=None,
                              **sample)

    with torch.inference_mode():
        generate([list(range(1, 33))], 4)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        for i in range(0, len(work.prompts), batch_size):
            out = generate(work.prompts[i:i + batch_size], max_new)
            assert out.shape[1] - max(len(p) for p in work.prompts[i:i + batch_size]) == max_new
        synchronize(device)
        seconds = time.perf_counter() - start
    return Result("HF generate", len(work.prompts), work.num_output_tokens, seconds)


def paged_attention_name() -> str:
    """transformers renamed its paged SDPA backend ("sdpa_paged" -> "paged|sdpa")."""
    from transformers import AttentionInterface

    names = set(AttentionInterface._global_mapping)
    return next((n for n in ("paged|sdpa", "sdpa_paged", "paged|eager") if n in names),
                "paged|sdpa")


def run_hf_continuous(args: argparse.Namespace, work: Workload, device: str) -> Result:
    """transformers' own continuous batching (``init_continuous_batching``), EOS ignored."""
    from transformers import GenerationConfig

    model = load_hf_model(args, device, attn=paged_attention_name())
    if not hasattr(model, "continuous_batching_context_manager"):
        raise SystemExit("this transformers has no continuous batching API")
    config = GenerationConfig(max_new_tokens=max(work.max_tokens), do_sample=args.temperature > 0,
                              temperature=args.temperature or None, eos_token_id=-1,
                              pad_token_id=0)
    # No inference_mode here: transformers' batching thread updates its buffers in place.
    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=30) as manager:
        synchronize(device)
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
               for p, n in zip(work.prompts, work.max_tokens)]
        num_tokens, pending = 0, set(ids)
        while pending:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if result.is_finished() and result.request_id in pending:
                if result.error:
                    raise RuntimeError(f"HF request failed: {result.error}")
                pending.discard(result.request_id)
                num_tokens += len(result.generated_tokens)
        synchronize(device)
        seconds = time.perf_counter() - start
    assert num_tokens == work.num_output_tokens, (num_tokens, work.num_output_tokens)
    return Result("HF continuous batching", len(work.prompts), num_tokens, seconds)


def print_table(results: list[Result], work: Workload) -> None:
    print(f"\nworkload: {len(work.prompts)} seqs, {work.num_prompt_tokens} prompt tokens, "
          f"{work.num_output_tokens} output tokens")
    header = f"{'engine':<24}{'seqs':>6}{'output tok':>12}{'seconds':>10}{'output tok/s':>14}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.engine:<24}{r.num_seqs:>6}{r.num_output_tokens:>12}{r.seconds:>10.2f}"
              f"{r.throughput:>14.1f}")
    base = results[0]
    for r in results[1:]:
        print(f"ratio {base.engine} / {r.engine}: {base.throughput / r.throughput:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    p.add_argument("--load-format", default="auto", choices=("auto", "gguf", "hf", "dummy"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm samples at 0.6")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true", help="bastion only")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap scheduling with the device (default on)")
    p.add_argument("--torch-profile", default=None, metavar="FIRST:COUNT",
                   help="torch-profile engine steps FIRST..FIRST+COUNT-1 and print the kernels")
    p.add_argument("--profile-trace", default=None, metavar="PATH",
                   help="with --torch-profile: also write the Chrome trace there")
    p.add_argument("--cprofile-steps", type=int, default=0, metavar="N",
                   help="cProfile the host over engine steps 1..N")
    p.add_argument("--cprofile", action="store_true",
                   help="profile bastion's host side (cProfile) and print the top functions")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="one process per GPU, prompts split round-robin")
    p.add_argument("--dp-whole-workload", action="store_true",
                   help="every DP rank runs the whole workload (N times the work: throughput "
                        "with each GPU as loaded as one GPU alone), not every N-th prompt")
    p.add_argument("--dp-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dp-go-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF generate batch size (default: all sequences in one batch)")
    p.add_argument("--hf-continuous-batching", action="store_true",
                   help="compare with transformers' continuous batching instead of generate")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_nano_vllm_totals()
    work = make_workload(args.num_seqs, args.min_input, args.max_input, args.min_output,
                         args.max_output, args.seed)
    from bastion.core.config import default_device

    device = args.device or default_device()
    torch.manual_seed(args.seed)
    if args.dp_rank is not None:
        dp_rank_main(args, work)
        return 0
    if args.data_parallel_size > 1:
        results = [run_bastion_dp(args, work)]
    else:
        results = [run_bastion(args, work)]
    if not args.skip_hf:
        run_hf = run_hf_continuous if args.hf_continuous_batching else run_hf_generate
        results.append(run_hf(args, work, device))
    print_table(results, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
