"""The engine's host work per step, without a model: scheduler, KV manager, output handling.

A stub executor answers every step at once with one token per sampling request, so the figure is
the Python time a step costs the host whatever the device does. On the GPU that time must hide
behind the device's step (async scheduling); where the batch is small it does not (see
docs/BENCHMARKS.md). Runs anywhere (no torch device used):

    python scripts/bench_host.py                  # nano-vllm's workload: 256 seqs, 100-1024 in/out
    python scripts/bench_host.py --cprofile       # and where the time goes

Prints steps, ms a step, and with --cprofile the top functions by own time.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bastion.core.config import build_engine_config
from bastion.core.engine_core import EngineCore
from bastion.core.output_processor import OutputProcessor
from bastion.ipc.messages import (
    EngineCoreRequest,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)


class _Done:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def output(self) -> ModelRunnerOutput:
        return self._output


class StubExecutor:
    """Tracks what a model runner tracks (tokens known and computed per request) and samples
    token 7 for every request whose scheduled tokens reach the end of what it knows."""

    def __init__(self, num_blocks: int, block_bytes: int = 1) -> None:
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.known: dict[str, int] = {}

    def kv_cache_bytes_per_block(self) -> int:
        return self.block_bytes

    def available_kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def reset(self) -> None:
        self.known.clear()

    def shutdown(self) -> None:
        pass

    def execute_model_async(self, sched: SchedulerOutput) -> _Done:
        for rid in sched.finished_request_ids:
            self.known.pop(rid, None)
        computed = {}
        for new in sched.new_requests:
            self.known[new.request_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            computed[new.request_id] = new.num_computed_tokens
        for cached in sched.cached_requests:
            computed[cached.request_id] = cached.num_computed_tokens
        ids = []
        for rid, n in sched.num_scheduled_tokens.items():
            if computed[rid] + n >= self.known[rid]:
                ids.append(rid)
                self.known[rid] += 1
        return _Done(ModelRunnerOutput(ids, [7] * len(ids), [], sched.step_id))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_seqs)]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    max_len = args.max_input + args.max_output
    config = build_engine_config(max_model_len=max_len, max_num_seqs=args.num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 async_scheduling=args.async_scheduling)
    block = config.cache.block_size
    num_blocks = args.num_seqs * (-(-max_len // block)) + 16
    engine = EngineCore(config, StubExecutor(num_blocks), max_len)
    processor = OutputProcessor(None)
    for i, (prompt, n) in enumerate(zip(prompts, outputs)):
        req = EngineCoreRequest(str(i), prompt, SamplingParams(max_tokens=n, ignore_eos=True,
                                                                temperature=0.0))
        processor.add(req, str(i), 0)
        engine.add_request(req)

    prof = None
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    start = time.perf_counter()
    steps = tokens = 0
    while engine.has_unfinished_requests:
        step = engine.step()
        steps += 1
        for out in step.outputs:
            processor.process(out)
            tokens += len(out.new_token_ids)
    seconds = time.perf_counter() - start
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    assert tokens == sum(outputs), (tokens, sum(outputs))
    print(f"host only: {steps} steps, {tokens} tokens, {seconds:.2f} s, "
          f"{seconds / steps * 1e3:.3f} ms a step, {seconds / tokens * 1e6:.2f} us a token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
