"""The launcher of ``argmax.c``: greedy sampling's row-wise argmax of float32 logits."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from bastion.ops.cpu import load_cpu_kernel


@functools.cache
def _kernel() -> Callable[..., None] | None:
    lib = load_cpu_kernel("argmax")
    if lib is None:
        return None
    fn = lib.argmax_rows_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return fn


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
