"""Launch configurations of the fused MoE kernels, per shape, token count and GPU.

Tuned tables live in ``ops/moe_configs/`` as JSON, one file per (local experts E, intermediate
size per rank N, hidden size K, GPU, dtype), written by ``scripts/tune_moe.py``; each maps a
token count to one shared ``BLOCK_SIZE_M`` (the align step pads to it) and the tile of each
product (``up``: gate/up with SiLU, ``down``), or to ``{"gemv": {"up": tile, "down": tile}}``:
the matrix-vector kernels of ``ops/triton/fused_moe_gemv.py``, which need no align step. A count between tuned ones takes the nearest.
Shapes without a table use ``default_moe_config``.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).with_name("moe_configs")


def config_file_name(num_experts: int, inter: int, hidden: int, device_name: str,
                     dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    return (f"E={num_experts},N={inter},K={hidden},device_name={device_name.replace(' ', '_')},"
            f"dtype={dtype_name}.json")


@functools.cache
def _load_table(name: str) -> dict[int, dict] | None:
    path = CONFIG_DIR / name
    if not path.is_file():
        logger.info("no tuned MoE config %s; using the default tiles", name)
        return None
    return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}


def default_moe_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Tiles by the rows each expert gets on average: the matrix-vector kernels while the
    pairs are few enough that two tokens seldom share an expert (a shared expert's weights
    are read once per pair there), small blocks for decode, where every program streams one
    expert's weights for a handful of rows; larger ones for prefill."""
    if num_tokens * top_k * 4 <= num_experts:
        return {"gemv": {"up": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 256, "num_warps": 4,
                                "num_stages": 1},
                         "down": {"BLOCK_SIZE_N": 8, "BLOCK_SIZE_K": 256, "num_warps": 4,
                                  "num_stages": 1}}}
    return grouped_moe_config(num_tokens, top_k, num_experts)


def grouped_moe_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """The grouped GEMM's default tiles (``default_moe_config`` without the GEMV case)."""
    rows = num_tokens * top_k / max(num_experts, 1)
    if rows <= 16:
        bm, up, down = 16, (64, 128, 1, 4, 4), (64, 128, 1, 4, 4)
    elif rows <= 48:
        bm, up, down = 32, (64, 64, 4, 4, 4), (64, 64, 4, 4, 4)
    else:
        bm, up, down = 64, (128, 64, 8, 8, 3), (128, 64, 8, 8, 3)

    def tile(t: tuple[int, int, int, int, int]) -> dict[str, int]:
        return dict(zip(("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
                         "num_stages"), t))

    return {"BLOCK_SIZE_M": bm, "up": tile(up), "down": tile(down)}


def get_moe_config(num_experts: int, inter: int, hidden: int, num_tokens: int, top_k: int,
                   dtype: torch.dtype) -> dict:
    """The launch configuration for ``num_tokens`` tokens (a Python int: static per graph)."""
    table = _table_for(num_experts, inter, hidden, dtype)
    if table:
        nearest = min(table, key=lambda m: abs(m - num_tokens))
        return table[nearest]
    return default_moe_config(num_tokens, top_k, num_experts)


@functools.cache
def _table_for(num_experts: int, inter: int, hidden: int,
               dtype: torch.dtype) -> dict[int, dict] | None:
    """This GPU's tuned table for the shape, looked up once per process (every MoE layer of
    every eager step asks)."""
    if not torch.cuda.is_available():
        return None
    return _load_table(config_file_name(num_experts, inter, hidden,
                                        torch.cuda.get_device_name(), dtype))
