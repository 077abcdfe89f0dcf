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
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block and Q4_K's sub-block
_INNER_K_TILES = 2  # the packing's K tiling (K must be a multiple of 16 * this)


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
    """``F.linear`` over the layer's dense ``weight``."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    @property
    def weight_bytes(self) -> int:
        return 0  # counted from the layer's own parameters


UNQUANTIZED = UnquantizedLinearMethod()


def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU runs bfloat16 natively (AVX512-BF16 or AMX), where the weight-only
    kernels are fast; without it PyTorch emulates bfloat16 and the quantized path is not the
    faster one."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _matmul_2d(x: torch.Tensor, out_features: int, mm) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    return mm(rows).to(x.dtype).view(*x.shape[:-1], out_features)


class Int4WeightOnlyMethod:
    """4-bit weights, one bfloat16 (scale, zero) per 32 input features of each output row."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor) -> None:
        # packed [N, K / 2] uint8 (torch's CPU int4 layout), scales_zeros [K / 32, N, 2] bf16
        self.packed = packed
        self.scales_zeros = scales_zeros
        self.out_features = scales_zeros.shape[1]

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> Int4WeightOnlyMethod:
        """``codes`` [N, K] in 0..15, ``scale`` and ``zero`` [N, K / 32] (any float dtype):
        ``w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]``."""
        n, k = codes.shape
        if k % (16 * _INNER_K_TILES) or scale.shape != (n, k // INT4_GROUP_SIZE):
            raise ValueError(
                f"int4 weights need K a multiple of {16 * _INNER_K_TILES} and one "
                f"scale per {INT4_GROUP_SIZE} columns; got codes {tuple(codes.shape)}"
                f", scales {tuple(scale.shape)}"
            )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), _INNER_K_TILES
        )
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
        return cls(packed, scales_zeros.contiguous())

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = _matmul_2d(
            x,
            self.out_features,
            lambda rows: torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed, INT4_GROUP_SIZE, self.scales_zeros
            ),
        )
        return y if bias is None else y + bias

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


class Int8WeightOnlyMethod:
    """int8 weights with one bfloat16 scale per output row: ``w[n, k] = q[n, k] * scale[n]``."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = weight.contiguous()  # [N, K] int8
        self.scales = scales.to(torch.bfloat16).contiguous()  # [N]
        self.out_features = weight.shape[0]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = _matmul_2d(
            x,
            self.out_features,
            lambda rows: torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales),
        )
        return y if bias is None else y + bias

    @property
    def weight_bytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes
