"""The LoRA kernels alone on the GPU: microseconds per launch of the shrink and the expand for
each linear layer of a decoder layer, at several batch sizes, beside the bytes floor (the
adapter bytes the launch must read, over the copy bandwidth measured in the same run) and the
base layer's own matmul.

    python scripts/bench_lora_kernels.py                  # the configs ops/lora.py picks
    python scripts/bench_lora_kernels.py --sweep          # and the fastest of a grid of tiles

Shapes: ``--model``'s (Llama-3.1-8B by default): qkv (3 slices), o, gate_up (2 slices), down,
rank ``--rank`` on every module, ``--num-slots`` device slots with the rows spread evenly over
``--adapters`` of them. Every time is a CUDA graph of ``--layers`` launches, each with its own
layer's weights (as a decode step replays them; one layer's adapters would sit in L2), replayed
``--iters`` times: graph launch overhead included, host overhead not. "step" is the whole
decode step's linear layers (every layer's 4 base matmuls, each followed by its shrink and
expand) against the matmuls alone, with and without programmatic dependent launch.
``--sweep`` times each candidate tile the same way and prints the best three.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layer_shapes(model: str, rank: int) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """{layer: (input columns K, slice ends of the output, stacked rank)}."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "qkv": (hidden, (q, q + kv, q + 2 * kv), 3 * rank),
        "o": (q, (hidden,), rank),
        "gate_up": (hidden, (inter, 2 * inter), 2 * rank),
        "down": (inter, (hidden,), rank),
    }


def graph_us(fn: Callable[[], None], launches: int, iters: int) -> float:
    """Microseconds per launch of ``fn`` (``launches`` kernels) replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters / launches


def empty_launch_us(layers: int, iters: int) -> float:
    """A Triton kernel that stores one value, in the same graphs: the floor of a launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def _one(ptr):
        tl.store(ptr + tl.program_id(0), 1.0)

    buf = torch.zeros(128, device="cuda")
    return graph_us(lambda: [_one[(128,)](buf) for _ in range(layers)], layers, iters)


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy, reads and writes counted."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1000)


