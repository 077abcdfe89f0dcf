"""Check every Triton kernel against its torch reference at real shapes on one GPU, and time it.

Run on an H200 (or any CUDA GPU) from the repository root's parent or with bastion installed:

    python scripts/gpu_kernel_check.py [--iters 100] [--quick]

Prints one table: kernel, shape, max |error| against the reference, median time (CUDA events,
after warm-up), achieved GB/s, the bandwidth floor (bytes moved / device-to-device copy
bandwidth measured in the same run) and the torch reference's time. A failing case prints its
error in the table and the run goes on, so one run gives all numbers. Shapes follow Qwen3-0.6B
(16 query heads, 8 KV heads, head dim 128, hidden 1024, intermediate 3072).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEV = torch.device("cuda")
BF16 = torch.bfloat16
HQ, HK, D, HIDDEN, INTER, BLOCK = 16, 8, 128, 1024, 3072, 16
VOCAB = 151936


@dataclass
class Row:
    kernel: str
    shape: str
    max_err: float | None = None
    time_us: float | None = None
    bytes_moved: int = 0
    flops: int = 0
    ref_us: float | None = None
    error: str = ""


def bench(fn: Callable[[], object], iters: int, warmup: int = 10) -> float:
    """Median microseconds of ``fn`` over ``iters`` runs, each timed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench_graph(fn: Callable[[], object], iters: int, per: int = 10) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph of ``per`` calls, as the engine
    runs decode: no host launch cost inside the figure, even for kernels shorter than a launch."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(iters // per, 3)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    return statistics.median(times)


def copy_bandwidth(iters: int) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (1 GiB read + 1 GiB written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src), max(iters // 4, 10))
    return 2 * (1 << 30) / (us * 1e-6)


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _check_and_time(run: Callable[[], torch.Tensor], ref: torch.Tensor,
                    timer: Callable[[Callable[[], object], int], float], iters: int,
                    label: str) -> tuple[float, float] | None:
    """(max error of ``run()`` against ``ref``, its time by ``timer``), or None after printing
    why this launch shape failed (e.g. it needs more shared memory than the GPU has)."""
    try:
        return max_err(run(), ref), timer(run, iters)
    except Exception as exc:  # noqa: BLE001 - one shape must not end the sweep
        print(f"{label} failed: {str(exc)[:60]}")
        return None


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- cases


def case_store_kvcache(num_tokens: int, iters: int) -> Row:
    from bastion.ops.kv_store import store_kvcache_ref
    from bastion.ops.triton.kv_store import store_kvcache_triton

    row = Row("store_kvcache", f"T={num_tokens} Hk={HK} D={D} bs={BLOCK}")
    num_blocks = num_tokens // BLOCK * 2 + 8
    k_cache = torch.zeros(num_blocks, BLOCK, HK, D, dtype=BF16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(num_tokens, (HQ + 2 * HK) * D, dtype=BF16, device=DEV)
    key = qkv[:, HQ * D : (HQ + HK) * D].view(num_tokens, HK, D)  # strided, as in a model
    value = qkv[:, (HQ + HK) * D :].view(num_tokens, HK, D)
    slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:num_tokens]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    store_kvcache_triton(key, value, k_cache, v_cache, slots)
    row.max_err = max(max_err(k_cache, k_ref), max_err(v_cache, v_ref))
    row.time_us = bench(lambda: store_kvcache_triton(key, value, k_cache, v_cache, slots), iters)
    row.ref_us = bench(lambda: store_kvcache_ref(key, value, k_ref, v_ref, slots), iters)
    row.bytes_moved = 2 * nbytes(key, value) + nbytes(slots)
    return row


def _attention_batch(q_lens: list[int], ctx_lens: list[int], block_size: int = BLOCK,
                     head_major: bool = False, shuffled: bool = True):  # type: ignore[no-untyped-def]
    """Metadata, caches and queries of one attention call. The caches are [blocks, block_size,
    Hk, D] views; ``head_major`` stores them as [blocks, Hk, block_size, D] underneath (each KV
    head's tokens of a block contiguous). Block tables are shuffled unless ``shuffled`` is
    False."""
    from bastion.core.forward_context import build_attention_metadata

    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks).tolist() if shuffled else list(range(num_blocks))
    tables, used = [], 0
    for n in per_seq:
        tables.append(perm[used : used + n])
        used += n
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size, device=DEV)
    if head_major:
        k_cache = torch.randn(num_blocks, HK, block_size, D, dtype=BF16, device=DEV)
        k_cache = k_cache.permute(0, 2, 1, 3)
    else:
        k_cache = torch.randn(num_blocks, block_size, HK, D, dtype=BF16, device=DEV)
    v_cache = torch.randn_like(k_cache)  # same strides as k_cache
    query = torch.randn(sum(q_lens), HQ, D, dtype=BF16, device=DEV)
    return meta, k_cache, v_cache, query


