"""The launcher of ``argmax.c``: greedy sampling's row-wise argmax of float32 logits."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bastion.ops.cpu import cpu_kernel

_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int)


def _kernel() -> Callable[..., None] | None:
    return cpu_kernel("argmax", "argmax_rows_f32", _ARGTYPES)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [N, V] logits, the same indices (the first maximum; a NaN
    beats everything), through the C kernel for float32 CPU rows of unit stride and through
    torch for anything else."""
    kernel = (_kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32
              and logits.dim() == 2 and logits.stride(-1) == 1 and logits.numel() else None)
    if kernel is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
           out.data_ptr(), torch.get_num_threads())
    return out