class Case:
    """One batch of ``num_tokens`` rows over ``adapters`` slots: every layer's weights and
    buffers, and the index, as the engine holds them."""

    def __init__(self, args: argparse.Namespace, num_tokens: int, adapters: int) -> None:
        import numpy as np

        from bastion.ops.lora import LoRAIndex, build_lora_index, max_row_tiles

        self.num_tokens, self.adapters = num_tokens, adapters
        self.shapes = layer_shapes(args.model, args.rank)
        gen = torch.Generator(device="cuda").manual_seed(0)
        s, t, dev = args.num_slots, num_tokens, "cuda"
        self.a, self.b, self.x, self.y, self.w = {}, {}, {}, {}, {}
        for name, (k, ends, r) in self.shapes.items():
            n = ends[-1]
            self.a[name] = [
                torch.randn(s, r, k, device=dev, generator=gen, dtype=torch.bfloat16) * k**-0.5
                for _ in range(args.layers)
            ]
            self.b[name] = [
                torch.randn(s, n, r, device=dev, generator=gen, dtype=torch.bfloat16) * 0.01
                for _ in range(args.layers)
            ]
            self.x[name] = torch.randn(t, k, device=dev, generator=gen, dtype=torch.bfloat16)
            self.y[name] = torch.zeros(t, n, device=dev, dtype=torch.bfloat16)
            # A few copies of the base weight: enough that it is not in L2 launch after launch.
            self.w[name] = [
                torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(3)
            ]
        max_r = max(r for _, _, r in self.shapes.values())
        self.scratch = torch.zeros(t * max_r, dtype=torch.float32, device=dev)
        self.counts = torch.zeros(s, max_row_tiles(t), dtype=torch.int32, device=dev)
        slots = np.arange(t, dtype=np.int32) % adapters
        row_ids, starts = build_lora_index(slots, s)
        self.index = LoRAIndex(
            torch.from_numpy(slots).to(dev),
            torch.from_numpy(row_ids).to(dev),
            torch.from_numpy(starts).to(dev),
        )
        self.scales = torch.ones(s, dtype=torch.float32, device=dev)
        self.num_active = min(adapters, t)

    def h(self, name: str) -> torch.Tensor:
        r = self.shapes[name][2]
        return self.scratch[: self.num_tokens * r].view(self.num_tokens, r)

    def shrink(self, name: str, layer: int, config) -> None:
        from bastion.ops.triton.lora_shrink import lora_shrink_triton

        lora_shrink_triton(self.x[name], self.a[name][layer], self.index, self.h(name), config)

    def expand(self, name: str, layer: int, config) -> None:
        from bastion.ops.triton.lora_expand import lora_expand_triton

        lora_expand_triton(
            self.h(name),
            self.b[name][layer],
            self.index,
            self.scales,
            self.y[name],
            self.counts,
            self.shapes[name][1],
            config,
        )

    def configs(self, name: str):
        from bastion.ops.lora import expand_config, shrink_config

        k, ends, r = self.shapes[name]
        return (
            shrink_config(self.num_tokens, k, r),
            expand_config(self.num_tokens, ends[-1], r // len(ends)),
        )

    def floor_bytes(self, name: str) -> tuple[int, int]:
        """What the shrink and the expand must move: the active slots' A (every stacked rank)
        and B (the diagonal blocks), x, y read and written."""
        k, ends, r = self.shapes[name]
        n, t, act = ends[-1], self.num_tokens, self.num_active
        shrink = act * r * k * 2 + t * k * 2 + t * r * 4
        expand = act * n * (r // len(ends)) * 2 + 2 * t * n * 2 + t * r * 4
        return shrink, expand

    def time_shrink(self, name: str, config, layers: int, iters: int) -> float:
        return graph_us(
            lambda: [self.shrink(name, i, config) for i in range(layers)], layers, iters
        )

    def time_expand(self, name: str, config, layers: int, iters: int) -> float:
        return graph_us(
            lambda: [self.expand(name, i, config) for i in range(layers)], layers, iters
        )

    def time_base(self, name: str, layers: int, iters: int) -> float:
        w = self.w[name]
        return graph_us(
            lambda: [
                torch.nn.functional.linear(self.x[name], w[i % len(w)]) for i in range(layers)
            ],
            layers,
            iters,
        )

    def time_step(self, layers: int, iters: int, lora: bool, pdl: bool = True) -> float:
        """Microseconds of one decode step's linear layers: every layer's 4 base matmuls, each
        followed (``lora``) by its shrink and expand, in order, as the model runs them (with
        ``pdl``, the adapter kernels overlap the kernel before them)."""
        configs = {
            name: tuple(c._replace(pdl=pdl) for c in self.configs(name)) for name in self.shapes
        }

        def step() -> None:
            for i in range(layers):
                for name, (shrink, expand) in configs.items():
                    w = self.w[name][i % len(self.w[name])]
                    torch.mm(self.x[name], w.t(), out=self.y[name])
                    if lora:
                        self.shrink(name, i, shrink)
                        self.expand(name, i, expand)

        return graph_us(step, 1, iters)


def shrink_candidates(case: Case, name: str) -> list:
    """The policy's row tile with K steps of 64-256 columns, one to four steps a program."""
    from bastion.ops.lora import ShrinkConfig

    k = case.shapes[name][0]
    policy = case.configs(name)[0]
    out = [policy]
    for block_k, columns in ((64, 64), (128, 128), (128, 256), (256, 256), (128, 512), (256, 1024)):
        for num_warps in (2, 4):
            for num_stages in (1,) if columns == block_k else (1, 2):
                out.append(
                    ShrinkConfig(
                        policy.block_m,
                        policy.block_n,
                        block_k,
                        max(1, k // columns),
                        num_warps,
                        num_stages,
                    )
                )
    return out


def expand_candidates(case: Case, name: str) -> list:
    """The policy's row tile with 32-256 output columns a program."""
    from bastion.ops.lora import ExpandConfig

    policy = case.configs(name)[1]
    out = [policy]
    for block_n in (32, 64, 128, 256):
        for num_warps in (2, 4, 8):
            if num_warps == 8 and block_n < 128:
                continue
            out.append(ExpandConfig(policy.block_m, block_n, policy.block_k, num_warps, 1))
    return out


def sweep(case: Case, layers: int, iters: int) -> None:
    from triton.runtime.errors import OutOfResources

    for name in case.shapes:
        for kind, candidates, timer in (
            ("shrink", shrink_candidates(case, name), case.time_shrink),
            ("expand", expand_candidates(case, name), case.time_expand),
        ):
            results = []
            for config in candidates:
                try:
                    results.append((timer(name, config, layers, iters), config))
                except OutOfResources:
                    continue
            results.sort(key=lambda x: x[0])
            best = "; ".join(f"{us:.2f} us {tuple(c)}" for us, c in results[:3])
            print(
                f"  sweep T={case.num_tokens:<5} {case.adapters} adapter(s) {name:<8} "
                f"{kind}: {best}"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(REPO, "configs", "llama-3.1-8b"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-slots", type=int, default=4, help="device slots (max_loras)")
    p.add_argument("--batches", default="1,8,64,256,2048", help="rows of a step")
    p.add_argument("--adapters", default="1,4", help="adapters the rows are spread over")
    p.add_argument("--layers", type=int, default=32, help="launches in a graph")
    p.add_argument("--iters", type=int, default=20, help="graph replays timed")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tiles")
    p.add_argument("--sweep-batches", default="1,8,64,256", help="the batches swept")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_lora_kernels needs a CUDA GPU", file=sys.stderr)
        return 1
    bw = copy_bandwidth()
    print(
        f"LoRA kernels, {os.path.basename(args.model)} shapes, rank {args.rank}, "
        f"{args.num_slots} slots; copy bandwidth {bw / 1e12:.2f} TB/s; us per launch "
        f"(floor: the launch's bytes at that bandwidth); an empty Triton launch "
        f"{empty_launch_us(args.layers, args.iters):.2f} us"
    )
    print(
        f"{'T':>5} {'adapters':>8} {'layer':<8} {'shrink':>8} {'floor':>6} {'expand':>8} "
        f"{'floor':>6} {'base mm':>8}  shrink config / expand config"
    )
    sweep_batches = {int(b) for b in args.sweep_batches.split(",")}
    for num_tokens in (int(b) for b in args.batches.split(",")):
        for adapters in (int(a) for a in args.adapters.split(",")):
            if adapters > args.num_slots or (adapters > 1 and num_tokens < adapters):
                continue
            case = Case(args, num_tokens, adapters)
            for name in case.shapes:
                shrink, expand = case.configs(name)
                s_bytes, e_bytes = case.floor_bytes(name)
                s_us = case.time_shrink(name, shrink, args.layers, args.iters)
                e_us = case.time_expand(name, expand, args.layers, args.iters)
                base = case.time_base(name, args.layers, args.iters)
                print(
                    f"{num_tokens:>5} {adapters:>8} {name:<8} {s_us:>8.2f} "
                    f"{s_bytes / bw * 1e6:>6.2f} {e_us:>8.2f} {e_bytes / bw * 1e6:>6.2f} "
                    f"{base:>8.2f}  {tuple(shrink)} / {tuple(expand)}"
                )
            base = case.time_step(args.layers, args.iters, lora=False)
            pdl = case.time_step(args.layers, args.iters, lora=True)
            plain = case.time_step(args.layers, args.iters, lora=True, pdl=False)
            print(
                f"{num_tokens:>5} {adapters:>8} step     {args.layers} layers' matmuls "
                f"{base:.0f} us; with LoRA {pdl:.0f} us (+{pdl / base - 1:.1%}, "
                f"{(pdl - base) / (8 * args.layers):.2f} us a launch), without PDL {plain:.0f} us "
                f"(+{plain / base - 1:.1%})"
            )
            if args.sweep and num_tokens in sweep_batches:
                sweep(case, args.layers, args.iters)
            del case
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