def case_attention(
    label: str, q_lens: list[int], ctx_lens: list[int], iters: int, num_splits: int | None = None
) -> Row:
    from bastion.ops.attention import paged_attention_ref
    from bastion.ops.triton.unified_attention import paged_attention_triton

    meta, k_cache, v_cache, query = _attention_batch(q_lens, ctx_lens)
    splits = "auto" if num_splits is None else str(num_splits)
    row = Row(f"paged_attention[{label}]", f"B={len(q_lens)} T={query.shape[0]} "
              f"ctx<={meta.max_seq_len} splits={splits}")  # fmt: skip
    scale = D**-0.5

    def run() -> torch.Tensor:
        return paged_attention_triton(query, k_cache, v_cache, meta, scale, num_splits=num_splits)

    out = run()
    ref = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), meta, scale)
    row.max_err = max_err(out, ref)
    row.time_us = bench(run, iters)
    row.ref_us = bench(lambda: paged_attention_ref(query, k_cache, v_cache, meta, scale), 5, 2)
    kv_tokens = sum(meta.seq_lens_cpu)
    row.bytes_moved = 2 * kv_tokens * HK * D * 2 + 2 * nbytes(query)
    causal_pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, meta.seq_lens_cpu))
    row.flops = 4 * causal_pairs * HQ * D
    return row


def case_rms_norm(num_tokens: int, iters: int) -> Row:
    from bastion.ops.layernorm import rms_norm_ref
    from bastion.ops.triton.rms_norm import rms_norm_triton

    row = Row("rms_norm", f"T={num_tokens} H={HIDDEN}")
    x = torch.randn(num_tokens, HIDDEN, dtype=BF16, device=DEV)
    w = torch.randn(HIDDEN, dtype=BF16, device=DEV)
    row.max_err = max_err(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    row.time_us = bench(lambda: rms_norm_triton(x, w, 1e-6), iters)
    row.ref_us = bench(lambda: rms_norm_ref(x, w, 1e-6), iters)
    row.bytes_moved = 2 * nbytes(x) + nbytes(w)
    return row


def case_fused_add_rms_norm(num_tokens: int, iters: int) -> Row:
    from bastion.ops.layernorm import fused_add_rms_norm_ref
    from bastion.ops.triton.fused_add_rms_norm import fused_add_rms_norm_triton

    row = Row("fused_add_rms_norm", f"T={num_tokens} H={HIDDEN}")
    x, res = (torch.randn(num_tokens, HIDDEN, dtype=BF16, device=DEV) for _ in range(2))
    w = torch.randn(HIDDEN, dtype=BF16, device=DEV)
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    row.max_err = max(max_err(out, ref_out), max_err(new_res, ref_res))
    row.time_us = bench(lambda: fused_add_rms_norm_triton(x, res, w, 1e-6), iters)
    row.ref_us = bench(lambda: fused_add_rms_norm_ref(x, res, w, 1e-6), iters)
    row.bytes_moved = 4 * nbytes(x) + nbytes(w)
    return row


def _rotary_inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3's cos/sin table (theta 1e6, 40960 positions), a QKV output and positions."""
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D)
    freqs = torch.outer(torch.arange(40960, dtype=torch.float32, device=DEV), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    qkv = torch.randn(num_tokens, (HQ + 2 * HK) * D, dtype=BF16, device=DEV)
    return cache, qkv, torch.randint(0, 40960, (num_tokens,), device=DEV)


def case_rotary(num_tokens: int, iters: int) -> Row:
    from bastion.ops.rotary import apply_rotary_emb_ref
    from bastion.ops.triton.rotary import apply_rotary_emb_triton

    row = Row("rotary", f"T={num_tokens} Hq={HQ} Hk={HK} D={D}")
    cache, qkv, pos = _rotary_inputs(num_tokens)
    q, k = qkv[:, : HQ * D], qkv[:, HQ * D : (HQ + HK) * D]
    q_out, k_out = apply_rotary_emb_triton(pos, q, k, cache, D)
    q_ref, k_ref = apply_rotary_emb_ref(pos, q, k, cache, D)
    row.max_err = max(max_err(q_out, q_ref), max_err(k_out, k_ref))
    row.time_us = bench(lambda: apply_rotary_emb_triton(pos, q, k, cache, D), iters)
    row.ref_us = bench(lambda: apply_rotary_emb_ref(pos, q, k, cache, D), iters)
    row.bytes_moved = 2 * nbytes(q_out, k_out) + num_tokens * D * 4 + nbytes(pos)
    return row


def case_norm_rope_store(num_tokens: int, iters: int) -> Row:
    """Qwen3's attention input fused: per-head q/k RMSNorm, rotary, K/V store (one launch)."""
    from bastion.ops.rotary import apply_rotary_emb_ref
    from bastion.ops.triton.rotary import apply_rotary_emb_triton

    row = Row("norm_rope_store", f"T={num_tokens} Hq={HQ} Hk={HK} D={D} bs={BLOCK}")
    cache, qkv, pos = _rotary_inputs(num_tokens)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    num_blocks = num_tokens // BLOCK * 2 + 8
    caches = [torch.zeros(num_blocks, BLOCK, HK, D, dtype=BF16, device=DEV) for _ in range(4)]
    slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:num_tokens]
    w = [torch.randn(D, dtype=BF16, device=DEV) for _ in range(2)]
    extra = {"q_weight": w[0], "k_weight": w[1], "eps": 1e-6, "value": v, "slot_mapping": slots}

    def run() -> object:
        return apply_rotary_emb_triton(pos, q, k, cache, D, k_cache=caches[0],
                                       v_cache=caches[1], **extra)

    q_out, k_out = run()
    q_ref, k_ref = apply_rotary_emb_ref(pos, q, k, cache, D, k_cache=caches[2],
                                        v_cache=caches[3], **extra)
    row.max_err = max(max_err(q_out, q_ref), max_err(k_out, k_ref),
                      max_err(caches[0], caches[2]), max_err(caches[1], caches[3]))
    row.time_us = bench(run, iters)
    row.ref_us = bench(lambda: apply_rotary_emb_ref(pos, q, k, cache, D, k_cache=caches[2],
                                                    v_cache=caches[3], **extra), iters)
    row.bytes_moved = nbytes(qkv) + 2 * nbytes(q_out, k_out) + num_tokens * D * 4
    return row


def case_silu_and_mul(num_tokens: int, iters: int) -> Row:
    from bastion.ops.activation import silu_and_mul_ref
    from bastion.ops.triton.silu_and_mul import silu_and_mul_triton

    row = Row("silu_and_mul", f"T={num_tokens} I={INTER}")
    x = torch.randn(num_tokens, 2 * INTER, dtype=BF16, device=DEV)
    row.max_err = max_err(silu_and_mul_triton(x), silu_and_mul_ref(x))
    row.time_us = bench(lambda: silu_and_mul_triton(x), iters)
    row.ref_us = bench(lambda: silu_and_mul_ref(x), iters)
    row.bytes_moved = nbytes(x) * 3 // 2
    return row


def case_sample(num_rows: int, iters: int, num_splits: int | None = None) -> Row:
    """Greedy sampling of bf16 logits over Qwen3's vocabulary (graph-replayed: two launches);
    the reference is torch's argmax."""
    from bastion.ops.triton.sample import sample_tokens_triton

    pieces = "auto" if num_splits is None else num_splits
    row = Row("sample greedy", f"N={num_rows} V={VOCAB} pieces={pieces}")
    logits = torch.randn(num_rows, VOCAB, device=DEV).to(BF16)
    temps = torch.zeros(num_rows, device=DEV)
    seeds = torch.zeros(num_rows, dtype=torch.int64, device=DEV)

    def run() -> torch.Tensor:
        return sample_tokens_triton(logits, temps, seeds, num_splits=num_splits)

    row.max_err = float((run() != logits.argmax(dim=-1)).sum())
    row.time_us = bench_graph(run, iters)
    row.ref_us = bench_graph(lambda: logits.argmax(dim=-1), iters)
    row.bytes_moved = nbytes(logits)
    return row


def case_fused_moe(num_tokens: int, iters: int) -> Row:
    from bastion.ops.moe import fused_moe_ref
    from bastion.ops.triton.fused_moe import fused_moe_triton

    # Qwen3-30B-A3B-like: 128 experts, top-8, hidden 2048, expert intermediate 768.
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    row = Row("fused_moe", f"T={num_tokens} E={num_experts} K={top_k} H={hidden} I={inter}")
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=BF16, device=DEV) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=BF16, device=DEV) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, device=DEV)
    topk_w, topk_ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    out = fused_moe_triton(x, w13, w2, topk_w, topk_ids)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), topk_w, topk_ids)
    row.max_err = max_err(out, ref)
    row.time_us = bench(lambda: fused_moe_triton(x, w13, w2, topk_w, topk_ids), iters)
    row.ref_us = bench(lambda: fused_moe_ref(x, w13, w2, topk_w, topk_ids), 5, 2)
    used = int(torch.unique(topk_ids).numel())
    row.bytes_moved = used * (nbytes(w13) + nbytes(w2)) // num_experts + 2 * nbytes(x)
    row.flops = 2 * num_tokens * top_k * 3 * inter * hidden
    return row


# ----------------------------------------------------------------------------- driver


def all_cases(iters: int, quick: bool) -> list[tuple[str, Callable[[], Row]]]:
    decode_b, decode_ctx = (64, 512) if quick else (256, 1024)
    cases: list[tuple[str, Callable[[], Row]]] = [
        ("store_kvcache decode", lambda: case_store_kvcache(decode_b, iters)),
        ("store_kvcache prefill", lambda: case_store_kvcache(4096, iters)),
        ("attn decode", lambda: case_attention("decode", [1] * decode_b, [decode_ctx - 1] * decode_b, iters)),
        ("attn decode no split", lambda: case_attention("decode", [1] * 8, [8191] * 8, iters, 1)),
        ("attn decode split", lambda: case_attention("decode", [1] * 8, [8191] * 8, iters)),
        ("attn decode b1 32k", lambda: case_attention("decode", [1], [32767], iters)),
        ("attn prefill", lambda: case_attention("prefill", [512] * 8, [0] * 8, iters)),
        ("attn mixed", lambda: case_attention(
            "mixed", [512] * 4 + [1] * 128, [1536] * 4 + [1023] * 128, iters)),
        ("rms_norm decode", lambda: case_rms_norm(decode_b, iters)),
        ("rms_norm prefill", lambda: case_rms_norm(4096, iters)),
        ("fused_add_rms_norm decode", lambda: case_fused_add_rms_norm(decode_b, iters)),
        ("fused_add_rms_norm prefill", lambda: case_fused_add_rms_norm(4096, iters)),
        ("rotary decode", lambda: case_rotary(decode_b, iters)),
        ("rotary prefill", lambda: case_rotary(4096, iters)),
        ("norm_rope_store decode", lambda: case_norm_rope_store(decode_b, iters)),
        ("norm_rope_store prefill", lambda: case_norm_rope_store(4096, iters)),
        ("silu_and_mul decode", lambda: case_silu_and_mul(decode_b, iters)),
        ("silu_and_mul prefill", lambda: case_silu_and_mul(4096, iters)),
        ("sample 256", lambda: case_sample(256, iters)),
        ("sample 256 one piece", lambda: case_sample(256, iters, 1)),
        ("sample 256 8 pieces", lambda: case_sample(256, iters, 8)),
        ("sample 256 16 pieces", lambda: case_sample(256, iters, 16)),
        ("sample 128", lambda: case_sample(128, iters)),
        ("sample 128 16 pieces", lambda: case_sample(128, iters, 16)),
        ("sample 14", lambda: case_sample(14, iters)),
        ("sample 14 one piece", lambda: case_sample(14, iters, 1)),
    ]  # fmt: skip
    if importlib.util.find_spec("bastion.ops.triton.fused_moe") is not None:  # optional kernel
        cases.append(("fused_moe decode", lambda: case_fused_moe(decode_b, iters)))
        cases.append(("fused_moe prefill", lambda: case_fused_moe(4096, iters)))
    return cases


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row], copy_bw: float) -> None:
    header = ["kernel", "shape", "max err", "time us", "GB/s", "floor us", "TFLOP/s", "ref us"]
    lines = []
    for r in rows:
        gbs = r.bytes_moved / (r.time_us * 1e-6) / 1e9 if r.time_us and r.bytes_moved else None
        floor = r.bytes_moved / copy_bw * 1e6 if r.bytes_moved else None
        tflops = r.flops / (r.time_us * 1e-6) / 1e12 if r.time_us and r.flops else None
        lines.append([r.kernel, r.shape, fmt(r.max_err, ".2e"), fmt(r.time_us, ".1f"),
                      fmt(gbs, ".0f"), fmt(floor, ".1f"), fmt(tflops, ".1f"), fmt(r.ref_us, ".1f")])  # fmt: skip
        if r.error:
            lines[-1][2] = "ERROR: " + r.error
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))


def _decode_contexts(steps: tuple[int, ...]) -> list[tuple[int, list[int]]]:
    """The nano-vllm workload's decode batches (prompts and outputs uniform in [100, 1024],
    256 sequences): at step s the sequences with more than s outputs remain, each with its
    prompt plus s tokens of context; in the workload's order."""
    import random

    rng = random.Random(0)
    work = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    return [(step, [p + step for p, o in work if o > step]) for step in steps]


def _kv_bytes(meta) -> int:  # type: ignore[no-untyped-def]
    """Bytes of K and V (bf16) a decode batch's attention reads over all its contexts."""
    return 2 * sum(meta.seq_lens_cpu) * HK * D * 2


def attention_sweep(iters: int, copy_bw: float) -> None:
    """Decode attention's launch shapes at five points of the nano-vllm workload
    (``_decode_contexts``), in the batch's order and longest first, against the K/V bytes'
    copy floor."""
    from bastion.ops.triton import unified_attention as ua

    print(f"{'step':>4} {'batch':>5} {'ctx':>5} {'order':>7} {'tile':>4} {'warps':>5} "
          f"{'stages':>6} {'splits':>6} {'us':>8} {'GB/s':>6} {'of floor':>8}")
    for step, natural in _decode_contexts((60, 400, 800, 900, 980)):
        # Longest first: the GPU starts programs roughly in launch order, so the long
        # sequences start early and the last wave is made of short ones.
        for order, ctx in (("batch", natural), ("longest", sorted(natural, reverse=True))):
            batch = _attention_batch([1] * len(ctx), ctx)
            kv_bytes = _kv_bytes(batch[0])
            floor_us = kv_bytes / copy_bw * 1e6
            configs = [ua.KernelConfig(*c, 16) for c in ((64, 4, 3), (64, 4, 2), (128, 4, 3))]
            for config in configs:
                for splits in ((None, 2) if len(ctx) > 128 else (None, 1, 2, 4)):
                    def run(config=config, splits=splits, batch=batch):  # type: ignore[no-untyped-def]
                        meta, k_cache, v_cache, query = batch
                        return ua.paged_attention_triton(query, k_cache, v_cache, meta, D**-0.5,
                                                         num_splits=splits, config=config)

                    try:
                        us = bench_graph(run, iters)
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                        print(f"{step:>4} {len(ctx):>5} {config} failed: {str(exc)[:60]}")
                        continue
                    print(f"{step:>4} {len(ctx):>5} {sum(ctx) // len(ctx):>5} {order:>7} "
                          f"{config.tile:>4} {config.num_warps:>5} {config.num_stages:>6} "
                          f"{splits!s:>6} {us:>8.1f} {kv_bytes / us / 1e3:>6.0f} "
                          f"{floor_us / us:>8.0%}")
            del batch
            torch.cuda.empty_cache()


def decode_kernel_sweep(iters: int, copy_bw: float) -> None:
    """Decode attention's launch shapes on workload-like batches (longest context first, shuffled
    block tables), with the largest difference from the default's output and each compiled
    variant's registers a thread and spilled bytes (which set how many programs an SM holds)."""
    print(f"{'step':>4} {'batch':>5} {'tile':>4} {'warps':>5} {'stages':>6} {'block_m':>7} "
          f"{'splits':>6} {'us':>8} {'TB/s':>5} {'of copy':>7} {'max err':>8} {'regs/spill':>9}")
    for step, ctx in _decode_contexts((60, 400, 800, 900, 980)):
        _decode_sweep_step(step, sorted(ctx, reverse=True), iters, copy_bw)
        torch.cuda.empty_cache()


def _compiled(fn) -> dict[int, object]:  # type: ignore[no-untyped-def]
    """The kernels Triton has compiled for ``fn`` so far, by id (its per-device caches)."""
    kernels: dict[int, object] = {}
    for cache in getattr(fn, "device_caches", {}).values():
        if isinstance(cache, tuple) and cache and isinstance(cache[0], dict):
            kernels.update((id(k), k) for k in cache[0].values())
    return kernels


def _regs_since(fn, before: dict[int, object]) -> str:  # type: ignore[no-untyped-def]
    """'registers/spilled bytes' of the kernel variants of ``fn`` compiled since ``before``
    (``_compiled(fn)`` taken earlier); '-' when none was."""
    new = [k for i, k in _compiled(fn).items() if i not in before]
    return ",".join(f"{getattr(k, 'n_regs', '?')}/{getattr(k, 'n_spills', '?')}"
                    for k in new) or "-"


def _decode_sweep_step(step: int, ctx: list[int], iters: int, copy_bw: float) -> None:
    from bastion.ops.triton import unified_attention as ua

    meta, k_cache, v_cache, query = _attention_batch([1] * len(ctx), ctx)
    kv_bytes = _kv_bytes(meta)
    ref = ua.paged_attention_triton(query, k_cache, v_cache, meta, D**-0.5)
    auto = ua._pick_num_splits(len(ctx), HK, 1, 1 << 15)
    # NOTE: session 5 measured 32-128 rows (call 7), one- and two-warp programs (call 8)
    # and key groups split between warps (call 10, commit 8d086d0); session 6 one max a split
    # and register caps (commit aae00fc): all slower.
    for c in ((64, 4, 3, 16), (64, 4, 2, 16), (128, 4, 3, 16), (32, 4, 3, 16)):
        def run(c=c) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return ua.paged_attention_triton(query, k_cache, v_cache, meta, D**-0.5,
                                             num_splits=auto, config=ua.KernelConfig(*c))

        before = _compiled(ua._unified_attention_kernel)
        timed = _check_and_time(run, ref, bench_graph, iters, f"{step:>4} {len(ctx):>5} {c}")
        if timed is None:
            continue
        err, us = timed
        regs = _regs_since(ua._unified_attention_kernel, before)
        print(f"{step:>4} {len(ctx):>5} {c[0]:>4} {c[1]:>5} {c[2]:>6} {c[3]:>7} {auto:>6} "
              f"{us:>8.1f} {kv_bytes / us / 1e6:>5.2f} "
              f"{kv_bytes / us / 1e6 / (copy_bw / 1e12):>7.0%} {err:>8.4f} {regs:>9}")


