"""The MoE align kernel's share of a grouped-GEMM MoE layer (issue #18's offline target).

The align kernel (``ops/triton/moe_align.py``) is one program, and the layer's first product
waits for it. Session 11's profile of a decode step of 256 sequences on an H200 gave it 25.6 us
a layer against 315 us for both products: about 1.2 ms of a 25 ms step. Its slots are taken
with atomics that Triton fences at GPU scope by default (``MEMBAR.GPU`` before each, an L1
invalidate after, in sm_90 SASS); ``BASTION_MOE_ALIGN_RELAXED=1`` takes them relaxed at CTA
scope. For each token count that the tuned table gives to the grouped GEMM (Qwen3-30B-A3B's
experts, top-8 of 128, uniform routing), this prints the align kernel alone with either
atomic, and the whole layer (align, both products, the top-k sum) with the defaults and with
both switches on (the relaxed atomics, and ``BASTION_MOE_GROUPED_PDL=1``: the four kernels
launched programmatically behind one another), beside the layer's floor: the bytes of the
experts the tokens reach over the copy bandwidth measured in the same run. Each is replayed
from a CUDA graph.

    python scripts/bench_moe_align.py
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import torch
from bench_latency import copy_bandwidth
from bench_moe_layout import time_graph

TOKENS = [8, 32, 64, 128, 256, 512, 2048, 16384]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args(argv)
    from bastion.ops.moe import select_experts_ref
    from bastion.ops.moe_configs import get_moe_config
    from bastion.ops.triton.fused_moe import fused_moe_triton
    from bastion.ops.triton.moe_align import moe_align_triton

    dev = torch.device("cuda")
    num_experts, inter, hidden, top_k = 128, 768, 2048, 8
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16,
                      generator=gen) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=torch.bfloat16,
                     generator=gen) * 0.02
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; E={num_experts} "
          f"N={inter} K={hidden} top-{top_k}, {expert_bytes / 1e6:.1f} MB per expert")
    print(f"{'tokens':>6} {'BM':>4} | {'align us':>9} {'relaxed':>8} | {'layer us':>9} "
          f"{'both on':>8} {'floor us':>9} {'align share':>11}")
    for num_tokens in args.tokens:
        config = get_moe_config(num_experts, inter, hidden, num_tokens, top_k, torch.bfloat16)
        if "gemv" in config:
            print(f"{num_tokens:>6}    - | the matrix-vector kernels (no align)")
            continue
        block_m = config["BLOCK_SIZE_M"]
        logits = torch.randn(num_tokens, num_experts, device=dev, generator=gen)
        weights, ids = select_experts_ref(logits, top_k, True)
        ids = ids.to(torch.int32)
        x = torch.randn(num_tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        align = {}
        for relaxed in ("0", "1"):
            os.environ["BASTION_MOE_ALIGN_RELAXED"] = relaxed
            align[relaxed] = time_graph(
                [functools.partial(moe_align_triton, ids, block_m, num_experts)], args.replays)
        layer = {}
        for on in ("0", "1"):
            os.environ["BASTION_MOE_ALIGN_RELAXED"] = os.environ["BASTION_MOE_GROUPED_PDL"] = on
            layer[on] = time_graph(
                [functools.partial(fused_moe_triton, x, w13, w2, weights, ids)], args.replays)
        floor = ids.unique().numel() * expert_bytes / bw * 1e6
        print(f"{num_tokens:>6} {block_m:>4} | {align['0']:>9.1f} {align['1']:>8.1f} | "
              f"{layer['0']:>9.1f} {layer['1']:>8.1f} {floor:>9.1f} "
              f"{align['0'] / layer['0']:>10.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
