"""scripts/bench_moe.py's offline phase table: a run's steps set beside the ideal schedule's
floor, phase by phase (the benchmarks read where the nano-vllm shape's time goes from it); and
scripts/tune_moe.py's pruning of tiles that cannot run unspilled."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

from bench_moe import MoEBytes, OfflineRun, floor_bytes, phase_table, step_floor_bytes


def test_phase_table_sets_each_phase_beside_its_floor():
    # One MoE layer whose tokens always reach expert 0 alone: 100 B dense + 10 B of experts a
    # step, 1 B of K/V a token of context.
    mb, q = MoEBytes(100, 10, 1), [torch.tensor([1.0, 0.0])]
    prompts, outputs = [10, 20], [3, 2]
    # The prefill read once; step 1 decodes both (contexts 11 and 21), step 2 the first (12).
    assert step_floor_bytes(prompts, outputs, mb, q) == [(0, 110), (2, 142), (1, 122)]
    assert floor_bytes(prompts, outputs, mb, q) == 374
    # Measured: the first sequence's first token, then both (the prefill phase closes), then a
    # decode step of both and one of one; (sequences, end s, waited s).
    run = OfflineRun("x", 6.0, prompts, outputs, 0.0,
                     [(1, 1.0, 0.5), (2, 3.0, 1.0), (2, 4.0, 0.5), (1, 6.0, 1.5)])
    assert phase_table(run, mb, q, bw=100.0).splitlines() == [
        "         phase  steps  seconds  floor s of floor  host ms",
        " prefill phase      2    3.000    1.100      37%   750.00",
        " decode >=   2      1    1.000    1.420     142%   500.00",
        " decode >=   1      1    2.000    1.220      61%   500.00",
    ]


def test_tune_moe_skips_tiles_that_spill_or_overflow_shared_memory():
    # The 16,384-token grouped-GEMM candidates (128-row blocks), against what Triton 3.6
    # compiled for sm_90 (docs/BENCHMARKS.md, session 31): gate+up's two 128x128 float32
    # accumulators fit 8 warps (226 registers) and spill in 4 (255 and a stack); three stages
    # of a 128x128x128 gated tile need 288 KB of shared memory; down's 256-column tile fits
    # 8 warps (201 registers), not 4.
    from tune_moe import candidates, feasible

    def tile(n, k, warps, stages):
        return {"BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 8, "num_warps": warps,
                "num_stages": stages}

    assert feasible(tile(128, 128, 8, 2), 128, True)
    assert not feasible(tile(128, 128, 4, 2), 128, True)
    assert not feasible(tile(128, 128, 8, 3), 128, True)
    assert not feasible(tile(256, 64, 8, 2), 128, True)
    assert feasible(tile(256, 64, 8, 4), 128, False)
    assert not feasible(tile(256, 64, 4, 2), 128, False)
    assert not feasible(tile(128, 128, 8, 4), 128, False)  # 256 KB
    tiles = candidates(128)
    assert (len(tiles), sum(feasible(t, 128, True) for t in tiles),
            sum(feasible(t, 128, False) for t in tiles)) == (36, 14, 26)
