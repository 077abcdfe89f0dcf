"""The launcher of ``decoder_layers.c``: a decode step of 1 to ``MAX_ROWS`` float32 rows
through a stack of Llama decoder layers with int4 (``pack_q4``) weights and the final norm, in
one call. ``DecoderStack`` checks the weights once and holds the C table of their pointers, so a
step costs one ctypes call and a few attribute reads."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from bastion.ops.attention_metadata import AttentionMetadata
from bastion.ops.cpu import bind_vectorized, is_enabled, quant_gemv4

# The C call multiplies up to 8 rows at a time (quant_gemv4's MAX_ROWS), 16 in two passes over
# the weights. NOTE: from 8 rows up the op-by-op path's linear layers take the dense bfloat16
# GEMM instead (layers/quantization.py's DENSE_MIN_ROWS); at 16 rows the fused call measured
# as fast at one thread and 1.4x at two (scripts/bench_cpu.py), past that the GEMM's AMX wins
# as the passes over the weights add up.
MAX_ROWS = 16

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up",
                                        "down", "k_cache", "v_cache")]


class _Shape(ctypes.Structure):
    _fields_ = [*((name, _I64) for name in (
        "hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "intermediate_size",
        "rotary_dim", "max_position", "block_size", "num_cache_blocks")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("levels", ctypes.c_int),
        ("cos_sin", _P), ("final_norm", _P)]


_ARGTYPES = (ctypes.POINTER(_Shape), ctypes.POINTER(_Layer), _I64, _P, _I64, _P, _P, _P, _I64,
             _I64, _P, _P, _I64, _P, ctypes.c_int)
# Linked with quant_gemv4's object: without AVX-512 VNNI its probe says 0 and nothing runs.
_KERNEL = ("decoder_layers", "decoder_layers_f32", _ARGTYPES, _I64, "q4_gemv_is_vectorized")


class LayerWeights(NamedTuple):
    """One decoder layer as the C call reads it: float32 norm weights [H], ``pack_q4`` int4
    weights (qkv [Hq D + 2 Hk D, 20 H / 32], o [H, 20 Hq D / 32], gate_up [2 I, 20 H / 32],
    down [H, 20 I / 32]) and the layer's float32 caches [num_blocks, block_size, Hk, D]."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def kernel() -> Callable[..., int] | None:
    """The C function, or None when the C kernels are off or it is not built vectorized."""
    return bind_vectorized(*_KERNEL) if is_enabled() else None


class DecoderStack:
    """Decoder layers (``LayerWeights``, in order) and the final norm, for ``run``.

    ValueError when a weight's shape, dtype or layout is not what the C call reads."""

    def __init__(self, layers: Sequence[LayerWeights], final_norm: torch.Tensor, *,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
                 cos_sin_cache: torch.Tensor, levels: int) -> None:
        hidden = final_norm.shape[0]
        inter = layers[0].down.shape[1] * quant_gemv4.GROUP // 20
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        cache_shape = layers[0].k_cache.shape
        packed = {"qkv": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size),
                  "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        for i, layer in enumerate(layers):
            for name, (n, k) in packed.items():
                t = getattr(layer, name)
                if (t.dtype != torch.uint8 or not t.is_contiguous() or k % quant_gemv4.GROUP
                        or t.shape != (n, 20 * k // quant_gemv4.GROUP)):
                    raise ValueError(f"layer {i}: {name} must be a contiguous pack_q4 uint8 "
                                     f"[{n}, {20 * k // quant_gemv4.GROUP}]; got "
                                     f"{tuple(t.shape)} {t.dtype}")
            for name in ("input_norm", "post_norm"):
                t = getattr(layer, name)
                if t.dtype != torch.float32 or t.shape != (hidden,) or not t.is_contiguous():
                    raise ValueError(f"layer {i}: {name} must be float32 [{hidden}]")
            for t in (layer.k_cache, layer.v_cache):
                if (t.dtype != torch.float32 or not t.is_contiguous() or t.shape != cache_shape
                        or cache_shape[2:] != (num_kv_heads, head_dim)):
                    raise ValueError(f"layer {i}: caches must be contiguous float32 "
                                     f"[blocks, block_size, {num_kv_heads}, {head_dim}] like "
                                     f"layer 0's {tuple(cache_shape)}")
        rotary_dim = cos_sin_cache.shape[1]
        if (cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()
                or rotary_dim > head_dim or rotary_dim % 2 or num_q_heads % num_kv_heads
                or final_norm.dtype != torch.float32 or not final_norm.is_contiguous()):
            raise ValueError("decoder stack needs a contiguous float32 cos_sin_cache of an even "
                             f"width up to the head size {head_dim}, query heads a multiple of "
                             "the KV heads and a contiguous float32 final norm")
        self.layers = tuple(layers)  # keeps every pointer of the table alive
        self.final_norm, self.cos_sin_cache = final_norm, cos_sin_cache
        self.hidden_size = hidden
        self._shape = _Shape(hidden, num_q_heads, num_kv_heads, head_dim, inter, rotary_dim,
                             cos_sin_cache.shape[0], cache_shape[1], cache_shape[0], eps, scale,
                             levels, cos_sin_cache.data_ptr(), final_norm.data_ptr())
        self._table = (_Layer * len(layers))(*(_Layer(*(t.data_ptr() for t in layer))
                                               for layer in layers))

    def run(self, hidden: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """``hidden`` [M, H] float32 embeddings of a pure decode step (row i: the one new token
        of sequence i, 1 <= M <= ``MAX_ROWS``; overwritten) -> the final norm's output [M, H].
        Stores each layer's keys and values at ``meta.slot_mapping``. ValueError when a
        position, slot, length or block id points outside the tables and caches."""
        num_rows = hidden.shape[0]
        tables = meta.block_tables
        if (not 1 <= num_rows <= MAX_ROWS or meta.num_seqs != num_rows
                or meta.max_query_len != 1 or hidden.shape[1] != self.hidden_size
                or hidden.dtype != torch.float32 or not hidden.is_contiguous()
                or positions.dtype != torch.int64 or not positions.is_contiguous()
                or positions.shape[0] != num_rows or meta.slot_mapping.shape[0] != num_rows
                or meta.slot_mapping.dtype != torch.int64
                or not meta.slot_mapping.is_contiguous() or tables.dtype != torch.int32
                or tables.stride(-1) != 1 or meta.seq_lens.dtype != torch.int32
                or meta.query_start_loc.dtype != torch.int32):
            raise ValueError(f"a fused decode step takes 1-{MAX_ROWS} float32 rows of "
                             f"{self.hidden_size}, one new token per sequence, int64 positions "
                             f"and slots and int32 tables; got hidden {tuple(hidden.shape)} "
                             f"{hidden.dtype}, {meta.num_seqs} sequences")
        out = torch.empty_like(hidden)
        status = bind_vectorized(*_KERNEL)(
            ctypes.byref(self._shape), self._table, len(self.layers), hidden.data_ptr(),
            num_rows, positions.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(),
            tables.stride(0), tables.shape[1], meta.seq_lens.data_ptr(),
            meta.query_start_loc.data_ptr(), meta.max_seq_len, out.data_ptr(),
            torch.get_num_threads())
        if status == -2:
            raise MemoryError(f"fused decode: no memory for {num_rows} rows")
        if status:
            raise ValueError(
                f"fused decode: {status} tokens or (sequence, KV head) pairs point outside the "
                f"tables: a position past the rotary table's {self._shape.max_position}, a slot "
                f"past the cache, a length outside [1, {meta.max_seq_len}] or past its table, "
                "or a block id outside the cache")
        return out
