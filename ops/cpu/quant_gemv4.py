"""The launcher of ``quant_gemv4.c``: decode rows (at most ``MAX_ROWS``) of float32 activations
times int4 weights in groups of 32 with a bfloat16 (scale, zero) per group, the activations
quantized to int8 per group (llama.cpp's scheme); ``pack_q4`` builds the kernel's weight layout
and ``q4_gemv_ref`` is the same arithmetic in float64 (tests)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from bastion.ops.cpu import cpu_kernel, is_enabled

MAX_ROWS = 8  # Q4_MAX_ROWS in the C file
GROUP = 32
_LANES = 16  # groups a block of the layout

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I64, _I64, _P, _I64, _I64, _P, _I64, ctypes.c_int)


def _kernel() -> Callable[..., int] | None:
    # NOTE: called 120 times a token (every int4 layer of SmolLM2): the switch is read at every
    # call, the binding once; cpu_kernel's own lookups cost a microsecond or two a call.
    return _bound() if is_enabled() else None


@functools.cache
def _bound() -> Callable[..., int] | None:
    """The vectorized kernel, or None (asked only while the C kernels are on)."""
    kernel = cpu_kernel("quant_gemv4", "q4_gemv_f32", _ARGTYPES, ctypes.c_int)
    probe = cpu_kernel("quant_gemv4", "q4_gemv_is_vectorized", (), ctypes.c_int)
    # Built without AVX-512 VNNI the library has no loop at all (a scalar one would be slower
    # than torch's kernel).
    return kernel if kernel is not None and probe is not None and probe() else None


def is_available() -> bool:
    """Whether the kernel is built and vectorized (whether ``pack_q4``'s layout is worth holding)."""
    return _kernel() is not None


def can_run(x: torch.Tensor) -> bool:
    """Whether the C kernel takes these rows: float32 on the CPU, 1 to ``MAX_ROWS`` of them,
    and the library built with AVX-512 VNNI."""
    k = x.shape[-1] if x.dim() else 0
    return (x.dtype == torch.float32 and x.is_cpu and k > 0
            and 1 <= x.numel() // k <= MAX_ROWS and _kernel() is not None)


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes`` [N, K] in 0..15, ``scale`` and ``zero`` [N, K / 32] (rounded to bfloat16) ->
    the kernel's layout, uint8 [N, 20 * K / 32] (quant_gemv4.c's header): per block of up to 16
    groups, code byte ``4 T i + 4 l + b`` = code ``8 i + b`` of group l | code ``8 i + 4 + b``
    << 4, then the T scales and T zeros as bfloat16 bits."""
    n, k = codes.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"int4 packing needs K a multiple of {GROUP} and one scale and zero per "
                         f"group; got codes {tuple(codes.shape)}, scales {tuple(scale.shape)}")
    num_groups = k // GROUP
    # [N, G, i, half, b]: code 8 i + 4 half + b of each group.
    c = codes.to(torch.uint8).reshape(n, num_groups, 4, 2, 4)
    pairs = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [N, G, i, b]
    bits = lambda t: t.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, num_groups, 2)
    s, z = bits(scale), bits(zero)
    parts = []
    for g0 in range(0, num_groups, _LANES):
        g1 = min(g0 + _LANES, num_groups)
        parts += [pairs[:, g0:g1].permute(0, 2, 1, 3).reshape(n, -1),  # [N, i, l, b]
                  s[:, g0:g1].reshape(n, -1), z[:, g0:g1].reshape(n, -1)]
    return torch.cat(parts, dim=1).contiguous()


def q4_gemv(x: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` [M, K] float32 (rows of unit stride) times the ``pack_q4`` weight [N, 20 K / 32] ->
    [M, N] float32, each row's activations quantized to int8 per 32 (``q4_gemv_ref``). Check
    ``can_run`` first."""
    m = x.shape[0]
    if (x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != k or x.stride(1) != 1
            or not 1 <= m <= MAX_ROWS or k % GROUP or packed.dtype != torch.uint8
            or packed.dim() != 2 or packed.shape[1] != 20 * (k // GROUP)
            or not packed.is_contiguous()):
        raise ValueError(
            f"int4 GEMV takes 1-{MAX_ROWS} float32 rows of K={k} (a multiple of {GROUP}) "
            f"unit-stride columns and a contiguous uint8 pack_q4 weight [N, {20 * k // GROUP}]; "
            f"got x {tuple(x.shape)} {x.dtype} strides {x.stride()}, weight "
            f"{tuple(packed.shape)} {packed.dtype}")
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    # can_run has read the switch: the binding alone here (reading the environment costs ~1 us).
    kernel = _bound()
    if kernel is None:
        raise RuntimeError("the C int4 kernel is not built (check can_run first)")
    status = kernel(x.data_ptr(), m, x.stride(0), packed.data_ptr(), n, k, out.data_ptr(),
                       n, torch.get_num_threads())
    if status:
        raise MemoryError(f"int4 GEMV: no memory for {m} quantized rows of {k}")
    return out


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in float32: (int8 codes [M, K], scales d [M, K/32]),
    ``d = max |x| / 127`` and ``xq = round(x * (127 / max |x|))`` per group, ties to even."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax == 0, torch.ones_like(amax), amax)
    inv = torch.where(amax == 0, torch.zeros_like(amax), torch.full_like(amax, 127.0) / safe)
    xq = torch.round(groups * inv).to(torch.int8).reshape(x.shape)
    return xq, (amax / 127.0).squeeze(-1)


def q4_gemv_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: ``sum_g (s d) * sum_k q xq + (z - 8 s) * sum_k x``
    with s, z the bfloat16-rounded scale and zero [N, K/32]; [M, N] float64."""
    m, k = x.shape
    xq, d = quantize_rows_ref(x)
    s, z = (t.to(torch.bfloat16).double() for t in (scale, zero))
    dots = torch.einsum("mgk,ngk->mng", xq.double().reshape(m, -1, GROUP),
                        codes.double().reshape(codes.shape[0], -1, GROUP))
    sums = x.double().reshape(m, -1, GROUP).sum(dim=-1)  # [M, G]
    return (dots * s[None] * d.double()[:, None]).sum(-1) + sums @ (z - 8 * s).t()