def _read_kernels():  # type: ignore[no-untyped-def]
    """Two Triton kernels that read without attention's softmax (defined on first use: the
    script imports no kernel code before it knows it has a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(x_ptr, out_ptr, per_program, TILE: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * per_program
        acc = tl.zeros([TILE], dtype=tl.float32)
        for start in range(0, per_program, TILE):
            acc += tl.load(x_ptr + base + start + tl.arange(0, TILE)).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    @triton.jit
    def paged_pass(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, stride_blk, stride_off,
                   stride_h, stride_bt, TILE: tl.constexpr, KV_BLOCK: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DOTS: tl.constexpr):
        # Attention's loads of K and V through the block table; with DOTS also both of its dots
        # (q k^T, then p v) but no softmax, else next to no arithmetic.
        seq, head = tl.program_id(0), tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)
        offs_t, offs_d = tl.arange(0, TILE), tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + offs_d[None, :])
        acc = tl.zeros([BLOCK_M if DOTS else TILE, HEAD_DIM], dtype=tl.float32)
        for tile in range(tl.cdiv(seq_len, TILE)):
            pos = tile * TILE + offs_t
            ok = pos < seq_len
            blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // KV_BLOCK, mask=ok,
                          other=0).to(tl.int64)
            off = blk * stride_blk + (pos % KV_BLOCK) * stride_off + head * stride_h
            v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
            if DOTS:
                k = tl.load(k_ptr + off[None, :] + offs_d[:, None], mask=ok[None, :], other=0.0)
                acc += tl.dot(tl.dot(q, k).to(v.dtype), v)
            else:
                k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
                acc += k.to(tl.float32) * v.to(tl.float32)
        tl.store(out_ptr + seq * tl.num_programs(1) + head, tl.sum(tl.sum(acc, axis=1), axis=0))

    return stream_read, paged_pass


def _read_vs_attention(step: int, ctx: list[int], iters: int, copy_bw: float,
                       paged_pass) -> None:  # type: ignore[no-untyped-def]
    # NOTE: session 5 (call 2) measured all five; the layouts are within 1.5 % of each other.
    layouts = [("16, token-major", 16, False, True), ("64, head-major", 64, True, True)]
    if os.environ.get("ALL_LAYOUTS"):
        layouts[1:1] = [("16, token-major, in order", 16, False, False),
                        ("16, head-major", 16, True, True), ("64, token-major", 64, False, True)]
    for layout in layouts:
        _time_layout(step, ctx, iters, copy_bw, paged_pass, *layout)
        torch.cuda.empty_cache()


def _time_layout(step: int, ctx: list[int], iters: int, copy_bw: float, paged_pass,  # type: ignore[no-untyped-def]
                 label: str, block_size: int, head_major: bool, shuffled: bool) -> None:
    from bastion.ops.triton import unified_attention as ua

    meta, k_cache, v_cache, query = _attention_batch([1] * len(ctx), ctx, block_size,
                                                     head_major, shuffled)
    kv_bytes = _kv_bytes(meta)
    out = torch.empty((len(ctx), HK), dtype=torch.float32, device=DEV)
    bt = meta.block_tables
    runs = {"attention": lambda: ua.paged_attention_triton(query, k_cache, v_cache, meta,
                                                           D**-0.5)}
    q16 = torch.randn(16, D, dtype=k_cache.dtype, device=k_cache.device)
    for dots, stages in ((False, 2), (False, 3), (True, 2), (True, 3)):
        name = f"{'dots' if dots else 'read'}, {stages} stages"
        runs[name] = lambda dots=dots, stages=stages: paged_pass[(len(ctx), HK)](
            out, q16, k_cache, v_cache, bt, meta.seq_lens, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), bt.stride(0), TILE=64, KV_BLOCK=block_size, HEAD_DIM=D,
            BLOCK_M=16, DOTS=dots, num_warps=4, num_stages=stages)
    for name, run in runs.items():
        us = bench_graph(run, iters)
        print(f"{step:>4} {len(ctx):>5} {label:>26} {name:>16} {us:>7.1f} "
              f"{kv_bytes / us / 1e6:>5.2f} {kv_bytes / us / 1e6 / (copy_bw / 1e12):>7.0%}")


def read_bandwidth(iters: int, copy_bw: float) -> None:
    """How fast this GPU reads, against the copy bandwidth the floors use: a 4 GiB read by
    torch's sum and by a plain Triton streaming kernel, then the paged K/V of workload-like
    decode batches read through their shuffled block tables with the attention kernel's access
    pattern (64-token tiles, one program per sequence and KV head) but next to no arithmetic,
    beside the attention kernel on the same batches. Graph-replayed."""
    stream_read, paged_pass = _read_kernels()
    x = torch.randn(1 << 31, dtype=BF16, device=DEV)  # 4 GiB
    us = bench_graph(lambda x=x: torch.sum(x, dtype=torch.float32), iters)
    print(f"copy {copy_bw / 1e12:.2f} TB/s; torch.sum read {x.nbytes / us / 1e6:.2f} TB/s")
    for programs, warps in ((1056, 4), (4224, 4), (4224, 8)):
        per = x.numel() // programs // 8192 * 8192
        part = torch.empty(programs, dtype=torch.float32, device=DEV)
        us = bench_graph(lambda x=x, programs=programs, per=per, part=part, warps=warps:
                         stream_read[(programs,)](x, part, per, TILE=8192, num_warps=warps),
                         iters)
        print(f"stream read: {programs} programs, {warps} warps: "
              f"{programs * per * 2 / us / 1e6:.2f} TB/s")
    del x
    torch.cuda.empty_cache()
    print(f"{'step':>4} {'batch':>5} {'block, layout':>26} {'kernel':>16} {'us':>7} {'TB/s':>5} "
          f"{'of copy':>7}")
    for step, ctx in _decode_contexts((60, 800)):
        _read_vs_attention(step, sorted(ctx, reverse=True), iters, copy_bw, paged_pass)
        torch.cuda.empty_cache()


def prefill_sweep(iters: int) -> None:
    """Prefill attention's launch shapes on two of the nano-vllm workload's 16k-token chunks:
    whole prompts (uniform in [100, 1024]), and the same prompts' second halves over their first
    halves already cached; TFLOP/s of the causal pairs, and the error against the reference."""
    import random

    from bastion.ops.attention import paged_attention_ref
    from bastion.ops.triton import unified_attention as ua

    rng = random.Random(0)
    prompts: list[int] = []
    while sum(prompts) < 16384 - 1024:
        prompts.append(rng.randint(100, 1024))
    cases = (("whole", prompts, [0] * len(prompts)),
             ("halves", [p - p // 2 for p in prompts], [p // 2 for p in prompts]))
    print(f"{'chunk':>6} {'tokens':>6} {'tile':>4} {'warps':>5} {'stages':>6} {'block_m':>7} "
          f"{'us':>8} {'TFLOP/s':>7} {'max err':>8}")
    for label, q_lens, ctx_lens in cases:
        meta, k_cache, v_cache, query = _attention_batch(q_lens, ctx_lens)
        pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, meta.seq_lens_cpu))
        flops = 4 * pairs * HQ * D
        ref = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), meta, D**-0.5)
        for c in ((64, 8, 3, 128), (128, 8, 3, 128), (128, 8, 2, 128), (64, 4, 3, 64),
                  (128, 4, 2, 64), (32, 4, 3, 64), (64, 4, 4, 128), (128, 8, 3, 256)):
            config = ua.KernelConfig(*c)

            def run(config=config, batch=(query, k_cache, v_cache, meta)):  # type: ignore[no-untyped-def]
                return ua.paged_attention_triton(*batch, D**-0.5, config=config)

            timed = _check_and_time(run, ref, bench, iters, f"{label:>6} {c}")
            if timed is None:
                continue
            err, us = timed
            print(f"{label:>6} {sum(q_lens):>6} {c[0]:>4} {c[1]:>5} {c[2]:>6} {c[3]:>7} "
                  f"{us:>8.1f} {flops / us / 1e6:>7.1f} {err:>8.4f}")
        _time_torch_varlen(label, q_lens, meta, k_cache, v_cache, query, ref, flops, iters)
        del meta, k_cache, v_cache, query
        torch.cuda.empty_cache()


def _time_torch_varlen(label: str, q_lens: list[int], meta, k_cache, v_cache, query,  # type: ignore[no-untyped-def]
                       ref: torch.Tensor, flops: int, iters: int) -> None:
    """The same chunk through torch's flash-attention varlen kernel: over the new tokens' K/V
    as contiguous rows (whole prompts only), and over the paged cache where this torch takes a
    block table."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        print(f"torch varlen: unavailable ({exc})")
        return
    params = inspect.signature(varlen_attn).parameters
    print(f"torch varlen_attn{inspect.signature(varlen_attn)}")
    extra: dict[str, object] = {"scale": D**-0.5}
    if "is_causal" in params:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    cu_q = meta.query_start_loc
    max_q = max(q_lens)
    cases = []
    if all(s == q for s, q in zip(meta.seq_lens_cpu, q_lens)):
        k_rows = k_cache.reshape(-1, HK, D)[meta.slot_mapping]
        v_rows = v_cache.reshape(-1, HK, D)[meta.slot_mapping]
        cases.append(("rows", lambda: varlen_attn(query, k_rows, v_rows, cu_q, cu_q, max_q,
                                                  max_q, **extra)))
    if "block_table" in params:
        seqused = meta.seq_lens
        cases.append(("paged", lambda: varlen_attn(
            query, k_cache, v_cache, cu_q, None, max_q, max(meta.seq_lens_cpu),
            seqused_k=seqused, block_table=meta.block_tables, **extra)))
    for name, run in cases:
        timed = _check_and_time(run, ref, bench, iters, f"{label:>6} torch varlen {name}")
        if timed is not None:
            err, us = timed
            print(f"{label:>6} {sum(q_lens):>6} torch varlen {name:<6} "
                  f"{us:>8.1f} {flops / us / 1e6:>7.1f} {err:>8.4f}")


