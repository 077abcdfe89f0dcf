"""Does the experts' weight layout limit the batch-1 MoE kernels? (issue #18)

The decode-time expert kernels (``ops/triton/fused_moe_gemv.py``) read, in each K step of a
program, ``BLOCK_N`` rows x ``BLOCK_K`` columns: 256-byte pieces of rows 4 KB apart (and, for
gate and up, two such groups 3 MB apart). This compares them, alone on the GPU, with the same
products over a tiled copy of the weights in which each step's tile is one contiguous run
(``[E, N / BLOCK_N, K / BLOCK_K, (2,) BLOCK_N, BLOCK_K]``), and with a plain stream of the
same bytes in the same number of programs. Every launch of a replayed graph routes one token
to another 8 of the 128 experts, so the weights come from memory, not L2. Printed beside the
floor (bytes over the copy bandwidth measured in the same run), with what torch's own
reduction reaches reading the same bytes (the read-only rate beside the copy's). Alone, the
down kernel's tiles read as stored stream at half the rate of tiled ones; inside the model its
L2 prefetch during the up kernel hides that (session 27 in docs/BENCHMARKS.md).

    python scripts/bench_moe_layout.py
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import torch
import triton
import triton.language as tl
from bench_latency import copy_bandwidth


@triton.jit
def _up_tiled_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, N, K, stride_we, stride_act,
                     TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    tile = 2 * BLOCK_N * BLOCK_K
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    gate_ptrs = (w_ptr + expert * stride_we + tl.program_id(1).to(tl.int64) * (K // BLOCK_K)
                 * tile + offs)
    up_ptrs = gate_ptrs + BLOCK_N * BLOCK_K
    x_ptrs = x_ptr + token * K + tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs).to(tl.float32)
        acc_gate += tl.load(gate_ptrs).to(tl.float32) * x[None, :]
        acc_up += tl.load(up_ptrs).to(tl.float32) * x[None, :]
        x_ptrs += BLOCK_K
        gate_ptrs += tile
        up_ptrs += tile
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + pair.to(tl.int64) * stride_act + offs_n,
             (gate / (1.0 + tl.exp(-gate)) * up).to(act_ptr.dtype.element_ty))


@triton.jit
def _down_tiled_kernel(act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, N, K, stride_act,
                       stride_we, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, TOP_K)
    pair = token * TOP_K + offs_j
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    weight = tl.load(weights_ptr + pair).to(tl.float32)
    tile = BLOCK_N * BLOCK_K
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = (w_ptr + expert[:, None, None] * stride_we
              + tl.program_id(1).to(tl.int64) * (K // BLOCK_K) * tile + offs[None, :, :])
    a_ptrs = act_ptr + pair[:, None] * stride_act + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((TOP_K, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs).to(tl.float32) * weight[:, None]
        acc += tl.load(w_ptrs).to(tl.float32) * a[:, None, :]
        a_ptrs += BLOCK_K
        w_ptrs += tile
    out = tl.sum(tl.sum(acc, axis=2), axis=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token * N + offs_n, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _stream_kernel(src_ptr, out_ptr, per_program, STEP: tl.constexpr):
    """Each program sums its own contiguous ``per_program`` elements, ``STEP`` at a time."""
    ptrs = src_ptr + tl.program_id(0).to(tl.int64) * per_program + tl.arange(0, STEP)
    acc = tl.zeros((STEP,), dtype=tl.float32)
    for _ in range(0, per_program, STEP):
        acc += tl.load(ptrs).to(tl.float32)
        ptrs += STEP
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def tile_up(w13: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[E, 2I, H] -> [E, I/bn, H/bk, 2, bn, bk]: each K step's gate and up tiles adjacent."""
    e, two_i, h = w13.shape
    i = two_i // 2
    t = w13.view(e, 2, i // bn, bn, h // bk, bk).permute(0, 2, 4, 1, 3, 5)
    return t.contiguous()


def tile_down(w2: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[E, H, I] -> [E, H/bn, I/bk, bn, bk]."""
    e, h, i = w2.shape
    return w2.view(e, h // bn, bn, i // bk, bk).permute(0, 1, 3, 2, 4).contiguous()


def time_graph(launches, replays: int) -> float:
    """Microseconds per launch: ``launches`` (callables) captured in one graph, replayed."""
    for f in launches:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in launches:
            f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(launches)))
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", type=int, default=16, help="expert sets, one per launch")
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args(argv)
    from bastion.ops.triton.fused_moe_gemv import _moe_gemv_down_kernel, _moe_gemv_up_kernel

    dev = torch.device("cuda")
    e, h, inter, top_k = 128, 2048, 768, 8
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=gen) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=dev, generator=gen) / inter ** 0.5).bfloat16()
    x = torch.randn(1, h, device=dev, generator=gen).bfloat16()
    ids = [torch.randperm(e, device=dev, generator=gen)[:top_k].view(1, top_k).int()
           for _ in range(args.sets)]
    weights = torch.full((1, top_k), 1.0 / top_k, device=dev)
    act = torch.empty(top_k, inter, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, h, device=dev, dtype=torch.bfloat16)
    bw = copy_bandwidth()
    up_bytes = top_k * 2 * inter * h * 2
    down_bytes = top_k * h * inter * 2
    rows = []

    def up_std(bn, bk, warps):
        def run(i):
            _moe_gemv_up_kernel[(top_k, inter // bn)](
                x, w13, act, ids[i], 0, e, inter, h, x.stride(0), w13.stride(0), w13.stride(1),
                act.stride(0), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=0,
                num_warps=warps, num_stages=2)
        return run

    def up_tiled(bn, bk, warps, wt):
        def run(i):
            _up_tiled_kernel[(top_k, inter // bn)](
                x, wt, act, ids[i], inter, h, wt.stride(0), act.stride(0), TOP_K=top_k,
                BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=2)
        return run

    def down_std(bn, bk, warps):
        def run(i):
            _moe_gemv_down_kernel[(1, h // bn)](
                act, w2, out, ids[i], weights, 0, e, h, inter, act.stride(0), w2.stride(0),
                w2.stride(1), out.stride(0), TOP_K=top_k, BLOCK_TOPK=top_k, BLOCK_N=bn,
                BLOCK_K=bk, USE_PDL=0, PREFETCH=False, W_BYTES=2, LINES=32 * warps,
                num_warps=warps, num_stages=2)
        return run

    def down_tiled(bn, bk, warps, wt):
        def run(i):
            _down_tiled_kernel[(1, h // bn)](
                act, wt, out, ids[i], weights, h, inter, act.stride(0), wt.stride(0),
                TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=2)
        return run

    def check(a, fn, what):
        """``fn`` on expert set 0 against the standard kernel's result just left in ``a``."""
        ref = a.clone()
        fn(0)
        torch.cuda.synchronize()
        if not torch.allclose(ref.float(), a.float(), rtol=2e-2, atol=2e-2):
            raise SystemExit(f"{what}: the tiled kernel differs from the standard one")

    def measure(name, fn, num_bytes):
        us = time_graph([lambda i=i: fn(i) for i in range(args.sets)], args.replays)
        rows.append((name, us, num_bytes / bw * 1e6, num_bytes / (us * 1e-6) / 1e12))

    parts = (("up", up_std, up_tiled, tile_up, w13, act, up_bytes,
              ((8, 128, 8), (4, 256, 8), (8, 256, 8), (16, 128, 8))),
             ("down", down_std, down_tiled, tile_down, w2, out, down_bytes,
              ((8, 256, 4), (4, 256, 4), (8, 128, 4))))
    for part, std, tiled, tile, w, result, num_bytes, tiles in parts:
        for bn, bk, warps in tiles:
            wt = tile(w, bn, bk)
            std(bn, bk, warps)(0)
            check(result, tiled(bn, bk, warps, wt), f"{part} {bn}x{bk}")
            measure(f"{part} {bn}x{bk} {warps}w, rows as stored", std(bn, bk, warps), num_bytes)
            measure(f"{part} {bn}x{bk} {warps}w, tiled", tiled(bn, bk, warps, wt), num_bytes)
            del wt
    # The same bytes as one contiguous stream per program, in as many programs.
    src = torch.empty(args.sets * up_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    sums = torch.empty(top_k * inter // 8, device=dev)
    per = up_bytes // 2 // sums.numel()
    # Steps of 1-2k elements hold what the up kernel holds in flight a program (2-4 KB);
    # 4-8k, two and four times that.
    for step in (1024, 2048, 4096, 8192):
        measure(f"stream, {sums.numel()} programs of {per * 2 // 1024} KB, {step * 2} B steps",
                lambda i, s=step: _stream_kernel[(sums.numel(),)](
                    src[i * (up_bytes // 2):], sums, per, STEP=s, num_warps=8), up_bytes)
    # What reading alone reaches: torch's own reduction over the same bytes (rows of 1024).
    n = up_bytes // 2
    row_sums = torch.empty(n // 1024, device=dev)
    measure("torch row sums of the same bytes (a tuned read-only kernel)",
            lambda i: torch.sum(src[i * n:(i + 1) * n].view(-1, 1024), dim=1,
                                dtype=torch.float32, out=row_sums), up_bytes)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; one token, 8 of 128 experts a launch, "
          f"{args.sets} expert sets in a graph")
    print("kernel | us a launch | floor us | TB/s")
    for name, us, floor, tbs in rows:
        print(f"{name} | {us:.2f} | {floor:.2f} | {tbs:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
