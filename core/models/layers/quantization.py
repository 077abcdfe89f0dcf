"""How a linear layer multiplies by its weight (vLLM's ``quant_method`` pattern).

Every linear layer calls ``self.quant_method.apply(self, x, bias)`` for its base matmul. The
default reads the layer's dense ``weight``; the two weight-only methods here hold GGUF weights
kept quantized on the CPU and multiply with PyTorch's own kernels:

- ``Int4WeightOnlyMethod``: ``_weight_int4pack_mm_for_cpu``, 4-bit codes in groups of 32 input
  features with one (scale, zero) pair per group, ``w = (q - 8) * scale + zero``;
- ``Int8WeightOnlyMethod``: ``_weight_int8pack_mm``, int8 codes with one scale per output row.

# NOTE: in torch 2.13's CPU build both kernels are vectorized for bfloat16 activations only:
float32 and float16 inputs take a scalar fallback 20-70x slower (SmolLM2's 960 x 576 QKV at batch
1: 0.05 ms in bfloat16, 1.7 ms in float32). The methods therefore cast their input to bfloat16
and their output back to the caller's dtype; the scales and zeros are bfloat16 too, as the
kernels require them in the activations' dtype.

Float32 decode rows of the int8 method take the C kernel of ``ops/cpu/quant_gemv.c`` instead
when it is built (AVX-512): float32 activations, no casts, and 2-3x faster than torch's kernel
on SmolLM2's LM head at one row (docs/BENCHMARKS.md). Those of the int4 method take
``ops/cpu/quant_gemv4.c`` (AVX-512 VNNI, llama.cpp's scheme): float32 in and out, the
activations quantized per 32 inside the kernel, to 16-bit integers by default (below bfloat16's
rounding: the embedded model's logprobs move as little as with torch's bfloat16 casts,
tests/test_quantized.py) or to int8 (``BASTION_CPU_INT4_LEVELS=1``), the weights in its own
layout, built here at load.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from bastion import envs
from bastion.ops.cpu import quant_gemv, quant_gemv4
from bastion.ops.linear import linear
from torch import nn

INT4_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block and Q4_K's sub-block
_INNER_K_TILES = 2  # the packing's K tiling (K must be a multiple of 16 * this)
DENSE_MIN_ROWS = 8  # from here up the dense bfloat16 GEMM beats the weight-only kernels


class LinearMethod(Protocol):
    """The base matmul of a linear layer: ``x [..., K] -> [..., N]`` (plus ``bias``)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    @property
    def weight_bytes(self) -> int:
        """Bytes read from memory per forward pass (the decode floor's numerator)."""
        ...


class UnquantizedLinearMethod:
    """``F.linear`` over the layer's dense ``weight`` (decode rows on CUDA may take the
    matrix-vector kernel: ``bastion.ops.linear``)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    @property
    def weight_bytes(self) -> int:
        return 0  # counted from the layer's own parameters


UNQUANTIZED = UnquantizedLinearMethod()


def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU runs bfloat16 natively (AVX512-BF16 or AMX), where the weight-only
    kernels are fast; without it PyTorch emulates bfloat16 and the quantized path is not the
    faster one."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class _WeightOnlyMethod:
    """Shared by both formats: below ``DENSE_MIN_ROWS`` input rows (decode) the weight-only
    kernel reads the quantized weight; from there up (prefill, large decode batches) a bfloat16
    copy of the same dequantized weight goes through the dense bfloat16 GEMM (AMX), since the
    weight-only kernels are compute-bound there: 3072 x 576 at 256 rows, int4 51 ms, float32
    28 ms, bfloat16 1.5 ms (docs/BENCHMARKS.md). Both paths multiply by the same bfloat16
    weights."""

    out_features: int
    dense: torch.Tensor  # [N, K] bfloat16

    def _mm(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` [M, K] (fewer than ``DENSE_MIN_ROWS``) through the format's C decode kernel,
        float32 in and out, or None where it does not run (then torch's kernel does)."""
        return None

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = x.shape[-1]
        if x.numel() < DENSE_MIN_ROWS * k:
            # NOTE: 120 int4 calls a token at batch 1: a 2-D input (the decode rows) skips the
            # reshape and view, ~2 us each on a loaded machine.
            y = self._decode_rows(x if x.dim() == 2 else x.reshape(-1, k))
            if y is not None:
                if x.dim() != 2:
                    y = y.view(*x.shape[:-1], self.out_features)
                return y if bias is None else y + bias
        rows = x.reshape(-1, k).to(torch.bfloat16)
        y = F.linear(rows, self.dense) if rows.shape[0] >= DENSE_MIN_ROWS else self._mm(rows)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias


class Int4WeightOnlyMethod(_WeightOnlyMethod):
    """4-bit weights, one bfloat16 (scale, zero) per 32 input features of each output row:
    ``w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]``."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """``codes`` [N, K] in 0..15, ``scale`` and ``zero`` [N, K / 32] (any float dtype)."""
        n, k = codes.shape
        if k % (16 * _INNER_K_TILES) or scale.shape != (n, k // INT4_GROUP_SIZE):
            raise ValueError(
                f"int4 weights need K a multiple of {16 * _INNER_K_TILES} and one "
                f"scale per {INT4_GROUP_SIZE} columns; got codes {tuple(codes.shape)}"
                f", scales {tuple(scale.shape)}"
            )
        self.out_features = n
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), _INNER_K_TILES
        )  # [N, K / 2] uint8 in torch's own CPU layout
        scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
        # The C decode kernel's layout (20 bytes a group), only where that kernel is built.
        self.q4 = quant_gemv4.pack_q4(codes, scale, zero) if quant_gemv4.is_available() else None
        self.q4_levels = envs.get("BASTION_CPU_INT4_LEVELS")  # read once: 120 calls a token
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
        # The kernel's own arithmetic: float32 from the bfloat16 scale and zero, rounded once;
        # each group's scale and zero broadcast over its 32 columns (no expanded copies: this
        # runs for every layer at every load, a restart's included).
        groups = (n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        dense = codes.reshape(groups).to(torch.float32) - 8
        dense.mul_(scale.float()[..., None]).add_(zero.float()[..., None])
        self.dense = dense.view(n, k).to(torch.bfloat16)

    def _decode_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        if self.q4 is None or not quant_gemv4.can_run(rows):
            return None
        return quant_gemv4.q4_gemv(rows if rows.stride(-1) == 1 else rows.contiguous(),
                                   self.q4, rows.shape[1], self.q4_levels)

    def _mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, INT4_GROUP_SIZE, self.scales_zeros
        )

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


class Int8WeightOnlyMethod(_WeightOnlyMethod):
    """int8 weights with one bfloat16 scale per output row: ``w[n, k] = q[n, k] * scale[n]``."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = weight.contiguous()  # [N, K] int8
        self.scales = scales.to(torch.bfloat16).contiguous()  # [N]
        self.out_features = weight.shape[0]
        self.dense = (self.weight.float() * self.scales.float()[:, None]).to(torch.bfloat16)

    def _decode_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        if rows.shape[1] != self.weight.shape[1] or not quant_gemv.can_run(rows):
            return None
        return quant_gemv.q8_gemv(rows if rows.stride(-1) == 1 else rows.contiguous(),
                                  self.weight, self.scales)

    def _mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)

    @property
    def weight_bytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes
