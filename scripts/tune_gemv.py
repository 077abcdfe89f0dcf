"""The decode-rows matmul on this GPU: cuBLAS against the Triton matrix-vector kernel
(``ops/triton/gemv.py``) for the linear layers of the models bastion benchmarks, each beside its
floor (the weight's bytes over the copy bandwidth measured in the same run).

Every candidate tile is timed replayed from a CUDA graph (median), as a decode step runs it.
The table printed last gives, per shape and row count, cuBLAS's time, the best tile's, and what
``bastion.ops.linear.gemv_config`` picks today, so its rule can be checked against the sweep.

    python scripts/tune_gemv.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, N, K): Qwen3-30B-A3B, Llama-3.1-8B, Qwen3-0.6B.
SHAPES = [
    ("30b qkv", 5120, 2048), ("30b o", 2048, 4096), ("30b router", 128, 2048),
    ("8b qkv", 6144, 4096), ("8b o", 4096, 4096), ("8b gate_up", 28672, 4096),
    ("8b down", 4096, 14336), ("0.6b qkv", 4096, 1024), ("0.6b o", 1024, 2048),
    ("0.6b gate_up", 6144, 1024), ("0.6b down", 1024, 3072),
]


def time_us(fn) -> float:
    import triton.testing
    from triton.runtime.errors import OutOfResources

    try:
        fn()
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")
    except OutOfResources:
        return float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4])
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench_latency import copy_bandwidth

    from bastion.ops.linear import gemv_config
    from bastion.ops.triton.gemv import gemv_triton

    bw = copy_bandwidth()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    tiles = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
             for bn, bk, w in itertools.product([4, 8, 16], [256, 512, 1024], [4, 8])]
    rows_out = []
    for (name, n, k), m in itertools.product(SHAPES, args.rows):
        w = torch.randn(n, k, device=dev, dtype=dtype)
        x = torch.randn(m, k, device=dev, dtype=dtype)
        floor = (n * k + m * (n + k)) * 2 / bw * 1e6
        cublas = time_us(lambda: torch.nn.functional.linear(x, w))
        timed = [(time_us(lambda t=t: gemv_triton(x, w, None, t)), t) for t in tiles
                 if m * t["BLOCK_N"] * t["BLOCK_K"] <= 8192 * t["num_warps"]]
        best_us, best = min(timed, key=lambda r: r[0])
        pick = gemv_config(m, n, k)
        pick_us = time_us(lambda: gemv_triton(x, w, None, pick)) if pick else float("nan")
        rows_out.append((name, m, floor, cublas, best_us, best, pick, pick_us))
        print(f"{name:>13} M={m}: floor {floor:6.1f} us, cuBLAS {cublas:6.1f}, best gemv "
              f"{best_us:6.1f} {best}, picked {pick_us:6.1f} {pick}", flush=True)
    print(f"\n{'shape':>13} {'M':>2} {'floor us':>8} {'cuBLAS':>7} {'of floor':>8} "
          f"{'gemv best':>9} {'of floor':>8} {'picked':>7}  best tile")
    for name, m, floor, cublas, best_us, best, pick, pick_us in rows_out:
        print(f"{name:>13} {m:>2} {floor:>8.1f} {cublas:>7.1f} {floor / cublas:>8.0%} "
              f"{best_us:>9.1f} {floor / best_us:>8.0%} {pick_us:>7.1f}  "
              f"{best['BLOCK_N']},{best['BLOCK_K']},{best['num_warps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
