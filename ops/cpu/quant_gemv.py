"""The launcher of ``quant_gemv.c``: decode rows (at most ``MAX_ROWS``) of float32 activations
times int8 weights with one bfloat16 scale per output row (a GGUF LM head kept quantized)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bastion.ops.cpu import vectorized_kernel

MAX_ROWS = 8  # QGEMV_MAX_ROWS in the C file

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, ctypes.c_int)


def _kernel() -> Callable[..., int] | None:
    """Built with AVX-512 only: its scalar fallback is slower than torch's own kernel."""
    return vectorized_kernel("quant_gemv", "q8_gemv_f32", _ARGTYPES, ctypes.c_int,
                             "q8_gemv_is_vectorized")


def can_run(x: torch.Tensor) -> bool:
    """Whether the C kernel takes these rows: float32 on the CPU, 1 to ``MAX_ROWS`` of them,
    and the library built with AVX-512."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (x.device.type == "cpu" and x.dtype == torch.float32 and 1 <= rows <= MAX_ROWS
            and _kernel() is not None)


def q8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 (rows of unit stride) times int8 ``weight`` [N, K] with bfloat16
    ``scales`` [N] -> [M, N] float32: ``x @ (weight * scales[:, None])^T``. Check ``can_run``
    first."""
    n, k = weight.shape
    if (x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != k or x.stride(1) != 1
            or not 1 <= x.shape[0] <= MAX_ROWS):
        raise ValueError(f"int8 GEMV takes 1-{MAX_ROWS} float32 rows of {k} unit-stride columns; "
                         f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    if (weight.dtype != torch.int8 or not weight.is_contiguous() or scales.shape != (n,)
            or scales.dtype != torch.bfloat16 or not scales.is_contiguous()):
        raise ValueError("int8 GEMV needs a contiguous int8 weight [N, K] and bfloat16 scales [N]")
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    _kernel()(x.data_ptr(), x.shape[0], x.stride(0), weight.data_ptr(), scales.data_ptr(), n, k,
              out.data_ptr(), n, torch.get_num_threads())
    return out
