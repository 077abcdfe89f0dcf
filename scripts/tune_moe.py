"""Tune the fused MoE kernels' launch configurations on this GPU and write the JSON table
that ``bastion.ops.moe_configs`` reads (in the manner of vLLM's ``benchmark_moe.py --tune``).

For each token count two routings are drawn: uniform (random router logits, top-k: a trained,
load-balanced router) and hot (every token's k experts among the same 2k: a skewed router, or
dummy weights). Every candidate ``BLOCK_SIZE_M`` is tried with a grid of tiles for each product
(gate/up with SiLU, and down), each timed alone replayed from a CUDA graph (median over
``--iters`` ms), cycling over disjoint expert sets so the weights come from HBM as in the
model, not from L2. Of the ``BLOCK_SIZE_M``s (shared: the align step pads to it) within 5 % of the
uniform routing's best, the one fastest under the hot routing is kept, with the tiles the
uniform routing preferred under it. Up to one pair per expert the matrix-vector kernels
(``ops/triton/fused_moe_gemv.py``) are tuned too, and replace the grouped GEMM where the whole
layer (align and sum included) is faster under uniform routing and at most 25 % slower under
the hot one.
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
    elif block_m == 128:  # prefill chunks: wider and deeper tiles too (``feasible`` drops
        # those that would spill or not fit shared memory before they are compiled)
        grid = itertools.product([64, 128, 256], [64, 128], [8], [4, 8], [2, 3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128], [8], [4, 8], [3, 4])
    return [dict(zip(TILE_KEYS, c)) for c in grid]


# An H100/H200 SM's shared memory for one program, and the float32 accumulator registers a
# thread can hold before ptxas spills (Triton 3.6, sm_90: 128 fit beside the rest; 256 spill).
SHARED_BYTES = 227 * 1024
MAX_ACC_PER_THREAD = 128


def feasible(tile: dict[str, int], block_m: int, gated: bool) -> bool:
    """Whether a grouped-GEMM tile can run unspilled on an H100/H200: its pipeline's buffers
    (``num_stages`` copies of the A tile and one or two B tiles) fit shared memory, and its
    accumulators (two with ``gated``) fit a thread's registers. The others only cost the tune
    their compile (a 16,384-token tune compiled 72 kernels, 32 of them spilling or too big;
    docs/BENCHMARKS.md, session 31)."""
    b_tiles = 2 if gated else 1
    stage = (block_m + b_tiles * tile["BLOCK_SIZE_N"]) * tile["BLOCK_SIZE_K"] * 2
    acc = b_tiles * block_m * tile["BLOCK_SIZE_N"] // (32 * tile["num_warps"])
    return tile["num_stages"] * stage <= SHARED_BYTES and acc <= MAX_ACC_PER_THREAD


def gemv_candidates(up: bool) -> list[dict[str, int]]:
    # The down kernel's tile holds all k experts: [k, BLOCK_N, BLOCK_K].
    grid = (itertools.product([4, 8, 16], [128, 256, 512], [4, 8], [1, 2]) if up else
            itertools.product([2, 4, 8, 16], [64, 128, 256], [4, 8], [1, 2]))
    return [dict(zip(("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages"), c))
            for c in grid]


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of device time, replayed from a CUDA graph as the engine runs it (a
    plain loop of launches would time Python's launch overhead for the small token counts);
    infinity for a tile that does not fit the GPU (shared memory)."""
    import triton.testing
    from triton.runtime.errors import OutOfResources

    try:
        fn()  # compile outside the capture
        return triton.testing.do_bench_cudagraph(fn, rep=iters, return_mode="median")
    except OutOfResources:
        return float("inf")


