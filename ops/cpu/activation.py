"""The launcher of ``activation.c``: SiLU-and-multiply of float32 CPU rows."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bastion.ops.cpu import cpu_kernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I64, _I64, _I64, _P, ctypes.c_int)


def _kernel() -> Callable[..., None] | None:
    return cpu_kernel("activation", "silu_and_mul_f32", _ARGTYPES)


def can_run(x: torch.Tensor) -> bool:
    """Whether the C kernel takes ``x``: float32 CPU rows of unit stride and even width, and
    the kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1
            and x.shape[-1] % 2 == 0 and x.stride(-1) == 1 and _kernel() is not None)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul_ref(x)``: [..., 2I] -> [..., I]. Check ``can_run`` first (2-D inputs skip
    the reshapes: at a decode row the launch, not the arithmetic, is the cost)."""
    half = x.shape[-1] // 2
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        raise ValueError("silu_and_mul rows need unit stride")
    out = torch.empty((rows.shape[0], half), dtype=torch.float32)
    if rows.shape[0]:
        _kernel()(rows.data_ptr(), rows.stride(0), rows.shape[0], half, out.data_ptr(),
                  torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], half)
