"""Tune the fused MoE kernels' launch configurations on this GPU and write the JSON table
that ``bastion.ops.moe_configs`` reads (in the manner of vLLM's ``benchmark_moe.py --tune``).

For each token count the routing is drawn at random (uniform router logits, top-k), then every
candidate ``BLOCK_SIZE_M`` is tried with a grid of tiles for each product (gate/up with SiLU,
and down), each timed alone with CUDA events (median of ``--iters``); the best pair under one
shared ``BLOCK_SIZE_M`` (the align step pads to it) is kept. Each line printed gives the two
products' times beside their floor: the bytes of the experts the tokens route to (plus
activations) over the copy bandwidth measured in the same run.

    python scripts/tune_moe.py --model configs/qwen3-30b-a3b --out ops/moe_configs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN_COUNTS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192,
                16384]


def candidates(block_m: int) -> list[dict[str, int]]:
    if block_m == 16:
        grid = itertools.product([32, 64, 128], [64, 128], [1], [4], [3, 4, 5])
    elif block_m == 128:
        grid = itertools.product([64, 128], [64], [8], [4, 8], [3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128], [8], [4, 8], [3, 4])
    keys = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
    return [dict(zip(keys, c)) for c in grid]


def time_ms(fn, iters: int) -> float:
    """Median milliseconds; infinity for a tile that does not fit the GPU (shared memory)."""
    import triton.testing
    from triton.runtime.errors import OutOfResources

    try:
        return triton.testing.do_bench(fn, warmup=5, rep=iters, return_mode="median")
    except OutOfResources:
        return float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "configs", "qwen3-30b-a3b"))
    p.add_argument("--tp", type=int, default=1, help="intermediate size split over TP ranks")
    p.add_argument("--ep", type=int, default=1, help="experts split over EP ranks")
    p.add_argument("--tokens", type=int, nargs="*", default=TOKEN_COUNTS)
    p.add_argument("--iters", type=int, default=20, help="milliseconds of repeats per candidate")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    from bastion.ops.moe_configs import config_file_name, default_moe_config
    from bastion.ops.triton.fused_moe import fused_moe_gemm_triton
    from bastion.ops.triton.moe_align import moe_align_triton
    from bastion.ops.triton.moe_routing import moe_routing_triton
    from transformers import AutoConfig

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench_latency import copy_bandwidth

    cfg = AutoConfig.from_pretrained(args.model)
    num_experts = cfg.num_experts // args.ep
    inter, hidden, top_k = cfg.moe_intermediate_size // args.tp, cfg.hidden_size, \
        cfg.num_experts_per_tok
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth()
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=dtype) * 0.02
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; E={num_experts} N={inter} K={hidden} "
          f"top-{top_k}; {expert_bytes / 1e6:.1f} MB per expert")
    table: dict[str, dict] = {}
    print(f"{'tokens':>6} {'BM':>4} {'up us':>8} {'down us':>8} {'floor us':>8} {'of floor':>8}"
          f" {'default us':>10}")
    for m in args.tokens:
        logits = torch.randn(m, cfg.num_experts, device=dev, dtype=dtype)
        weights, ids = moe_routing_triton(logits, top_k, True)
        ids = ids % num_experts if args.ep > 1 else ids  # this rank's share, as if local
        x = torch.randn(m, hidden, device=dev, dtype=dtype)
        touched = int(torch.unique(ids).numel())
        floor_s = (touched * expert_bytes + 2 * m * hidden * 2 + m * top_k * inter * 4) / bw
        best: tuple[float, dict] | None = None
        for block_m in [16, 32, 64, 128]:
            if block_m > 16 and m * top_k / num_experts < block_m / 4:
                continue  # most rows of every block would be padding
            sorted_ids, block_experts, num_sorted = moe_align_triton(ids, block_m, num_experts)
            act = torch.empty(m * top_k, inter, device=dev, dtype=dtype)
            out = torch.empty(m * top_k, hidden, device=dev, dtype=dtype)
            flat_w = weights.reshape(-1)

            def up(c):
                return lambda: fused_moe_gemm_triton(
                    x, w13, act, None, sorted_ids, block_experts, num_sorted, top_k, True,
                    {"BLOCK_SIZE_M": block_m, **c})

            def down(c):
                return lambda: fused_moe_gemm_triton(
                    act, w2, out, flat_w, sorted_ids, block_experts, num_sorted, top_k, False,
                    {"BLOCK_SIZE_M": block_m, **c})

            up_t = min((time_ms(up(c), args.iters), i) for i, c in enumerate(candidates(block_m)))
            down_t = min((time_ms(down(c), args.iters), i)
                         for i, c in enumerate(candidates(block_m)))
            total = up_t[0] + down_t[0]
            if best is None or total < best[0]:
                best = (total, {"BLOCK_SIZE_M": block_m, "up": candidates(block_m)[up_t[1]],
                                "down": candidates(block_m)[down_t[1]]},
                        up_t[0], down_t[0])
        d = default_moe_config(m, top_k, num_experts)
        sorted_ids, block_experts, num_sorted = moe_align_triton(ids, d["BLOCK_SIZE_M"],
                                                                 num_experts)
        act = torch.empty(m * top_k, inter, device=dev, dtype=dtype)
        out = torch.empty(m * top_k, hidden, device=dev, dtype=dtype)
        default_t = time_ms(lambda: fused_moe_gemm_triton(
            x, w13, act, None, sorted_ids, block_experts, num_sorted, top_k, True,
            {**d, **d["up"]}), args.iters) + time_ms(lambda: fused_moe_gemm_triton(
                act, w2, out, weights.reshape(-1), sorted_ids, block_experts, num_sorted,
                top_k, False, {**d, **d["down"]}), args.iters)
        total, chosen, up_ms, down_ms = best
        table[str(m)] = chosen
        print(f"{m:>6} {chosen['BLOCK_SIZE_M']:>4} {up_ms * 1e3:>8.1f} {down_ms * 1e3:>8.1f} "
              f"{floor_s * 1e6:>8.1f} {floor_s * 1e3 / total:>8.0%} {default_t * 1e3:>10.1f}",
              flush=True)
    name = config_file_name(num_experts, inter, hidden, torch.cuda.get_device_name(), dtype)
    os.makedirs(args.out, exist_ok=True)
    text = json.dumps(table, indent=1)
    with open(os.path.join(args.out, name), "w") as f:
        f.write(text + "\n")
    print(f"wrote {os.path.join(args.out, name)}:\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
