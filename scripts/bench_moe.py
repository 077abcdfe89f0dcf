"""A MoE model on one GPU: offline throughput and batch latency beside their bandwidth floors.

The floor of a step is the bytes it must read: every non-expert weight (attention, norms,
router, the LM head; not the input embedding unless tied), each MoE layer's experts that the
step's tokens route to, and every sequence's K/V context, over the copy bandwidth measured in
the same run. Which experts a batch of B tokens reaches is taken from the model itself: after
the timed runs a census of eager decode steps of ``--census-batch`` sequences records how often
each layer's router picks each expert for a decoding token (q_e, summing to top-k), and a
batch of B tokens is counted as touching sum_e 1 - (1 - q_e)^B experts in that layer
(independent tokens; the experts the census steps actually reached are printed beside it). The schedule is the ideal one: one prefill of every prompt,
then all sequences decoding together, as many steps as the longest output.

    python scripts/bench_moe.py --model configs/qwen3-30b-a3b            # both workloads
    python scripts/bench_moe.py --model configs/qwen3-30b-a3b --latency  # batch 1 and 8

Latency prints the whole batch against its floor, and the decode step alone: (the batch's time
less a run of the same prompts with one output token) over the 127 decode steps, against one
decode step's floor (issue #18's batch-1 target is about that step).

    python scripts/bench_moe.py --variants BASTION_GEMV_WHOLE_K=0 BASTION_GEMV_WHOLE_K=1 --rounds 3

compares switches read at launch (``bastion.envs``; several in one variant joined by ``+``)
in one process: the engine starts once, for a batch of one sequence, and every round sets each
variant in turn, captures the decode graphs again and times the batch (min ms of
``--num-iters``), so that a variant costs seconds instead of a process start (about 25 s).
``--timeline`` adds each variant's layer timeline (one profiled batch).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import NamedTuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from bench_latency import copy_bandwidth
from bench_offline import _time_device_waits, make_workload
from kernel_timeline import format_timeline, kernels_of, layer_timeline


class MoEBytes(NamedTuple):
    dense_per_step: int  # non-expert weights read every step
    per_expert: int  # one expert of one layer (gate, up, down)
    kv_per_token: int


def moe_bytes(model_dir: str, dtype: torch.dtype) -> MoEBytes:
    """Counted on a model built on the meta device."""
    from bastion.core.loader.hf_loader import load_hf_config
    from bastion.core.models.layers.fused_moe import FusedMoE
    from bastion.core.models.registry import get_model_class

    config = load_hf_config(model_dir, {})
    with torch.device("meta"):
        model = get_model_class(config.architectures[0])(config, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_total = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in moe) * elem
    total = sum(p.numel() for p in model.parameters()) * elem
    embed = model.model.embed_tokens.weight.numel() * elem
    dense = total - expert_total - (0 if config.tie_word_embeddings else embed)
    per_expert = (moe[0].w13_weight[0].numel() + moe[0].w2_weight[0].numel()) * elem
    kv = sum(2 * a.num_kv_heads * a.head_dim * elem for a in model.attention_layers())
    return MoEBytes(dense, per_expert, kv)


def routing_census(llm, batch: int) -> tuple[list[torch.Tensor], float]:
    """Per MoE layer, the probability that a decoding token picks each expert (sums to top-k),
    from eager decode steps of ``batch`` sequences; and the experts a layer's step actually
    reached, averaged. Decode rows are counted, not prefill ones: the hidden states of one
    long prompt route far more alike than those of many sequences' next tokens."""
    from bastion import SamplingParams
    from bastion.core.models.layers.fused_moe import FusedMoE
    from bastion.ops.moe import select_experts

    runner = llm.engine.executor.runner
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    counts = [torch.zeros(m.num_experts, dtype=torch.float64) for m in layers]
    rows, reached = [0], []

    def make_hook(i: int):
        def hook(module, inputs) -> None:
            if inputs[1].shape[0] != batch:  # a prefill chunk
                return
            _, ids = select_experts(inputs[1], module.top_k, module.renormalize)
            hist = torch.bincount(ids.reshape(-1).long(), minlength=module.num_experts).cpu()
            counts[i] += hist.double()
            reached.append(int((hist > 0).sum()))
            if i == 0:
                rows[0] += ids.shape[0]
        return hook

    handles = [m.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(layers)]
    graphs, runner.graph_runner = runner.graph_runner, None  # hooks do not run in a replay
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(32)]}
               for _ in range(batch)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=9))
    finally:
        runner.graph_runner = graphs
        for h in handles:
            h.remove()
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    return [c / rows[0] for c in counts], sum(reached) / max(len(reached), 1)


