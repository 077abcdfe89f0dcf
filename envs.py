"""Every environment switch bastion reads, in one registry (vLLM's ``envs.py`` pattern).

Code asks ``envs.get(NAME)`` where it needs a value, never ``os.environ`` at import time, so a
kernel module imports the same way under any environment, a test may change a variable between
calls, and ``python -m bastion.envs`` lists every switch with its value. Each distinct value is
parsed once; a malformed one is an error naming the variable.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple


class EnvVar(NamedTuple):
    default: Any
    parse: Callable[[str], Any]
    doc: str


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return value == "1"


def _levels(value: str) -> int:
    if value not in ("1", "2"):
        raise ValueError("must be 1 (int8) or 2 (16-bit)")
    return int(value)


def _count(value: str) -> int:
    if not value.isdigit():
        raise ValueError("must be a whole number (0: the default)")
    return int(value)


def _text(value: str) -> str:
    return value.strip()


def _moe_tiles(value: str) -> dict[str, dict[str, int]]:
    """'up=BLOCK_N,BLOCK_K,num_warps,num_stages;down=...' -> {part: tile}, either part."""
    keys = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")
    tiles = {}
    for part in filter(None, value.split(";")):
        name, _, fields = part.partition("=")
        numbers = fields.split(",")
        if name.strip() not in ("up", "down") or len(numbers) != len(keys):
            raise ValueError("want 'up=BLOCK_N,BLOCK_K,num_warps,num_stages;down=...'")
        tiles[name.strip()] = dict(zip(keys, map(int, numbers)))
    return tiles


VARIABLES: dict[str, EnvVar] = {
    "BASTION_CACHE_DIR": EnvVar(
        None, _text, "where converted GGUF weights and other caches live (default "
        "~/.cache/bastion)"),
    "BASTION_API_KEY": EnvVar(None, _text, "default of `serve --api-key`"),
    "BASTION_ADMIN_KEY": EnvVar(None, _text, "default of `serve --admin-key`"),
    "BASTION_GEMV": EnvVar(
        True, _flag, "0: decode rows' linear layers on CUDA use cuBLAS instead of the Triton "
        "matrix-vector kernel (ops/linear.py)"),
    "BASTION_DECODE_SPLIT_TARGET": EnvVar(
        12 * 132, int, "decode attention splits the context until its grid has about this many "
        "programs"),
    "BASTION_DECODE_SPLIT_MIN_KEYS": EnvVar(
        256, int, "decode attention's smallest context split, in keys"),
    "BASTION_DECODE_ATTENTION_CONFIG": EnvVar(
        "", _text, "decode attention's launch shape 'tile,num_warps,num_stages[,block_m]' (A/B "
        "runs; empty: the tuned default)"),
    "BASTION_PREFILL_ATTENTION_CONFIG": EnvVar(
        "", _text, "prefill attention's launch shape, as the decode one"),
    "BASTION_SPLIT_MIXED_ATTENTION": EnvVar(
        True, _flag, "0: a mixed batch's decode rows run in the prefill attention launch"),
    "BASTION_CPU_KERNELS": EnvVar(
        True, _flag, "0: the CPU path runs the torch references instead of its C kernels "
        "(ops/cpu: decode attention, rotary + KV store, greedy argmax, the int8 and int4 decode "
        "matmuls, RMSNorm, SiLU-and-mul, the fused decode layers)"),
    "BASTION_CPU_FUSED_DECODE": EnvVar(
        True, _flag, "0: a CPU decode step of an int4 Llama model runs its layers op by op "
        "(each op's C kernel) instead of one C call through every layer and the final norm "
        "(ops/cpu/decoder_layers.c; the same arithmetic below 8 rows; from 8 to 16 the op-by-op "
        "layers take the dense bfloat16 GEMM)"),
    "BASTION_CPU_INT4_LEVELS": EnvVar(
        2, _levels, "the C int4 decode kernel's activations (ops/cpu/quant_gemv4.c), read when "
        "a layer is built: 2 quantizes them to 16-bit integers per 32 (below bfloat16's "
        "rounding), 1 to int8 (llama.cpp's scheme; faster, but the embedded model's decode "
        "logprobs then move past tests/test_quantized.py's bound)"),
    "BASTION_GRAMMAR_FILL_THREADS": EnvVar(
        0, _count, "shares a bitmask fill expected to take over 0.2 ms on one thread is split "
        "into (rows interleaved; the calling thread and threads that live as long as the worker; "
        "core/structured_output/fill.py); 0 (default): two where the worker may run on four "
        "cores or more, else one; 1: every fill on one thread"),
    "BASTION_LORA_SIDE_STREAM": EnvVar(
        True, _flag, "0: a LoRA layer's shrink runs after its base matmul on the same stream "
        "in captured graphs (core/lora/layers.py)"),
    "BASTION_PDL": EnvVar(
        True, _flag, "0: the decode step's Triton kernels (norms, matrix-vector products, "
        "rotary, attention, MoE routing and experts) launch without programmatic dependent "
        "launch (ops/triton/pdl.py)"),
    "BASTION_PDL_EARLY": EnvVar(
        True, _flag, "0: a decode kernel lets the next one launch only after its own wait "
        "(one kernel of overlap) instead of as it starts (ops/triton/pdl.py)"),
    "BASTION_L2_PREFETCH": EnvVar(
        True, _flag, "0: the decode step's matrix-vector kernels (and the MoE down kernel) do "
        "not prefetch their weight tiles into L2 before their wait (ops/triton/pdl.py)"),
    "BASTION_GEMV_WHOLE_K": EnvVar(
        True, _flag, "0: a one-row matrix-vector product whose weights fit L2 prefetches them "
        "there and walks K in steps after its wait, instead of reading its whole weight tile "
        "(K up to 4096, 32 KB a program) into registers before the wait (A/B runs)"),
    "BASTION_GEMV_ONE_ROW": EnvVar(
        True, _flag, "0: a one-row matrix-vector product with its whole K in one step runs the "
        "general kernel's [rows, N, K] products instead of [N, K] ones (more registers a "
        "thread, fewer programs a SM before their wait; A/B runs)"),
    "BASTION_MOE_DOWN_PREFETCH": EnvVar(
        True, _flag, "0: the MoE down kernel does not prefetch its experts' rows into L2 while "
        "the up kernel runs (A/B runs)"),
    "BASTION_L2_EVICT_FIRST": EnvVar(
        True, _flag, "0: the decode step's matrix-vector and MoE expert kernels read their "
        "weights with L2's normal priority instead of evict-first (A/B runs)"),
    "BASTION_ROTARY_LOADS_FIRST": EnvVar(
        True, _flag, "0: the rotary kernel reads k after storing q and v after storing k "
        "(one round trip to L2 each) instead of all three at once after its wait (A/B runs)"),
    "BASTION_MOE_GROUPED_PDL": EnvVar(
        False, _flag, "1: the grouped-GEMM MoE path (align, both products, the top-k sum: "
        "batches past the matrix-vector kernels' few tokens) launches with programmatic "
        "dependent launch like the decode kernels around it (ops/triton/pdl.py; A/B runs)"),
    "BASTION_MOE_ALIGN_RELAXED": EnvVar(
        False, _flag, "1: the MoE align kernel takes its slots with relaxed CTA-scope atomics "
        "(no GPU-wide fence around each one; its only program orders them with a barrier) "
        "instead of Triton's default acq_rel GPU-scope ones (A/B runs)"),
    "BASTION_MOE_GEMV_CONFIG": EnvVar(
        {}, _moe_tiles, "the MoE matrix-vector kernels' tiles instead of the tuned table's: "
        "'up=BLOCK_N,BLOCK_K,num_warps,num_stages;down=...' (either part; A/B runs)"),
    "BASTION_FUSED_SPLIT_MERGE": EnvVar(
        True, _flag, "0: a split decode merges in a second kernel instead of in its last "
        "split's program"),
}


def get(name: str) -> Any:
    """The variable's value: parsed from the environment as it is now, or its default when
    unset or empty (a test may change a variable between calls)."""
    return _parse(name, os.environ.get(name, ""))


@functools.cache
def _parse(name: str, raw: str) -> Any:
    var = VARIABLES[name]
    if not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r}: {exc}") from None


if __name__ == "__main__":
    for key, v in VARIABLES.items():
        print(f"{key}={os.environ.get(key, '')} (default {v.default!r}): {v.doc}")
