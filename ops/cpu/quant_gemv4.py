"""The launcher of ``quant_gemv4.c``: decode rows (at most ``MAX_ROWS``) of float32 activations
times int4 weights in groups of 32 with a bfloat16 (scale, zero) per group, the activations
quantized per group inside the kernel (llama.cpp's scheme; 16-bit integers by default, int8 at
``levels=1``); ``pack_q4`` builds the kernel's weight layout and ``q4_gemv_ref`` is the same
arithmetic in float64 (tests)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bastion.ops.cpu import bind_vectorized, vectorized_kernel

MAX_ROWS = 8  # Q4_MAX_ROWS in the C file
GROUP = 32
_TINY = 1e-30  # Q4_TINY in the C file
LEVEL_TOPS = {1: 127.0, 2: 127.0 * 256}  # the largest |xq| of a group, by levels
_LANES = 16  # groups a block of the layout
_MAX_LANES_PER_ROW = 8  # MAX_LANES_PER_ROW in the C file

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I64, _I64, _P, _I64, _I64, ctypes.c_int, _P, _I64, ctypes.c_int)
# Built without AVX-512 VNNI the library has no loop at all (a scalar one would be slower than
# torch's kernel): the probe says so.
_KERNEL = ("quant_gemv4", "q4_gemv_f32", _ARGTYPES, ctypes.c_int, "q4_gemv_is_vectorized")


def _kernel() -> Callable[..., int] | None:
    # NOTE: called 120 times a token (every int4 layer of SmolLM2).
    return vectorized_kernel(*_KERNEL)


def is_available() -> bool:
    """Whether the kernel is built and vectorized (whether ``pack_q4``'s layout is worth holding)."""
    return _kernel() is not None


def can_run(x: torch.Tensor) -> bool:
    """Whether the C kernel takes these rows: float32 on the CPU, 1 to ``MAX_ROWS`` of them,
    and the library built with AVX-512 VNNI."""
    k = x.shape[-1] if x.dim() else 0
    return (x.dtype == torch.float32 and x.is_cpu and k > 0
            and 1 <= x.numel() // k <= MAX_ROWS and _kernel() is not None)


def lanes_per_row(k: int) -> int:
    """The lanes of a 16-lane block one output row takes: the largest power of two <= 8 that
    divides the row's K / 32 groups (``q4_lanes_per_row`` in the C file); a tile is 16 / that
    many output rows, and N must be a multiple of it."""
    lanes = _MAX_LANES_PER_ROW
    while (k // GROUP) % lanes:
        lanes //= 2
    return lanes


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes`` [N, K] in 0..15, ``scale`` and ``zero`` [N, K / 32] (rounded to bfloat16) ->
    the kernel's layout (quant_gemv4.c's header), uint8 [N, 20 K / 32]: tiles of R = 16 / L
    output rows, each G / L blocks of 4 x 64 code bytes (byte ``64 i + 4 (r L + l) + b`` = code
    ``8 i + b`` | code ``8 i + 4 + b`` << 4 of group ``b L + l`` of row r), 16 bfloat16 scales
    and 16 bfloat16 zeros in the same lane order."""
    n, k = codes.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"int4 packing needs K a multiple of {GROUP} and one scale and zero per "
                         f"group; got codes {tuple(codes.shape)}, scales {tuple(scale.shape)}")
    lanes = lanes_per_row(k)
    rows = _LANES // lanes
    if n % rows:
        raise ValueError(f"int4 packing of K={k} ({k // GROUP} groups) takes tiles of {rows} "
                         f"rows: N must be a multiple of {rows}; got {n}")
    num_groups, num_tiles, num_blocks = k // GROUP, n // rows, k // GROUP // lanes
    # [tile, r, block, l, i, half, b]: code 8 i + 4 half + b of group (block, l) of row r.
    c = codes.to(torch.uint8).reshape(num_tiles, rows, num_blocks, lanes, 4, 2, 4)
    pairs = c[..., 0, :] | (c[..., 1, :] << 4)  # [tile, r, block, l, i, b]
    code_bytes = pairs.permute(0, 2, 4, 1, 3, 5).reshape(num_tiles, num_blocks, 256)

    def lane_bits(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [tile, block, 32] bytes
        t = t.to(torch.bfloat16).reshape(num_tiles, rows, num_blocks, lanes).permute(0, 2, 1, 3)
        return t.contiguous().view(torch.uint8).reshape(num_tiles, num_blocks, 2 * _LANES)

    packed = torch.cat([code_bytes, lane_bits(scale), lane_bits(zero)], dim=-1)
    return packed.reshape(n, 20 * num_groups).contiguous()


def q4_gemv(x: torch.Tensor, packed: torch.Tensor, k: int, levels: int = 2) -> torch.Tensor:
    """``x`` [M, K] float32 (rows of unit stride) times the ``pack_q4`` weight [N, 20 K / 32] ->
    [M, N] float32, each row's activations quantized per 32 (``q4_gemv_ref``): ``levels`` 1 to
    int8 (llama.cpp's Q8 activations), 2 to 16-bit integers (``LEVEL_TOPS``) taken as two int8
    digits, twice the dot products and far below bfloat16's rounding. Check ``can_run`` first."""
    if levels not in LEVEL_TOPS:
        raise ValueError(f"int4 GEMV levels must be 1 (int8 activations) or 2 (int16); got {levels}")
    m = x.shape[0]
    if (packed.shape[0] % (_LANES // lanes_per_row(k)) or x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != k or x.stride(1) != 1
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
    kernel = bind_vectorized(*_KERNEL)
    if kernel is None:
        raise RuntimeError("the C int4 kernel is not built (check can_run first)")
    status = kernel(x.data_ptr(), m, x.stride(0), packed.data_ptr(), n, k, levels,
                    out.data_ptr(), n, torch.get_num_threads())
    if status:
        raise MemoryError(f"int4 GEMV: no memory for {m} quantized rows of {k}")
    return out


def quantize_rows_ref(x: torch.Tensor, levels: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in float32: (integer codes [M, K] as int32, scales
    d [M, K/32]), ``d = max |x| / top`` and ``xq = round(x * (top / max |x|))`` per group, ties
    to even, ``top = LEVEL_TOPS[levels]``; a group with max |x| <= 1e-30 quantizes to 0."""
    top = LEVEL_TOPS[levels]
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    zero = amax <= _TINY  # all zeros, or too small for top / max |x| (Q4_TINY in the C file)
    inv = torch.where(zero, 0.0, torch.full_like(amax, top) / torch.where(zero, 1.0, amax))
    xq = torch.round(groups * inv).to(torch.int32).reshape(x.shape)
    return xq, torch.where(zero, 0.0, amax / top).squeeze(-1)


def q4_gemv_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                levels: int = 2) -> torch.Tensor:
    """The kernel's arithmetic in float64: ``sum_g (s d) * sum_k q xq + (z - 8 s) * sum_k x``
    with s, z the bfloat16-rounded scale and zero [N, K/32]; [M, N] float64."""
    m = x.shape[0]
    xq, d = quantize_rows_ref(x, levels)
    s, z = (t.to(torch.bfloat16).double() for t in (scale, zero))
    dots = torch.einsum("mgk,ngk->mng", xq.double().reshape(m, -1, GROUP),
                        codes.double().reshape(codes.shape[0], -1, GROUP))
    sums = x.double().reshape(m, -1, GROUP).sum(dim=-1)  # [M, G]
    return (dots * s[None] * d.double()[:, None]).sum(-1) + sums @ (z - 8 * s).t()