def touched(q: list[torch.Tensor], batch: int) -> float:
    """Experts a batch of ``batch`` tokens reaches, summed over the MoE layers."""
    return sum(float((1 - (1 - p.clamp(max=1)) ** batch).sum()) for p in q)


def step_floor_bytes(prompt_lens: list[int], output_lens: list[int], mb: MoEBytes,
                     q: list[torch.Tensor]) -> list[tuple[int, float]]:
    """(sequences decoding, bytes) of each step of the ideal schedule: the whole prefill as one
    step (0 sequences: its weights read once, its compute not counted), then one decode step
    per token position."""
    steps = [(0, mb.dense_per_step + touched(q, sum(prompt_lens)) * mb.per_expert)]
    for s in range(1, max(output_lens)):
        running = [(p, n) for p, n in zip(prompt_lens, output_lens) if n > s]
        steps.append((len(running), mb.dense_per_step + touched(q, len(running)) * mb.per_expert
                      + sum(p + s for p, _ in running) * mb.kv_per_token))
    return steps


def floor_bytes(prompt_lens: list[int], output_lens: list[int], mb: MoEBytes,
                q: list[torch.Tensor]) -> float:
    return sum(b for _, b in step_floor_bytes(prompt_lens, output_lens, mb, q))


PHASE_BATCHES = (192, 128, 64, 32, 16, 8, 2, 1)


def phase_table(run: OfflineRun, mb: MoEBytes, q: list[torch.Tensor], bw: float) -> str:
    """Where an offline run's time went against its floor, by phase: the prefill phase (the
    steps until every sequence has its first token, decode steps of the early ones included;
    its floor is the ideal prefill's one read of the weights), then the decode steps by how
    many sequences they carried (floor: the ideal schedule's steps of as many). 'host ms' is
    what a step's wall time did not spend waiting for its tokens."""
    def bucket(batch: int) -> str:
        return f"decode >= {next(b for b in PHASE_BATCHES if batch >= b):3d}"

    floors: dict[str, float] = {}  # seconds
    for batch, num_bytes in step_floor_bytes(run.prompt_lens, run.output_lens, mb, q):
        key = "prefill phase" if batch == 0 else bucket(batch)
        floors[key] = floors.get(key, 0.0) + num_bytes / bw
    measured: dict[str, list[float]] = {}
    previous, prefilled = run.start, False
    for batch, end, waited in run.steps:
        key = bucket(batch) if prefilled else "prefill phase"
        prefilled = prefilled or batch >= len(run.prompt_lens)  # every sequence has a token
        row = measured.setdefault(key, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += end - previous
        row[2] += waited
        previous = end
    lines = [(f"{'phase':>14} {'steps':>6} {'seconds':>8} {'floor s':>8} {'of floor':>8} "
              f"{'host ms':>8}")]
    for key in ["prefill phase"] + [bucket(b) for b in PHASE_BATCHES]:
        if key not in measured and key not in floors:
            continue
        n, wall, waited = measured.get(key, [0, 0.0, 0.0])
        floor_s = floors.get(key, 0.0)
        lines.append(f"{key:>14} {n:>6} {wall:>8.3f} {floor_s:>8.3f} "
                     f"{floor_s / wall if wall else 0:>8.0%} "
                     f"{(wall - waited) / max(n, 1) * 1e3:>8.2f}")
    return "\n".join(lines)


class OfflineRun(NamedTuple):
    name: str
    seconds: float
    prompt_lens: list[int]
    output_lens: list[int]
    start: float  # perf_counter at the run's start
    steps: list[tuple[int, float, float]]  # (sequences sampled, end, seconds waited) a step


def offline(llm, name: str, work) -> OfflineRun:
    from bastion import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
              for n in work.max_tokens]
    timer = _time_device_waits()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == work.num_output_tokens
    return OfflineRun(name, seconds, [len(p) for p in work.prompts], work.max_tokens, start,
                      list(timer.steps))


