"""The dense matmul of a linear layer: cuBLAS, or a Triton matrix-vector kernel for decode rows.

``F.linear`` serves everything except a bfloat16/float16 input of at most ``GEMV_MAX_ROWS``
rows on CUDA, which ``ops/triton/gemv.py`` serves where its tiles (``gemv_config``, chosen on
an H200 with ``scripts/tune_gemv.py``) beat cuBLAS. Float32 keeps cuBLAS everywhere, so the
parity paths are unchanged. ``BASTION_GEMV=0`` turns the kernel off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bastion import envs
from bastion.ops._dispatch import triton_launcher

GEMV_MAX_ROWS = 4


def gemv_config(num_rows: int, n: int, k: int) -> dict[str, int] | None:
    """Tiles of the matrix-vector kernel for ``[num_rows, k] @ [n, k]^T``, or None where
    cuBLAS is as fast. From ``scripts/tune_gemv.py`` on an H200 (docs/BENCHMARKS.md): one row
    wins on every shape up to 16k columns (77-99 % of the floor for cuBLAS, 85-113 % here);
    from two rows only narrow outputs win (o-projections, Qwen3-0.6B's down, a MoE router:
    cuBLAS reads them at 3-55 %), wide ones lose (the tile's rows multiply the registers)."""
    if num_rows == 1 and n <= 16384:
        return {"BLOCK_N": 4 if n <= 2048 else 8,
                "BLOCK_K": 1024 if k >= 4096 or n <= 2048 else 512, "num_warps": 4}
    if num_rows <= GEMV_MAX_ROWS and n <= 2048:
        return {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``."""
    out = gemv(x, weight, bias)
    return out if out is not None else F.linear(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``x @ weight^T + bias`` (in ``out_dtype``, default ``x.dtype``) by the matrix-vector
    kernel, or None where it does not apply (then the caller runs cuBLAS)."""
    if not (x.is_cuda and envs.get("BASTION_GEMV") and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(-1) == 1):
        return None
    rows = x.reshape(-1, x.shape[-1])
    config = gemv_config(rows.shape[0], weight.shape[0], weight.shape[1])
    launcher = triton_launcher("gemv", "gemv_triton") if config is not None else None
    if launcher is None:
        return None
    out = launcher(rows if rows.stride(-1) == 1 else rows.contiguous(), weight, bias, config,
                   out_dtype)
    return out.view(*x.shape[:-1], weight.shape[0])
