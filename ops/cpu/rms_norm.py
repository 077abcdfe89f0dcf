"""The launcher of ``rms_norm.c``: RMS normalisation of float32 CPU rows, alone or fused with
the residual add."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bastion.ops.cpu import cpu_kernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I64, _P, _I64, _P, _P, ctypes.c_float, _I64, _I64, _P, ctypes.c_int)


def _kernel() -> Callable[..., None] | None:
    return cpu_kernel("rms_norm", "rms_norm_f32", _ARGTYPES)


def can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the C kernel takes ``x``: float32 CPU rows of unit stride, a float32 weight, and
    the kernel built."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() >= 1
            and x.stride(-1) == 1 and weight.is_contiguous() and _kernel() is not None)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_ref(x, weight, eps)``, or with ``residual`` ``fused_add_rms_norm_ref``'s
    ``(norm(x + residual), x + residual)``. Check ``can_run`` first."""
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match rows of {width}")
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        raise ValueError("RMSNorm rows need unit stride")
    out = torch.empty(rows.shape, dtype=torch.float32)
    res_rows = new_residual = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != torch.float32:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} float32")
        res_rows = residual.reshape(-1, width)
        if res_rows.stride(-1) != 1:
            res_rows = res_rows.contiguous()
        new_residual = torch.empty(rows.shape, dtype=torch.float32)
    if rows.shape[0]:
        _kernel()(rows.data_ptr(), rows.stride(0),
                  res_rows.data_ptr() if res_rows is not None else None,
                  res_rows.stride(0) if res_rows is not None else 0,
                  new_residual.data_ptr() if new_residual is not None else None,
                  weight.data_ptr(), eps, rows.shape[0], width, out.data_ptr(),
                  torch.get_num_threads())
    out = out.view(x.shape)
    return out if residual is None else (out, new_residual.view(x.shape))