def gemm_host_cost(iters: int) -> None:
    """Host time of one eager ``F.linear`` (what a prefill step pays per GEMM before the device
    sees it), by shape and BLAS library, beside its device time; then with the device busy
    (a 20 ms kernel queued first, as in a prefill step, where the host runs ahead), for
    cuBLAS and for a Triton launch. Session 6 (call 5): under cProfile a prefill step spent
    118 us in each F.linear; standalone (call 6) 13-27 us."""
    import torch.nn.functional as F

    from bastion.ops.triton.silu_and_mul import silu_and_mul_triton

    shapes = {"qkv": (HIDDEN, (HQ + 2 * HK) * D), "o": (HQ * D, HIDDEN),
              "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN), "lm_head": (HIDDEN, VOCAB)}

    def host_us(fn: Callable[[], object], busy: bool) -> float:
        calls, best = 8, float("inf")  # few enough that the launch queue never fills
        for _ in range(max(iters // 10, 3)):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(40_000_000)  # ~20 ms of device time
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
        return best

    print(f"{'blas':>8} {'gemm':>8} {'M':>6} {'host us':>8} {'busy us':>8} {'device us':>9}")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (k, n) in shapes.items():
            w = torch.randn(n, k, dtype=BF16, device=DEV)
            for m in (256, 4096, 16384):
                x = torch.randn(m, k, dtype=BF16, device=DEV)
                F.linear(x, w)
                idle = host_us(lambda x=x, w=w: F.linear(x, w), busy=False)
                busy = host_us(lambda x=x, w=w: F.linear(x, w), busy=True)
                dev = bench(lambda x=x, w=w: F.linear(x, w), iters)
                print(f"{lib:>8} {name:>8} {m:>6} {idle:>8.1f} {busy:>8.1f} {dev:>9.1f}")
                del x
            del w
            torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    x = torch.randn(16384, 2 * INTER, dtype=BF16, device=DEV)
    silu_and_mul_triton(x)
    idle, busy = (host_us(lambda: silu_and_mul_triton(x), b) for b in (False, True))
    print(f"{'triton':>8} {'silu':>8} {16384:>6} {idle:>8.1f} {busy:>8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="smaller decode batch")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--attention-sweep", action="store_true",
                        help="time decode attention's launch shapes at workload-like batches")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="decode attention's launch shapes, with registers and spills")
    parser.add_argument("--read-bandwidth", action="store_true",
                        help="this GPU's read bandwidth, and paged K/V reads against attention")
    parser.add_argument("--gemm-host", action="store_true",
                        help="host time of an eager F.linear by shape and BLAS library")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="time prefill attention's launch shapes on workload-like chunks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernel_check needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(args.iters)
    torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {copy_bw / 1e12:.2f} TB/s")
    if args.attention_sweep:
        attention_sweep(args.iters, copy_bw)
        return 0
    if args.prefill_sweep:
        prefill_sweep(args.iters)
        return 0
    if args.gemm_host:
        gemm_host_cost(args.iters)
        return 0
    if args.decode_sweep:
        decode_kernel_sweep(args.iters, copy_bw)
        return 0
    if args.read_bandwidth:
        read_bandwidth(args.iters, copy_bw)
        return 0
    rows, failures = [], 0
    for name, run in all_cases(args.iters, args.quick):
        if args.only and args.only not in name:
            continue
        try:
            rows.append(run())
        except Exception as exc:  # noqa: BLE001 - one broken kernel must not hide the others
            failures += 1
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(name, "", error=f"{type(exc).__name__}: {str(exc)[:80]}"))
        torch.cuda.empty_cache()
    print_table(rows, copy_bw)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
