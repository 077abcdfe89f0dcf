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
time of one bitmask fill (xgrammar's own time in the runner; only with the worker in this
process, ``--executor uni``), and the overhead against unconstrained.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import pstats
import random
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from bastion.core.engine_core import EngineCore
from bastion.ipc.messages import EngineCoreRequest, SamplingParams, StructuredOutputsParams
from bastion.procs.llm import LLM

# At least 16 objects (each 10 tokens or more), so every request keeps decoding under it up to
# max_tokens: only steps with the whole batch running are counted, and without ``minItems``
# (before session 22) random tokens closed some arrays within 48 tokens, which left a handful
# of steps to count and rounds that varied from -60 % to +200 %.
SCHEMA = {"type": "array", "minItems": 16, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}


# The worker's calls that --worker-times times (dotted from its model runner).
WORKER_PARTS = ["_apply_delta", "_prepare_decode", "graph_runner.run", "model.compute_logits",
                "_fold_tokens", "_mask_grammar_rows", "grammars._filler.fill",
                "grammars.stage", "_sample_step", "_sample"]


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


class HostTimes:
    """Where the engine's thread spends a step (``--breakdown``): the wall time inside each
    wrapped call, summed per step. ``wait tokens`` is a launched step's ``output()`` (the
    host waiting for the device and, with a worker process, for the worker)."""

    PARTS = ("schedule", "launch", "wait tokens", "fold", "other")
    # Inside the launch (a worker in this process): the decode graph's staging and replay, the
    # LM head, the grammar rows' catch-up, fill and mask, and the sampling.
    INNER = ("graph run", "logits", "grammar", "sample step")
    # Inside those: the fill itself, the mask's buffers (waiting for the last transfer out of
    # them), its kernel's launch, a graph's replay call and the wait for a staging buffer set.
    CALLS = ("fill", "mask buffer", "mask kernel", "replay", "staging")

    def __init__(self) -> None:
        self.step: dict[str, float] = dict.fromkeys(self.PARTS + self.INNER + self.CALLS, 0.0)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner: object, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.step[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def wrap_class(self, owner: object, name: str, part: str) -> Callable[[], None]:
        """``wrap`` for a class's method (every instance) or a module's function; returns
        the undo."""
        original = vars(owner)[name]
        self.wrap(owner, name, part)
        return lambda: setattr(owner, name, original)

    def unwrap(self, owner: object, names: list[str]) -> None:
        for name in names:
            if name in vars(owner):
                delattr(owner, name)

    def end_step(self, counted: bool, wall_s: float) -> None:
        if counted:
            self.step["other"] = wall_s - sum(self.step[p] for p in self.PARTS)
            self.steps.append(self.step)
        self.step = dict.fromkeys(self.PARTS + self.INNER + self.CALLS, 0.0)

    def medians_ms(self) -> dict[str, float]:
        steps = self.steps[2:] or self.steps
        return {part: 1e3 * statistics.median(s[part] for s in steps)
                for part in self.PARTS + self.INNER + self.CALLS}


def timed_batch(engine: EngineCore, eos_token_id: int, device: str, batch: int,
                prompt: list[int], max_tokens: int, spec: StructuredOutputsParams | None,
                tag: str, host: HostTimes | None = None, temperature: float = 0.0
                ) -> tuple[list[float], list[float]]:
    fills: list[float] = []
    runner = getattr(engine.executor, "runner", None)  # a worker in this process
    undo: list[Callable[[], None]] = []
    if runner is not None:
        filler = runner.grammars._filler
        fill = filler.fill

        def timed_fill(grammars, bitmask) -> None:
            start = time.perf_counter()
            fill(grammars, bitmask)
            fills.append(time.perf_counter() - start)
            if host is not None:
                host.step["fill"] += fills[-1]

        filler.fill = timed_fill
        undo.append(lambda: delattr(filler, "fill"))
    if host is not None:
        host.wrap(engine.scheduler, "schedule", "schedule")
        host.wrap(engine.scheduler, "update_from_output", "fold")
        undo.append(lambda: host.unwrap(engine.scheduler, ["schedule", "update_from_output"]))
        if runner is not None:
            inner = [(runner, "_sample_step"), (runner.model, "compute_logits"),
                     (runner.grammars, "mask")]
            inner += [(g, "run") for g in {id(g): g for g in (runner.graph_runner,
                      getattr(runner, "base_graph_runner", None)) if g is not None}.values()]
            for (owner, name), part in zip(inner, ("sample step", "logits", "grammar")
                                           + ("graph run",) * 2):
                host.wrap(owner, name, part)
                undo.append(lambda owner=owner, name=name: host.unwrap(owner, [name]))
            from bastion.core.staging import StagingRing
            from bastion.ops.triton import grammar_bitmask
            undo += [host.wrap_class(torch.cuda.CUDAGraph, "replay", "replay"),
                     host.wrap_class(StagingRing, "acquire", "staging"),
                     host.wrap_class(type(runner.grammars._applier), "_take", "mask buffer"),
                     host.wrap_class(grammar_bitmask, "apply_bitmask_rows_triton",
                                     "mask kernel")]
        launch = engine.executor.execute_model_async

        def timed_launch(sched):
            start = time.perf_counter()
            result = launch(sched)
            host.step["launch"] += time.perf_counter() - start
            host.wrap(result, "output", "wait tokens")
            return result

        engine.executor.execute_model_async = timed_launch
        undo.append(lambda: host.unwrap(engine.executor, ["execute_model_async"]))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=spec)
    for i in range(batch):
        engine.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params,
                                             eos_token_id=eos_token_id))
    steps = []
    # NOTE: no device sync per step: with async scheduling a step() returns while the next
    # one runs on the device, and that overlap is what is measured (the interval per step).
    synchronize(device)
    last = time.perf_counter()
    while engine.has_unfinished_requests:
        out = engine.step()
        now = time.perf_counter()
        counted = out.stats.num_running_reqs == batch and out.stats.num_waiting_reqs == 0
        if counted:
            steps.append(now - last)
        if host is not None:
            host.end_step(counted, now - last)
        last = now
    synchronize(device)
    for restore in undo:
        restore()
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
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's (both cases): 0 samples greedily")
    p.add_argument("--tokenizer", default=None,
                   help="a folder with a tokenizer for the stand-in vocabulary of a dummy model "
                        "(default: the embedded model's)")
    p.add_argument("--executor", choices=("uni", "mp"), default="uni",
                   help="uni: the worker in the engine's process (the offline LLM's default); "
                        "mp: a worker process, as a server runs it (its host work then no longer "
                        "shares the engine's interpreter)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run none then json this many times per batch size and report the "
                        "medians (the overhead: the median of each round's)")
    p.add_argument("--breakdown", action="store_true",
                   help="also the engine thread's host time per step by part (median ms)")
    p.add_argument("--cprofile", type=int, default=None, metavar="BATCH",
                   help="profile the timed runs of this batch size with cProfile (and, on a "
                        "GPU, torch's sync debug mode): the engine thread's top calls by own "
                        "time, where a host wait for the device shows as a C call")
    p.add_argument("--worker-profile", type=int, default=None, metavar="BATCH",
                   help="--executor mp: profile the worker process's loop (TP rank 0) with "
                        "cProfile over the timed runs of this batch size (first round) and "
                        "print its top calls by own time, none and json")
    p.add_argument("--worker-times", action="store_true",
                   help="--executor mp: the worker process's step by part (median ms): its "
                        "period, launch, when the step before's tokens went out, and the grammar "
                        "and sampling calls inside the launch")
    p.add_argument("--worker-parts", nargs="+", default=None, metavar="NAME",
                   help="--worker-times: the runner's calls to time (dotted from the model "
                        "runner), instead of the default list")
    p.add_argument("--torch-profile", type=int, default=None, metavar="BATCH",
                   help="GPU: profile the timed runs of this batch size with torch's profiler "
                        "and print the CUDA runtime calls and kernels by host time (a blocking "
                        "call, e.g. cudaEventSynchronize, shows its wait)")
    args = p.parse_args()
    max_num_seqs = max(args.batch_sizes)
    dummy = args.load_format == "dummy"
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              device=args.device, max_model_len=512, max_num_seqs=max_num_seqs,
              skip_tokenizer_init=dummy, distributed_executor_backend=args.executor)
    engine, eos_token_id, device = llm.engine, llm.eos_token_id, args.device
    if dummy:
        from bastion.core.loader import resolve_model

        vocab_size = resolve_model(llm.config.model).hf_config.vocab_size
        engine.structured_output.use_tokenizer(stand_in_vocabulary(vocab_size, args.tokenizer))
        eos_token_id = vocab_size - 1
    title = (f"{args.model or 'embedded SmolLM2-135M'} on {args.device}, {args.dtype}, "
             f"executor {args.executor}")
    prompt = [random.Random(1).randint(300, 10000) for _ in range(args.prompt_len)]
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    rows, breakdowns, profiles, worker_profiles, worker_times = [], [], [], [], []
    for batch in args.batch_sizes:
        medians: dict[str, list[float]] = {"none": [], "json": []}
        counted: list[int] = []  # json steps timed per round (the whole batch running)
        fill_ms: list[float] = []
        for round_ in range(args.rounds):
            for name, s in (("none", None), ("json", spec)):
                if round_ == 0:
                    timed_batch(engine, eos_token_id, device, batch, prompt, 8, s,
                                f"warm-{name}-{batch}")
                host = HostTimes() if args.breakdown else None
                worker_profile = (args.worker_profile == batch and round_ == 0
                                  and args.executor == "mp")
                if worker_profile:
                    engine.executor.call("start_profile")
                if args.worker_times and args.executor == "mp":
                    engine.executor.call("start_timing", args.worker_parts or WORKER_PARTS)
                profiler = (cProfile.Profile() if args.cprofile == batch else None)
                with sync_debug(profiler is not None and device == "cuda"), \
                        torch_profile(args.torch_profile == batch and device == "cuda",
                                      f"batch {batch} {name}"):
                    if profiler is not None:
                        profiler.enable()
                    steps, fills = timed_batch(engine, eos_token_id, device, batch, prompt,
                                               args.max_tokens, s, f"{name}-{batch}-{round_}",
                                               host, args.temperature)
                    if profiler is not None:
                        profiler.disable()
                        profiles.append((batch, name, len(steps), profiler))
                if worker_profile:
                    worker_profiles.append((batch, name, len(steps),
                                            engine.executor.call("stop_profile")[0]))
                if args.worker_times and args.executor == "mp":
                    worker_times.append((batch, name, engine.executor.call("stop_timing")[0]))
                medians[name].append(statistics.median(steps) * 1e3)
                if s is not None:
                    counted.append(len(steps))
                if host is not None:
                    breakdowns.append((batch, name, host.medians_ms()))
                if fills:
                    fill_ms.append(statistics.median(fills) * 1e3)
        # Each round's json against the none just before it; the host's speed drifts between
        # rounds more than within one.
        overheads = [100 * (j / n - 1) for n, j in zip(medians["none"], medians["json"])]
        rows.append((batch, statistics.median(medians["none"]),
                     statistics.median(medians["json"]),
                     statistics.median(fill_ms) if fill_ms else 0.0,
                     statistics.median(overheads), overheads, min(counted)))
    print(f"\n{title}, {args.max_tokens} tokens per request, prompt {args.prompt_len}, "
          f"temperature {args.temperature}, "
          f"{args.rounds} round(s) of none then json (medians over rounds)")
    print(f"{'batch':>5} | {'step ms (none)':>14} | {'step ms (json)':>14} | "
          f"{'fill ms':>7} | {'overhead':>8} | json steps | each round")
    for batch, none, js, fill, pct, each, num_steps in rows:
        print(f"{batch:>5} | {none:>14.2f} | {js:>14.2f} | {fill:>7.2f} | {pct:>+7.1f}% | "
              f"{num_steps:>10} | " + " ".join(f"{x:+.0f}%" for x in each))
    if breakdowns:
        print("\nhost time per step on the engine's thread, median ms")
        for columns in (HostTimes.PARTS, HostTimes.INNER, HostTimes.CALLS):
            print(f"{'batch':>5} {'case':>5} | " + " | ".join(f"{p:>11}" for p in columns))
            for batch, name, parts in breakdowns:
                print(f"{batch:>5} {name:>5} | "
                      + " | ".join(f"{parts[p]:>11.3f}" for p in columns))
    if worker_times:
        print("\nthe worker process's step (TP rank 0), median ms; 'tokens at' / 'sent at': "
              "when the step before's tokens reached the sender thread / went out, from the "
              "step's start")
        columns = ["period", "launch", "tokens at", "sent at"] + (args.worker_parts
                                                                  or WORKER_PARTS)
        print(f"{'batch':>5} {'case':>5} | " + " | ".join(f"{c.split('.')[-1][-14:]:>14}"
                                                        for c in columns))
        for batch, name, parts in worker_times:
            print(f"{batch:>5} {name:>5} | "
                  + " | ".join(f"{parts.get(c, 0.0):>14.3f}" for c in columns))
    for batch, name, num_steps, profiler in profiles:
        print(f"\ncProfile, batch {batch} {name} ({num_steps} timed steps), top calls by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    for batch, name, num_steps, text in worker_profiles:
        print(f"\nworker process (TP rank 0), cProfile, batch {batch} {name} ({num_steps} timed "
              f"steps, and the batch's prefill), top calls by own time\n{text}")
    llm.shutdown()


@contextlib.contextmanager
def torch_profile(on: bool, title: str):
    """torch's profiler around a timed run: host time of each CUDA runtime call and op."""
    if not on:
        yield
        return
    from kernel_timeline import format_timeline, kernels_of, layer_timeline
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    events = prof.key_averages()
    print(f"\ntorch profile, {title}: by host (self CPU) time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    device_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(f"torch profile, {title}: by device time ({device_ms:.2f} ms in all)")
    print(events.table(sort_by="self_device_time_total", row_limit=14,
                       max_name_column_width=60))
    try:
        print(format_timeline(layer_timeline(kernels_of(prof), "_unified_attention_kernel")))
    except ValueError as exc:  # e.g. a trace without the graphs' kernels
        print(f"no layer timeline: {exc}")


@contextlib.contextmanager
def sync_debug(on: bool):
    """torch's CUDA sync debug mode: each call that makes the host wait for the device (an
    ``item()``, a blocking copy) warns; the distinct call sites are printed, counted."""
    if not on:
        yield
        return
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "bastion" in f.filename]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:][::-1])
              or f"{filename}:{lineno}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # puts the filters and showwarning back on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        print("synchronizing CUDA calls:", dict(sites.most_common(8)) or "none")


if __name__ == "__main__":
    main()
