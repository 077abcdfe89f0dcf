"""Multi-LoRA cost: offline throughput with adapters mixed evenly against the base model, and
the latency of one batch with one adapter against none.

GPU (the issue's targets: >= 80 % of the base throughput with 4 adapters, <= 15 % latency
overhead with one), Llama-3.1-8B architecture with dummy weights and random rank-16 adapters on
all seven modules:

    python scripts/bench_lora.py --device cuda

CPU, the embedded SmolLM2 with 2 adapters (small workload):

    python scripts/bench_lora.py --device cpu

Each configuration runs in its own process (an 8B model twice does not fit one GPU). The base
rows run without ``--enable-lora``; "lora engine, no adapter" is the LoRA engine serving base
requests (it replays decode graphs captured without the adapter kernels). Prints one table last.

``--profile`` adds a second table: device time per kernel name for one batch-8 decode step
(torch.profiler; on the CPU, CPU time per op) with one adapter, with the LoRA engine serving
base requests, and on the base engine. A step's time is the difference between a run of
``1 + --profile-steps`` output tokens and one of a single token (its prefill) over the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, hf_config, rank: int, seed: int) -> str:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random A
    and B on all seven modules of every layer, written without building the model."""
    from safetensors.torch import save_file

    from bastion.core.lora.peft import module_shapes

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (fan_in, fan_out) in module_shapes(hf_config).items():
            owner = "self_attn" if module in MODULES[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{name}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            ).to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=gen) * 0.01
            ).to(torch.bfloat16)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(MODULES),
                "bias": "none",
            },
            f,
        )
    return path


def engine_kwargs(args: argparse.Namespace) -> dict:
    if args.device == "cuda":
        return {
            "model": os.path.join(REPO, "configs", "llama-3.1-8b"),
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "device": "cuda",
            "max_model_len": 2048,
        }
    return {
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 512 << 20,
    }


def run_config(args: argparse.Namespace) -> dict:
    """One engine (base, or with --enable-lora): its throughput and latency rows."""
    from bastion import LLM, LoRARequest, SamplingParams

    if args.device == "cpu":
        torch.set_num_threads(1)  # see docs/BENCHMARKS.md, "Threads on a small CPU"
    kwargs = engine_kwargs(args)
    if args.only == "lora":
        kwargs.update(
            enable_lora=True,
            max_loras=args.num_adapters,
            max_lora_rank=args.rank,
            max_cpu_loras=args.num_adapters,
        )
    llm = LLM(**kwargs)
    loras = (
        [
            LoRARequest(f"a{i}", i + 1, os.path.join(args.adapter_dir, f"a{i}"))
            for i in range(args.num_adapters)
        ]
        if args.only == "lora"
        else []
    )
    rng = random.Random(0)
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_seqs)
    ]
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in lengths]
    mixed = [loras[i % len(loras)] for i in range(args.num_seqs)] if loras else None

    def timed(ps, sp, lora) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ps], sp, lora_request=lora, use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    # Warm-up: every adapter in its slot, every kernel variant built.
    timed(
        prompts[:8],
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8),
        [loras[i % len(loras)] for i in range(8)] if loras else None,
    )
    rows = {}
    if not args.latency_only:
        seconds = timed(prompts, params, mixed)
        name = f"throughput, {len(loras)} adapters mixed" if loras else "throughput, base"
        rows[name] = sum(lengths) / seconds
    batch = [[rng.randint(0, 10000) for _ in range(args.latency_input)] for _ in range(8)]
    latency = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.latency_output)
    cases = [("latency b8, base", None)]
    if loras:
        cases = [("latency b8, 1 adapter", loras[0]), ("latency b8, lora engine, no adapter", None)]
    for label, lora in cases:
        timed(batch, latency, lora)
        rows[label] = min(timed(batch, latency, lora) for _ in range(args.latency_iters))
        if args.profile:
            per_step = profile_decode(llm, batch, lora, args.profile_steps, args.device)
            print("PROFILE " + json.dumps({label.removeprefix("latency b8, "): per_step}))
    return rows


def _kernel_times(prof, device: str) -> dict[str, list[float]]:
    """{name: [microseconds, calls]} of the device kernels (CPU ops on the CPU) profiled."""
    from torch.autograd import DeviceType

    times: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        if device == "cuda":
            if evt.device_type != DeviceType.CUDA:
                continue
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = evt.self_cuda_time_total
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            times[evt.key] = [float(us), float(evt.count)]
    return times


