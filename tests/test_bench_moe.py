"""scripts/bench_moe.py's offline phase table: a run's steps set beside the ideal schedule's
floor, phase by phase (the benchmarks read where the nano-vllm shape's time goes from it)."""

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