class RoutingCase:
    """One token count's routing with its inputs and scratch buffers.

    NOTE: in the model every layer reads other experts' weights from HBM, while a kernel
    replayed on the same experts finds them in the 50 MB L2 (one token's eight down
    projections are 25 MB): its time, and the tile it picks, would be the L2's. So each timed
    call runs ``ROTATIONS`` routings of the same shape, the expert ids shifted by ``E /
    ROTATIONS`` each, over as many disjoint expert sets, and reports the time per routing."""

    ROTATIONS = 8

    def __init__(self, m: int, num_router: int, w13: torch.Tensor, w2: torch.Tensor,
                 top_k: int, hot: bool, bw: float) -> None:
        from bastion.ops.triton.moe_routing import moe_routing_triton

        num_experts, two_n, hidden = w13.shape
        dev, dtype = w13.device, w13.dtype
        logits = torch.randn(m, num_router, device=dev)
        if hot:
            logits[:, : 2 * top_k] += 8.0
        weights, ids = moe_routing_triton(logits, top_k, True)
        shift = max(1, num_experts // self.ROTATIONS)
        # A rank's share, as if local; then the same routing over the other expert sets.
        self.id_sets = [(ids + r * shift) % num_experts for r in range(self.ROTATIONS)]
        self.ids = self.id_sets[0]
        self.weights = weights.reshape(-1)
        self.w13, self.w2, self.top_k, self.num_experts = w13, w2, top_k, num_experts
        self.x = torch.randn(m, hidden, device=dev, dtype=dtype)
        self.act = torch.empty(m * top_k, two_n // 2, device=dev, dtype=dtype)
        self.out = torch.empty(m * top_k, hidden, device=dev, dtype=dtype)
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        touched = int(torch.unique(self.ids).numel())
        self.floor_s = (touched * expert_bytes + 2 * m * hidden * 2 + m * top_k * two_n * 2) / bw

    def per_routing_ms(self, make: Callable[[torch.Tensor], Callable[[], object]],
                       iters: int) -> float:
        """Milliseconds of one call of ``make(ids)()``, over the rotated routings."""
        calls = [make(ids) for ids in self.id_sets]
        return time_ms(lambda: [call() for call in calls], iters) / len(calls)

    def best(self, block_m: int, iters: int) -> tuple[float, dict, dict]:
        """(seconds, up tile, down tile): the fastest tile of each product."""
        tiles = candidates(block_m)
        up = min((t for t in tiles if feasible(t, block_m, True)),
                 key=lambda t: self.product_ms(block_m, t, True, iters))
        down = min((t for t in tiles if feasible(t, block_m, False)),
                   key=lambda t: self.product_ms(block_m, t, False, iters))
        return self.time({"BLOCK_SIZE_M": block_m, "up": up, "down": down}, iters), up, down

    def product_ms(self, block_m: int, tile: dict, gated: bool, iters: int) -> float:
        from bastion.ops.triton.fused_moe import fused_moe_gemm_triton
        from bastion.ops.triton.moe_align import moe_align_triton

        config = {"BLOCK_SIZE_M": block_m, **tile}

        def make(ids: torch.Tensor) -> Callable[[], object]:
            aligned = moe_align_triton(ids, block_m, self.num_experts)
            if gated:
                return lambda: fused_moe_gemm_triton(self.x, self.w13, self.act, None, *aligned,
                                                     self.top_k, True, config)
            return lambda: fused_moe_gemm_triton(self.act, self.w2, self.out, self.weights,
                                                 *aligned, self.top_k, False, config)

        return self.per_routing_ms(make, iters)

    def best_gemv(self, iters: int) -> tuple[float, dict]:
        """(seconds, config) of the matrix-vector kernels, each product's tile tuned alone."""
        up = min(gemv_candidates(True), key=lambda t: self.gemv_ms(t, True, iters))
        down = min(gemv_candidates(False), key=lambda t: self.gemv_ms(t, False, iters))
        config = {"gemv": {"up": up, "down": down}}
        return self.time(config, iters), config

    def whole(self, config: dict, iters: int) -> float:
        """Seconds of the whole expert computation (align and sum included)."""
        from bastion.ops.triton.fused_moe import fused_moe_triton

        weights = self.weights.view(self.ids.shape)
        return 1e-3 * self.per_routing_ms(
            lambda ids: lambda: fused_moe_triton(self.x, self.w13, self.w2, weights, ids,
                                                 config=config), iters)

    def gemv_ms(self, tile: dict, up: bool, iters: int) -> float:
        from bastion.ops.triton import fused_moe_gemv as g

        weights = self.weights.view(self.ids.shape)
        num_local, two_n, hidden = self.w13.shape
        inter, t = two_n // 2, self.x.shape[0]
        bn, bk = tile["BLOCK_SIZE_N"], tile["BLOCK_SIZE_K"]
        # One kernel timed alone: no kernel before it to overlap (USE_PDL off).
        launch = {"TOP_K": self.top_k, "BLOCK_N": bn, "BLOCK_K": bk, "USE_PDL": False,
                  "num_warps": tile["num_warps"], "num_stages": tile["num_stages"]}
        out = self.out[:t]
        block_topk = 1 << (self.top_k - 1).bit_length()

        def make(ids: torch.Tensor) -> Callable[[], object]:
            if up:
                grid = (t * self.top_k, -(-inter // bn))
                return lambda: g._moe_gemv_up_kernel[grid](
                    self.x, self.w13, self.act, ids, 0, num_local, inter, hidden,
                    self.x.stride(0), self.w13.stride(0), self.w13.stride(1),
                    self.act.stride(0), **launch)
            grid = (t, -(-hidden // bn))
            return lambda: g._moe_gemv_down_kernel[grid](
                self.act, self.w2, out, ids, weights, 0, num_local, hidden, inter,
                self.act.stride(0), self.w2.stride(0), self.w2.stride(1), out.stride(0),
                BLOCK_TOPK=block_topk, **launch)

        return self.per_routing_ms(make, iters)

    def time(self, config: dict, iters: int) -> float:
        if "gemv" in config:
            tiles = config["gemv"]
            return 1e-3 * (self.gemv_ms(tiles["up"], True, iters)
                           + self.gemv_ms(tiles["down"], False, iters))
        block_m = config["BLOCK_SIZE_M"]
        return 1e-3 * (self.product_ms(block_m, config["up"], True, iters)
                       + self.product_ms(block_m, config["down"], False, iters))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "configs", "qwen3-30b-a3b"))
    p.add_argument("--tp", type=int, default=1, help="intermediate size split over TP ranks")
    p.add_argument("--ep", type=int, default=1, help="experts split over EP ranks")
    p.add_argument("--tokens", type=int, nargs="*", default=TOKEN_COUNTS)
    p.add_argument("--block-ms", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="the BLOCK_SIZE_Ms to try (e.g. 128 alone for prefill chunks)")
    p.add_argument("--iters", type=int, default=10, help="milliseconds of repeats per candidate")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--update", action="store_true",
                   help="start from the repository's table and replace only --tokens' entries")
    p.add_argument("--install", action="store_true",
                   help="also write the table into ops/moe_configs (where the engine reads it)")
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
          f"| {'hot us':>7} {'best':>6} {'floor':>6} | {'default uniform/hot us':>22}"
          + (" | table's entry uniform/hot us" if args.update else ""))
    name = config_file_name(num_experts, inter, hidden, torch.cuda.get_device_name(), dtype)
    repo_table = os.path.join(REPO, "ops", "moe_configs", name)
    table: dict[str, dict] = {}
    if args.update and os.path.isfile(repo_table):
        with open(repo_table) as f:
            table = json.load(f)
    replaced = dict(table)  # with --update: each entry timed beside the one that replaces it
    for m in args.tokens:
        uniform, hot = (RoutingCase(m, cfg.num_experts, w13, w2, top_k, h, bw)
                        for h in (False, True))
        # The smallest block always; a larger one only where it is not all padding.
        block_ms = [b for b in args.block_ms
                    if b == min(args.block_ms) or m * top_k / num_experts >= b / 8]
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
        if m * top_k <= num_experts:
            # NOTE: the matrix-vector kernels read an expert once per pair that chose it, so
            # under the hot routing they can lose by the pairs per expert; they are taken
            # when faster under uniform routing and at most 25 % slower under the hot one.
            # The whole layer decides (the grouped path also runs the align and the sum), as
            # replayed from a graph.
            t_gemv, gemv = uniform.best_gemv(args.iters)
            g_u, g_h = (case.whole(gemv, args.iters) for case in (uniform, hot))
            m_u, m_h = (case.whole(chosen, args.iters) for case in (uniform, hot))
            print(f"{m:>6} whole layer us, uniform / hot: gemv {g_u * 1e6:.1f} / "
                  f"{g_h * 1e6:.1f}, grouped {m_u * 1e6:.1f} / {m_h * 1e6:.1f}; "
                  f"gemv products {t_gemv * 1e6:.1f}: {gemv}", flush=True)
            if g_u < m_u and g_h <= 1.25 * m_h:
                chosen, t_u, best_u, block_m = gemv, t_gemv, min(best_u, t_gemv), 0
        table[str(m)] = chosen
        default = default_moe_config(m, top_k, num_experts)
        print(f"{m:>6} {block_m:>4} | {t_u * 1e6:>10.1f} {best_u * 1e6:>6.1f} "
              f"{uniform.floor_s * 1e6:>6.1f} {uniform.floor_s / t_u:>8.0%} | "
              f"{hot.time(chosen, args.iters) * 1e6:>7.1f} {best_h * 1e6:>6.1f} "
              f"{hot.floor_s * 1e6:>6.1f} | {uniform.time(default, args.iters) * 1e6:>10.1f}/"
              f"{hot.time(default, args.iters) * 1e6:<10.1f}"
              + (f" | {uniform.time(replaced[str(m)], args.iters) * 1e6:.1f}/"
                 f"{hot.time(replaced[str(m)], args.iters) * 1e6:.1f}"
                 if str(m) in replaced else ""), flush=True)
    table = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
    os.makedirs(args.out, exist_ok=True)
    text = json.dumps(table, indent=1)
    for path in [os.path.join(args.out, name)] + ([repo_table] if args.install else []):
        with open(path, "w") as f:
            f.write(text + "\n")
        print(f"wrote {path}")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