def profile_decode(llm, batch: int) -> None:
    """Device time per kernel over a batch's 16 steps (one prefill, 15 graph replays), and
    one decode layer's kernels laid out in time (``kernel_timeline``)."""
    from torch.profiler import ProfilerActivity, profile

    from bastion import SamplingParams

    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(32)]}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    llm.generate(prompts, params)

    def wall(max_tokens: int) -> float:
        llm.engine.scheduler.kv.pool.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True,
                                             max_tokens=max_tokens))
        torch.cuda.synchronize()
        return time.perf_counter() - start

    first, whole = min(wall(1) for _ in range(3)), min(wall(16) for _ in range(3))
    print(f"profile batch {batch}: wall {first * 1e3:.1f} ms for the prefill, "
          f"{whole * 1e3:.1f} ms for 16 steps: {(whole - first) / 15 * 1e3:.2f} ms a decode "
          f"step (best of 3)")
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"profile batch {batch} (16 steps): device {total / 1e3:.1f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x "
              f"{e.self_device_time_total / max(e.count, 1):8.1f} us  {e.key[:70]}")
    # Under programmatic dependent launch the kernels overlap: one layer laid out in time.
    try:
        print(format_timeline(layer_timeline(kernels_of(prof), "_unified_attention_kernel")))
    except ValueError as exc:  # e.g. a trace without the graphs' kernels
        print(f"no layer timeline: {exc}")


def parse_variant(variant: str) -> dict[str, str]:
    """'A=1+B=x' -> {'A': '1', 'B': 'x'}; 'base' -> {}."""
    if variant == "base":
        return {}
    pairs = [part.partition("=") for part in variant.split("+")]
    if any(not name or not sep for name, sep, _ in pairs):
        raise SystemExit(f"a variant is NAME=VALUE[+NAME=VALUE...] or 'base'; got {variant!r}")
    return {name: value for name, _, value in pairs}


def time_batch(llm, prompts: list[dict], max_tokens: int, iters: int
               ) -> tuple[list[float], list[list[int]]]:
    """Seconds of ``iters`` runs of ``prompts`` (after one warm-up), prefix cache reset each,
    and the tokens of the last."""
    from bastion import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    times = []
    for i in range(iters + 1):
        llm.engine.scheduler.kv.pool.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return times, [list(o.outputs[0].token_ids) for o in outs]