def profile_decode(llm, batch, lora, num_steps: int, device: str) -> dict[str, list[float]]:
    """{kernel: [device us, launches]} per decode step of ``batch``: a run of 1 + num_steps
    output tokens less a run of 1 (the prefill and the first token), over num_steps."""
    from torch.profiler import ProfilerActivity, profile

    from bastion import SamplingParams

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    prompts = [{"prompt_token_ids": p} for p in batch]
    runs = []
    for max_tokens in (1, 1 + num_steps):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        llm.generate(prompts, params, lora_request=lora, use_tqdm=False)  # warm
        with profile(activities=activities) as prof:
            llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            if device == "cuda":
                torch.cuda.synchronize()
        runs.append(_kernel_times(prof, device))
    short, long = runs
    per_step = {}
    for name, (us, calls) in long.items():
        base_us, base_calls = short.get(name, (0.0, 0.0))
        per_step[name] = [(us - base_us) / num_steps, (calls - base_calls) / num_steps]
    return per_step


def print_profile(profiles: dict[str, dict[str, list[float]]], top: int) -> None:
    """One row per kernel (the ``top`` slowest in any case): us and launches per decode step."""
    labels = list(profiles)
    names = sorted(
        {n for p in profiles.values() for n in p},
        key=lambda n: -max(p.get(n, (0.0, 0.0))[0] for p in profiles.values()),
    )
    print(f"\ndevice time per batch-8 decode step, us (launches): {', '.join(labels)}")
    header = "".join(f"{label[:23]:>24}" for label in labels)
    print(f"{'kernel':<70}{header}")

    def cell(us: float, calls: float) -> str:
        return f"{us:>16.1f} ({calls:>5.0f})"

    for name in names[:top]:
        cells = "".join(cell(*profiles[label].get(name, (0.0, 0.0))) for label in labels)
        print(f"{name[:69]:<70}{cells}")
    totals = "".join(
        cell(sum(v[0] for v in p.values()), sum(v[1] for v in p.values()))
        for p in profiles.values()
    )
    print(f"{'total':<70}{totals}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-adapters", type=int, default=None, help="default: 4 GPU, 2 CPU")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-seqs", type=int, default=None, help="default: 256 GPU, 16 CPU")
    p.add_argument("--min-len", type=int, default=None, help="prompt and output lengths")
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--latency-input", type=int, default=32)
    p.add_argument("--latency-output", type=int, default=None, help="default: 128 GPU, 32 CPU")
    p.add_argument("--latency-iters", type=int, default=3)
    p.add_argument("--latency-only", action="store_true", help="skip the throughput runs")
    p.add_argument("--profile", action="store_true", help="device time per kernel, decode b8")
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps profiled")
    p.add_argument("--profile-top", type=int, default=30, help="kernels printed")
    p.add_argument("--only", choices=("base", "lora"), help=argparse.SUPPRESS)
    p.add_argument("--adapter-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    defaults = {
        "num_adapters": (4, 2),
        "num_seqs": (256, 16),
        "min_len": (100, 32),
        "max_len": (512, 96),
        "latency_output": (128, 32),
    }
    for key, (on_gpu, on_cpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.only is not None:
        print("RESULT " + json.dumps(run_config(args)))
        return 0
    from bastion.core.config import ModelConfig
    from bastion.core.loader import resolve_model

    kwargs = engine_kwargs(args)
    resolved = resolve_model(
        ModelConfig(
            model=kwargs.get("model"), device="cpu", load_format=kwargs.get("load_format", "auto")
        )
    )
    rows: dict[str, float] = {}
    profiles: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as adapter_dir:
        for i in range(args.num_adapters):
            write_random_adapter(
                os.path.join(adapter_dir, f"a{i}"), resolved.hf_config, args.rank, seed=i
            )
        for only in ("base", "lora"):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                *(argv or sys.argv[1:]),
                "--only",
                only,
                "--adapter-dir",
                adapter_dir,
                "--device",
                args.device,
            ]
            run = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if run.returncode:
                sys.stderr.write(run.stderr[-4000:])
                return run.returncode
            out = run.stdout
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            rows.update(json.loads(line[len("RESULT ") :]))
            for x in out.splitlines():
                if x.startswith("PROFILE "):
                    profiles.update(json.loads(x[len("PROFILE ") :]))
    base_tput, base_lat = rows.get("throughput, base"), rows["latency b8, base"]
    print(
        f"\nbench_lora on {args.device}: {'Llama-3.1-8B dummy' if args.device == 'cuda' else 'embedded SmolLM2'}, "
        f"rank {args.rank} on all seven modules, {args.num_seqs} seqs with prompt/output "
        f"lengths in [{args.min_len}, {args.max_len}]; latency: batch 8, {args.latency_input} "
        f"prompt + {args.latency_output} output tokens (best of {args.latency_iters})"
    )
    print(f"{'case':<40} {'value':>12} {'vs base':>9}")
    for name, value in rows.items():
        is_tput = name.startswith("throughput")
        ratio = value / (base_tput if is_tput else base_lat)
        unit = "tok/s" if is_tput else "s"
        print(f"{name:<40} {value:>8.{1 if is_tput else 3}f} {unit:<5} {ratio:>8.1%}")
    if profiles:
        print_profile(profiles, args.profile_top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
