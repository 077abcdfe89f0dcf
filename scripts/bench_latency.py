"""Latency of one batch, in the manner of ``vllm bench latency``, and the memory-bandwidth floors.

Default: Llama-3.1-8B architecture with dummy weights, batch 8, 32 prompt tokens, 128 output
tokens (EOS ignored, temperature 1.0 as vLLM's benchmark samples): seconds per batch over
``--num-iters`` runs after ``--num-iters-warmup``. The floor printed beside it is the bytes the
run must read (the weights once per forward step, plus the KV cache each decode step attends
over) divided by the device-to-device copy bandwidth measured in the same process.

    python scripts/bench_latency.py --model configs/llama-3.1-8b

``--offline-floor`` prints instead the floor of nano-vllm's offline workload (256 sequences,
lengths uniform in [100, 1024], seed 0) for ``--model``, for comparison with
``scripts/bench_offline.py``'s measured output tok/s:

    python scripts/bench_latency.py --model configs/qwen3-0.6b --offline-floor
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


class ModelBytes(NamedTuple):
    weights_per_step: int  # bytes every forward step reads (all weights but the input embedding)
    kv_per_token: int  # bytes of K and V of one token over all layers


def model_bytes(model_dir: str, dtype: torch.dtype) -> ModelBytes:
    """Counted from a model built on the meta device (no memory, no weights)."""
    from bastion.core.loader.hf_loader import load_hf_config
    from bastion.core.models.registry import get_model_class

    config = load_hf_config(model_dir, {})
    with torch.device("meta"):
        model = get_model_class(config.architectures[0])(config, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    total = sum(p.numel() for p in model.parameters()) * elem
    embed = model.model.embed_tokens.weight.numel() * elem
    # Tied: the embedding is the LM head and is read in full every step; untied: the input
    # embedding only gathers a few rows.
    per_step = total if getattr(config, "tie_word_embeddings", False) else total - embed
    kv = sum(2 * a.num_kv_heads * a.head_dim * elem for a in model.attention_layers())
    return ModelBytes(per_step, kv)


def copy_bandwidth() -> float:
    """Bytes/s (read + written) of a 2 GiB device-to-device copy, median of 20."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times)


def decode_floor_bytes(prompt_lens: list[int], output_lens: list[int], mb: ModelBytes) -> int:
    """Bytes a run must read when all sequences run together: the weights once for the prefill
    and once per decode step (as many as the longest output needs), and for each decode step
    of each sequence its whole context's K/V."""
    num_steps = max(output_lens)  # 1 prefill + (max - 1) decode steps
    kv_tokens = sum(sum(range(p + 1, p + n)) for p, n in zip(prompt_lens, output_lens))
    return num_steps * mb.weights_per_step + kv_tokens * mb.kv_per_token


def offline_floor(args: argparse.Namespace, dtype: torch.dtype) -> None:
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench_offline import make_workload

    work = make_workload(256, 100, 1024, 100, 1024, 0)
    mb = model_bytes(args.model, dtype)
    prompt_lens = [len(p) for p in work.prompts]
    floor = decode_floor_bytes(prompt_lens, work.max_tokens, mb)
    bw = copy_bandwidth()
    seconds = floor / bw
    print(f"offline floor ({os.path.basename(args.model.rstrip('/'))}, {dtype}): weights "
          f"{mb.weights_per_step / 1e9:.2f} GB/step, KV {mb.kv_per_token} B/token, "
          f"{floor / 1e12:.2f} TB to read at {bw / 1e12:.2f} TB/s copy bandwidth = "
          f"{seconds:.2f} s -> {work.num_output_tokens / seconds:,.0f} output tok/s at most")
    print_dp_floor(prompt_lens, work.max_tokens, mb, floor)


def print_dp_floor(prompt_lens: list[int], output_lens: list[int], mb: ModelBytes,
                   floor: int, size: int = 2) -> None:
    """The same floor for DP=``size`` ranks that each take every ``size``-th prompt (as
    ``bench_offline.py --data-parallel-size`` splits them): the slowest rank's bytes, so the
    most DP can gain over one GPU. Each rank still reads all the weights every step."""
    ranks = [decode_floor_bytes(prompt_lens[r::size], output_lens[r::size], mb)
             for r in range(size)]
    print(f"DP={size} floor: ranks read {', '.join(f'{b / 1e12:.2f}' for b in ranks)} TB -> "
          f"at most {floor / max(ranks):.3f}x one GPU's floor")


def latency(args: argparse.Namespace, dtype: torch.dtype) -> None:
    from bastion import LLM, SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              skip_tokenizer_init=True, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(args.input_len)]}
               for _ in range(args.batch_size)]
    params = SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True,
                            max_tokens=args.output_len)

    def one_batch() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        one_batch()
    times = [one_batch() for _ in range(args.num_iters)]
    mb = model_bytes(args.model, dtype)
    floor = decode_floor_bytes([args.input_len] * args.batch_size,
                               [args.output_len] * args.batch_size, mb)
    bw = copy_bandwidth()
    mean = statistics.mean(times)
    print(f"latency: TP={args.tensor_parallel_size}, batch {args.batch_size}, "
          f"{args.input_len} in, {args.output_len} out, "
          f"{os.path.basename(args.model.rstrip('/'))} dummy {dtype}")
    print(f"  avg {mean * 1e3:.1f} ms per batch (median {statistics.median(times) * 1e3:.1f}, "
          f"min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}; {len(times)} iters)")
    print(f"  floor {floor / bw * 1e3:.1f} ms ({floor / 1e9:.1f} GB at {bw / 1e12:.2f} TB/s); "
          f"{floor / bw / mean:.0%} of floor; {mean / args.output_len * 1e3:.2f} ms per token")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(REPO, "configs", "llama-3.1-8b"))
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--offline-floor", action="store_true",
                   help="print the floor of nano-vllm's offline workload and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_latency needs a CUDA GPU")
    from bastion.core.config import parse_dtype

    dtype = parse_dtype(args.dtype, "cuda")
    if args.offline_floor:
        offline_floor(args, dtype)
    else:
        latency(args, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