def compare_variants(args) -> int:
    """``--variants``: one engine, the decode graphs captured again for every variant, batch 1
    (32 in / 128 out) timed in rounds; the step figure is from the minima, as ``--latency``."""
    from bastion import LLM

    variants = [(v, parse_variant(v)) for v in args.variants]
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=2304, max_num_seqs=1, max_num_batched_tokens=16384)
    graphs = llm.engine.executor.runner.graph_runner
    if graphs is None:
        raise SystemExit("--variants needs the decode CUDA graphs (a GPU, not --enforce-eager)")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(32)]}]
    base_env = dict(os.environ)
    best: dict[str, list[float]] = {v: [] for v, _ in variants}
    tokens: dict[str, list[list[int]]] = {}
    prefill: list[float] = []
    for r in range(args.rounds):
        # Alternate the order, so that a drift over the run does not favour one variant.
        for name, env in (variants if r % 2 == 0 else variants[::-1]):
            os.environ.clear()
            os.environ.update({**base_env, **env})
            graphs.recapture()
            times, tokens[name] = time_batch(llm, prompts, 128, args.num_iters)
            best[name].append(min(times))
            if args.timeline and r == 0:
                print(f"timeline of {name}:")
                profile_decode(llm, 1)
        os.environ.clear()
        os.environ.update(base_env)
        graphs.recapture()
        prefill.append(min(time_batch(llm, prompts, 1, args.num_iters)[0]))
    mb = moe_bytes(args.model, torch.bfloat16)
    q, _ = routing_census(llm, 1)
    bw = copy_bandwidth()
    step_floor = (mb.dense_per_step + touched(q, 1) * mb.per_expert) / bw
    first = min(prefill)
    print(f"\nbatch 1, 32 in / 128 out, min ms per batch of {args.num_iters} in each of "
          f"{args.rounds} rounds; prefill + first token {first * 1e3:.1f} ms (min); decode step "
          f"floor {step_floor * 1e3:.2f} ms at {bw / 1e12:.2f} TB/s")
    print("variant | ms per batch by round | step ms (best) | x floor | tokens as the first "
          "variant's")
    first_tokens = tokens[variants[0][0]]
    for name, times in best.items():
        step = (min(times) - first) / 127
        print(f"{name} | {' '.join(f'{t * 1e3:.1f}' for t in times)} | {step * 1e3:.3f} | "
              f"{step / step_floor:.2f}x | "
              f"{'same' if tokens[name] == first_tokens else 'DIFFERENT'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "configs", "qwen3-30b-a3b"))
    p.add_argument("--latency", action="store_true", help="32 in / 128 out at --batch-sizes")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                   help="the latency run's batch sizes")
    p.add_argument("--offline", action="store_true", help="the two offline workloads")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--census-batch", type=int, default=256)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--profile", type=int, nargs="*", default=[],
                   help="batch sizes to profile (32 in / 16 out): device time per kernel")
    p.add_argument("--variants", nargs="+", default=[],
                   help="in-process A/B at batch 1: NAME=VALUE[+NAME=VALUE...] each, or 'base'")
    p.add_argument("--rounds", type=int, default=2, help="rounds over --variants")
    p.add_argument("--timeline", action="store_true",
                   help="with --variants: each variant's layer timeline in the first round")
    args = p.parse_args(argv)
    if args.variants:
        return compare_variants(args)
    if not (args.latency or args.offline):
        args.latency = args.offline = True
    from bastion import LLM, SamplingParams

    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=2304, max_num_seqs=256, max_num_batched_tokens=16384,
              enforce_eager=args.enforce_eager)
    warm = make_workload(64, 100, 1024, 1, 1, 1)
    llm.generate([{"prompt_token_ids": q} for q in warm.prompts],
                 SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    mb = moe_bytes(args.model, torch.bfloat16)
    rows: list[OfflineRun] = []
    if args.offline:
        rows.append(offline(llm, "offline 64 seqs, in U[100,512], out U[64,256]",
                            make_workload(64, 100, 512, 64, 256, 0)))
        llm.engine.scheduler.kv.pool.reset_prefix_cache()
        rows.append(offline(llm, "offline nano-vllm: 256 seqs, in/out U[100,1024]",
                            make_workload(256, 100, 1024, 100, 1024, 0)))
    latencies: list[tuple[int, list[float]]] = []
    if args.latency:
        rng = random.Random(0)
        for batch in args.batch_sizes:
            prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(32)]}
                       for _ in range(batch)]
            # The whole batch, and its prefill alone.
            runs = {n: time_batch(llm, prompts, n, args.num_iters)[0] for n in (128, 1)}
            latencies.append((batch, runs[128], runs[1]))
    for batch in args.profile:
        profile_decode(llm, batch)
    q, reached = routing_census(llm, args.census_batch)
    bw = copy_bandwidth()
    print(f"\n{os.path.basename(args.model.rstrip('/'))} dummy bf16"
          f"{' eager' if args.enforce_eager else ', CUDA graphs'}: non-expert weights "
          f"{mb.dense_per_step / 1e9:.2f} GB/step, {mb.per_expert / 1e6:.2f} MB per expert, "
          f"{len(q)} MoE layers; copy bandwidth {bw / 1e12:.2f} TB/s; experts reached per layer "
          f"at batch 1/8/64/256: "
          + "/".join(f"{touched(q, b) / len(q):.1f}" for b in (1, 8, 64, 256))
          + f" (counted in the census's decode steps of {args.census_batch}: {reached:.1f})")
    for run in rows:
        floor_s = floor_bytes(run.prompt_lens, run.output_lens, mb, q) / bw
        num_out = sum(run.output_lens)
        print(f"{run.name}: {num_out / run.seconds:,.0f} output tok/s ({run.seconds:.2f} s); "
              f"floor {floor_s:.2f} s = {num_out / floor_s:,.0f} tok/s; "
              f"{floor_s / run.seconds:.0%} of floor")
        print(phase_table(run, mb, q, bw))
    for batch, times, prefill_times in latencies:
        mean, prefill = statistics.mean(times), statistics.mean(prefill_times)
        floor_s = floor_bytes([32] * batch, [128] * batch, mb, q) / bw
        step_floor = (mb.dense_per_step + touched(q, batch) * mb.per_expert) / bw
        decode_step = (mean - prefill) / 127
        min_step = (min(times) - min(prefill_times)) / 127
        print(f"latency batch {batch}, 32 in / 128 out: {mean * 1e3:.1f} ms per batch "
              f"(min {min(times) * 1e3:.1f}; {mean / floor_s:.2f}x its floor "
              f"{floor_s * 1e3:.1f} ms); prefill + first token {prefill * 1e3:.1f} ms; decode "
              f"{decode_step * 1e3:.2f} ms per step against a floor of "
              f"{step_floor * 1e3:.2f} ms: {decode_step / step_floor:.2f}x (from the minima, "
              f"steadier: {min_step * 1e3:.2f} ms, {min_step / step_floor:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
