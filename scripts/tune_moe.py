"""Tune the fused MoE kernels' launch configurations on this GPU and write the JSON table
that ``bastion.ops.moe_configs`` reads (in the manner of vLLM's ``benchmark_moe.py --tune``).

For each token count two routings are drawn: uniform (random router logits, top-k: a trained,
load-balanced router) and hot (every token's k experts among the same 2k: a skewed router, or
dummy weights). Every candidate ``BLOCK_SIZE_M`` is tried with a grid of tiles for each product
(gate/up with SiLU, and down), each timed alone with CUDA events (median over ``--iters`` ms).
Of the ``BLOCK_SIZE_M``s (shared: the align step pads to it) within 5 % of the uniform
routing's best, the one fastest under the hot routing is kept, with the tiles the uniform
routing preferred under it.
Each line gives both routings' times beside their floors: the bytes of the experts the tokens
reach (plus activations) over the copy bandwidth measured in the same run.

    python scripts/tune_moe.py --model configs/qwen3-30b-a3b --out ops/moe_configs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN_COUNTS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192,
                16384]
TILE_KEYS = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def candidates(block_m: int) -> list[dict[str, int]]:
    if block_m == 16:
        grid = itertools.product([16, 32, 64, 128], [64, 128], [1], [4], [3, 4, 5])
    elif block_m == 128:
        grid = itertools.product([64, 128], [64], [8], [4, 8], [3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128], [8], [4, 8], [3, 4])
    return [dict(zip(TILE_KEYS, c)) for c in grid]


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds; infinity for a tile that does not fit the GPU (shared memory)."""
    import triton.testing
    from triton.runtime.errors import OutOfResources

    try:
        return triton.testing.do_bench(fn, warmup=5, rep=iters, return_mode="median")
    except OutOfResources:
        return float("inf")


class RoutingCase:
    """One token count's routing with its inputs and scratch buffers."""

    def __init__(self, m: int, num_router: int, w13: torch.Tensor, w2: torch.Tensor,
                 top_k: int, hot: bool, bw: float) -> None:
        from bastion.ops.triton.moe_routing import moe_routing_triton

        num_experts, two_n, hidden = w13.shape
        dev, dtype = w13.device, w13.dtype
        logits = torch.randn(m, num_router, device=dev)
        if hot:
            logits[:, : 2 * top_k] += 8.0
        weights, ids = moe_routing_triton(logits, top_k, True)
        self.ids = ids % num_experts  # a rank's share, as if local
        self.weights = weights.reshape(-1)
        self.w13, self.w2, self.top_k, self.num_experts = w13, w2, top_k, num_experts
        self.x = torch.randn(m, hidden, device=dev, dtype=dtype)
        self.act = torch.empty(m * top_k, two_n // 2, device=dev, dtype=dtype)
        self.out = torch.empty(m * top_k, hidden, device=dev, dtype=dtype)
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        touched = int(torch.unique(self.ids).numel())
        self.floor_s = (touched * expert_bytes + 2 * m * hidden * 2 + m * top_k * two_n * 2) / bw

    def best(self, block_m: int, iters: int) -> tuple[float, dict, dict]:
        """(seconds, up tile, down tile): the fastest tile of each product."""
        from bastion.ops.triton.moe_align import moe_align_triton

        aligned = moe_align_triton(self.ids, block_m, self.num_experts)
        tiles = candidates(block_m)
        up = min(tiles, key=lambda t: time_ms(self.product(aligned, block_m, t, True), iters))
        down = min(tiles, key=lambda t: time_ms(self.product(aligned, block_m, t, False), iters))
        return self.time({"BLOCK_SIZE_M": block_m, "up": up, "down": down}, iters), up, down

    def product(self, aligned: tuple, block_m: int, tile: dict, gated: bool
                ) -> Callable[[], object]:
        from bastion.ops.triton.fused_moe import fused_moe_gemm_triton

        config = {"BLOCK_SIZE_M": block_m, **tile}
        if gated:
            return lambda: fused_moe_gemm_triton(self.x, self.w13, self.act, None, *aligned,
                                                 self.top_k, True, config)
        return lambda: fused_moe_gemm_triton(self.act, self.w2, self.out, self.weights,
                                             *aligned, self.top_k, False, config)

    def time(self, config: dict, iters: int) -> float:
        from bastion.ops.triton.moe_align import moe_align_triton

        block_m = config["BLOCK_SIZE_M"]
        aligned = moe_align_triton(self.ids, block_m, self.num_experts)
        return 1e-3 * (time_ms(self.product(aligned, block_m, config["up"], True), iters)
                       + time_ms(self.product(aligned, block_m, config["down"], False), iters))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "configs", "qwen3-30b-a3b"))
    p.add_argument("--tp", type=int, default=1, help="intermediate size split over TP ranks")
    p.add_argument("--ep", type=int, default=1, help="experts split over EP ranks")
    p.add_argument("--tokens", type=int, nargs="*", default=TOKEN_COUNTS)
    p.add_argument("--iters", type=int, default=10, help="milliseconds of repeats per candidate")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    from transformers import AutoConfig

    from bastion.ops.moe_configs import config_file_name, default_moe_config

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench_latency import copy_bandwidth

    cfg = AutoConfig.from_pretrained(args.model)
    num_experts = cfg.num_experts // args.ep
    inter, hidden, top_k = (cfg.moe_intermediate_size // args.tp, cfg.hidden_size,
                            cfg.num_experts_per_tok)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth()
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=dtype) * 0.02
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; E={num_experts} N={inter} K={hidden} "
          f"top-{top_k}; {(w13[0].numel() + w2[0].numel()) * 2 / 1e6:.1f} MB per expert")
    print(f"{'tokens':>6} {'BM':>4} | {'uniform us':>10} {'best':>6} {'floor':>6} {'of floor':>8} "
          f"| {'hot us':>7} {'best':>6} {'floor':>6} | {'default uniform/hot us':>22}")
    table: dict[str, dict] = {}
    for m in args.tokens:
        uniform, hot = (RoutingCase(m, cfg.num_experts, w13, w2, top_k, h, bw)
                        for h in (False, True))
        block_ms = [b for b in (16, 32, 64, 128)
                    if b == 16 or m * top_k / num_experts >= b / 8]  # else all padding
        results = {b: (uniform.best(b, args.iters), hot.best(b, args.iters)) for b in block_ms}
        best_u = min(r[0][0] for r in results.values())
        best_h = min(r[1][0] for r in results.values())
        # NOTE: uniform routing (what a trained router gives) decides; among the BLOCK_SIZE_Ms
        # within 5 % of its best, the one best for the hot routing is taken (there the
        # uniform choice can be 2.5x off: 16-row blocks re-read a crowded expert's weights).
        near = [b for b in results if results[b][0][0] <= 1.05 * best_u]
        block_m = min(near, key=lambda b: results[b][1][0])
        (t_u, up, down), _ = results[block_m]
        chosen = {"BLOCK_SIZE_M": block_m, "up": up, "down": down}
        table[str(m)] = chosen
        default = default_moe_config(m, top_k, num_experts)
        print(f"{m:>6} {block_m:>4} | {t_u * 1e6:>10.1f} {best_u * 1e6:>6.1f} "
              f"{uniform.floor_s * 1e6:>6.1f} {uniform.floor_s / t_u:>8.0%} | "
              f"{hot.time(chosen, args.iters) * 1e6:>7.1f} {best_h * 1e6:>6.1f} "
              f"{hot.floor_s * 1e6:>6.1f} | {uniform.time(default, args.iters) * 1e6:>10.1f}/"
              f"{hot.time(default, args.iters) * 1e6:<10.1f}", flush=True)
    name = config_file_name(num_experts, inter, hidden, torch.cuda.get_device_name(), dtype)
    os.makedirs(args.out, exist_ok=True)
    text = json.dumps(table, indent=1)
    with open(os.path.join(args.out, name), "w") as f:
        f.write(text + "\n")
    print(f"wrote {os.path.join(args.out, name)}:\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
