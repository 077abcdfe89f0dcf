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
    ``(norm(x + residual), x + residual)``. Check ``can_run`` first.

    NOTE: a decode row's norm is about a microsecond of arithmetic; the launch is what costs
    (ctypes 3 us, each tensor op 1-2 us), so 2-D inputs skip the reshapes and both outputs of
    the fused form come from one allocation."""
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match rows of {width}")
    rows = x if x.dim() == 2 else x.reshape(-1, width)
    if rows.stride(-1) != 1:
        raise ValueError("RMSNorm rows need unit stride")
    num_rows = rows.shape[0]
    if residual is None:
        out = torch.empty((num_rows, width), dtype=torch.float32)
        if num_rows:
            _kernel()(rows.data_ptr(), rows.stride(0), None, 0, None, weight.data_ptr(), eps,
                      num_rows, width, out.data_ptr(), torch.get_num_threads())
        return out if x.dim() == 2 else out.view(x.shape)
    if residual.shape != x.shape or residual.dtype != torch.float32:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} float32")
    res_rows = residual if residual.dim() == 2 else residual.reshape(-1, width)
    if res_rows.stride(-1) != 1:
        res_rows = res_rows.contiguous()
    both = torch.empty((2, num_rows, width), dtype=torch.float32)  # [norm, new residual]
    if num_rows:
        base = both.data_ptr()
        _kernel()(rows.data_ptr(), rows.stride(0), res_rows.data_ptr(), res_rows.stride(0),
                  base + 4 * num_rows * width, weight.data_ptr(), eps, num_rows, width, base,
                  torch.get_num_threads())
    out, new_residual = both.unbind(0)
    if x.dim() != 2:
        out, new_residual = out.view(x.shape), new_residual.view(x.shape)
    return out, new_residual
