"""GGUF weights kept quantized on the CPU: GGUF blocks -> torch's weight-only formats.

Each 2-D linear weight of a GGUF file becomes one of (layers/quantization.py):

- int4, groups of 32 (``_weight_int4pack_mm_for_cpu``), from Q4_0, Q4_1 and Q4_K, whose blocks
  map onto it without requantizing. Every 32 weights of a row share ``w = a * q + b`` with
  4-bit ``q``: Q4_0 ``a = d, b = -8 d``; Q4_1 ``a = d, b = m``; Q4_K (super-blocks of 256,
  eight sub-blocks of 32 with 6-bit scale ``sc`` and min ``mn``) ``a = d * sc, b = -dmin * mn``.
  Torch's convention is ``w = (q - 8) * scale + zero``, so ``scale = a, zero = b + 8 a``.
  ``a * q + b`` in float32 equals ``gguf.quants.dequantize`` bit for bit; the kernels then hold
  ``scale`` and ``zero`` in bfloat16 (8-bit mantissa against float16's 11), so each weight is off
  by at most ~2^-9 of its group's range.
- int8, one scale per row (``_weight_int8pack_mm``), from every other quantized type (Q8_0,
  Q6_K, Q5_*): torch has no grouped int8 CPU kernel, so the GGUF-dequantized row is requantized
  symmetrically, ``scale = max |w| / 127``. Its error is at most half a step of the row's scale
  (Q8_0 had half a step of its block's); for SmolLM2's Q8_0 embedding (the tied LM head) the
  logits change by less than the bfloat16 activations do (tests/test_quantized.py, BENCHMARKS).
  The int8 kernel reads half the bytes of a bfloat16 copy and runs at the same speed.

Fused layers (QKV, gate/up) concatenate their parts' rows before packing; a fused layer whose
parts are not all int4-able (Q4_K_M files keep ``attn_v`` in Q6_K) becomes int8 as a whole.
F32/F16/BF16 tensors, norms and the embedding table stay dense in the model's dtype.

The decoded codes, scales and zeros are cached beside the float32 conversion (``cpu-weights/``);
torch's packed layout is rebuilt from them at each load (it is torch's own and may change).

Each method also holds a bfloat16 copy of its dequantized weight for the dense GEMM of many-row
inputs (prefill, batches of 8 or more), where the weight-only kernels are compute-bound and 20x
slower (layers/quantization.py): 2 bytes a weight of memory, never read by a batch-1 decode.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from bastion.core.loader.gguf_loader import _hf_name, converted_dir
from bastion.core.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from bastion.core.models.layers.quantization import (
    Int4WeightOnlyMethod,
    Int8WeightOnlyMethod,
    LinearMethod,
)
from bastion.core.models.layers.vocab_parallel_embedding import ParallelLMHead
from bastion.core.models.weights import map_weight_name

logger = logging.getLogger(__name__)

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_DENSE_TYPES = ("F32", "F16", "BF16", "F64")
_QUANTIZABLE = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
_SHARD_ORDER = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}


class Int4Codes(NamedTuple):
    """``w[n, k] = scale[n, k // 32] * codes[n, k] + offset[n, k // 32]`` (float32)."""

    codes: np.ndarray  # [N, K] uint8 in 0..15
    scale: np.ndarray  # [N, K / 32] float32
    offset: np.ndarray  # [N, K / 32] float32


class RawTensor(NamedTuple):
    type_name: str  # GGML type: Q4_1, Q8_0, ...
    blocks: np.ndarray  # [N, bytes per row] uint8, rows in Hugging Face order
    shape: tuple[int, int]  # (N, K)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are weights 0-15, the high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_int4(raw: RawTensor) -> Int4Codes:
    """Q4_0 / Q4_1 / Q4_K rows -> 4-bit codes with one (scale, offset) per 32 weights."""
    n, k = raw.shape
    b = raw.blocks.reshape(n, -1)
    if raw.type_name in ("Q4_0", "Q4_1"):
        head = 2 if raw.type_name == "Q4_0" else 4
        b = b.reshape(n, k // 32, head + 16)
        d = _f16(b[..., 0:2]).reshape(n, k // 32)
        codes = _nibbles(b[..., head:])
        offset = -8 * d if raw.type_name == "Q4_0" else _f16(b[..., 2:4]).reshape(n, k // 32)
        return Int4Codes(codes.reshape(n, k), d, offset)
    if raw.type_name != "Q4_K":
        raise ValueError(f"{raw.type_name} has no int4 form")
    b = b.reshape(n, k // 256, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, S, 1]
    s = b[..., 4:16].astype(np.uint8)
    # 6-bit scales and mins of the 8 sub-blocks: the first four in the low 6 bits of bytes
    # 0-3 / 4-7, the last four split over the nibbles of bytes 8-11 and the top bits of 0-7.
    sc = np.concatenate(
        [s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1
    )
    mn = np.concatenate(
        [s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1
    )
    qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 weights
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [n, S, 4, 2, 32]: sub-blocks 2c, 2c+1
    scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
    offset = -(dmin * mn.astype(np.float32)).reshape(n, k // 32)
    return Int4Codes(codes.reshape(n, k), scale, offset)


def requantize_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float rows [N, K] -> (int8 [N, K], float32 scale [N]): symmetric, one scale a row."""
    scale = np.abs(weight).max(axis=1) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(weight / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def _dequantize(raw: RawTensor) -> np.ndarray:
    from gguf import GGMLQuantizationType, dequantize

    flat = dequantize(raw.blocks, GGMLQuantizationType[raw.type_name])
    return np.asarray(flat, dtype=np.float32).reshape(raw.shape)


def iter_raw_linear_weights(
    path: str, model_type: str, num_heads: int, num_kv_heads: int
) -> dict[str, RawTensor]:
    """The quantized 2-D weights of a GGUF file, by Hugging Face name, still as GGUF blocks
    (q/k rows un-permuted like the float32 conversion does: a row's blocks move as a whole)."""
    from gguf import GGUFReader

    out: dict[str, RawTensor] = {}
    for tensor in GGUFReader(path).tensors:
        type_name = tensor.tensor_type.name
        dims = [int(d) for d in tensor.shape]
        if type_name in _DENSE_TYPES or len(dims) != 2:
            continue
        hf_name, experts = _hf_name(tensor.name)
        if experts:
            continue  # MoE experts stay on the dense path
        n, k = dims[1], dims[0]
        blocks = np.asarray(tensor.data).reshape(n, -1)
        if model_type == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in hf_name else num_kv_heads
            rows = n // heads
            blocks = blocks.reshape(heads, rows // 2, 2, -1).swapaxes(1, 2).reshape(n, -1)
        out[hf_name] = RawTensor(type_name, np.ascontiguousarray(blocks), (n, k))
    return out


def _targets(model: nn.Module, names: list[str], tied: bool) -> dict[str, list[tuple[int, str]]]:
    """Module name -> [(shard order, Hugging Face name)] for every quantized layer."""
    modules = dict(model.named_modules())
    parts: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name in names:
        if name == "model.embed_tokens.weight":
            if tied:
                parts["lm_head"].append((0, name))
            continue
        target, args = map_weight_name(name)
        module = target.removesuffix(".weight")
        # NOTE: not ReplicatedLinear: the MoE router's weight is read directly (router_logits).
        if isinstance(modules.get(module), _QUANTIZABLE):
            parts[module].append((_SHARD_ORDER[args[0]] if args else 0, name))
    return parts


def _build_method(raws: list[RawTensor]) -> tuple[LinearMethod, dict[str, torch.Tensor]]:
    """The fused layer's method and what the cache keeps of it (by suffix): int4 codes two to
    a byte (even column in the low nibble) with float32 scales and zeros, torch's packed
    layout being rebuilt at load; int8 weights with their scales."""
    if all(r.type_name in INT4_TYPES for r in raws) and raws[0].shape[1] % 32 == 0:
        decoded = [decode_int4(r) for r in raws]
        codes = torch.from_numpy(np.concatenate([c.codes for c in decoded]))
        scale = torch.from_numpy(np.concatenate([c.scale for c in decoded]))
        zero = torch.from_numpy(np.concatenate([c.offset + 8 * c.scale for c in decoded]))
        pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
        saved = {"int4_codes": pairs, "int4_scale": scale, "int4_zero": zero}
        return Int4WeightOnlyMethod(codes, scale, zero), saved
    q, scale = requantize_int8(np.concatenate([_dequantize(r) for r in raws]))
    saved = {"int8_weight": torch.from_numpy(q), "int8_scales": torch.from_numpy(scale)}
    return Int8WeightOnlyMethod(saved["int8_weight"], saved["int8_scales"]), saved


class QuantizedLayers(NamedTuple):
    consumed: set[str]  # Hugging Face names the dense loader must skip
    summary: str  # for the start-up line: "Q4_1 -> int4 (210), Q8_0 -> int8 (1)"
    weight_bytes: int  # bytes the quantized layers read per forward pass


def quantize_linear_layers(
    model: nn.Module, gguf_path: str, model_type: str, num_heads: int, num_kv_heads: int, tied: bool
) -> QuantizedLayers:
    """Give every linear layer with quantized GGUF weights its weight-only method (its dense
    ``weight`` becomes None). The first load of a file decodes and caches its codes;
    later ones read only the cache (parsing the GGUF file's metadata alone takes seconds)."""
    start = time.perf_counter()
    cache = converted_dir(gguf_path) / "cpu-weights" / "v2.safetensors"
    cached = _read_cache(cache)
    if cached is None:
        raws = iter_raw_linear_weights(gguf_path, model_type, num_heads, num_kv_heads)
        methods, saved, consumed, summary = _pack_all(model, raws, tied)
        _write_cache(cache, saved, {"consumed": json.dumps(sorted(consumed)), "summary": summary})
    else:
        tensors, meta = cached
        names = sorted({key.rsplit(".", 1)[0] for key in tensors})
        methods = {name: _from_cache(tensors, name) for name in names}
        consumed, summary = set(json.loads(meta["consumed"])), meta["summary"]
    modules = dict(model.named_modules())
    for name, method in methods.items():
        modules[name].quant_method = method
        if name != "lm_head" or not tied:
            modules[name].weight = None  # the embedding keeps a tied head's dense weight
    total = sum(m.weight_bytes for m in methods.values())
    logger.info(
        "GGUF weights kept quantized: %s, %.1f MB, %s in %.1f s",
        summary,
        total / 1e6,
        "repacked and cached" if cached is None else "from the cache",
        time.perf_counter() - start,
    )
    return QuantizedLayers(consumed, summary, total)


def _pack_all(
    model: nn.Module, raws: dict[str, RawTensor], tied: bool
) -> tuple[dict[str, LinearMethod], dict[str, torch.Tensor], set[str], str]:
    """(module name -> method, the cache's tensors, Hugging Face names they replace, summary)."""
    parts = _targets(model, sorted(raws), tied)
    counts: dict[str, int] = defaultdict(int)
    methods: dict[str, LinearMethod] = {}
    saved: dict[str, torch.Tensor] = {}
    for module_name, pieces in sorted(parts.items()):
        names = [name for _, name in sorted(pieces)]
        methods[module_name], tensors = _build_method([raws[n] for n in names])
        saved.update({f"{module_name}.{suffix}": t for suffix, t in tensors.items()})
        kind = "int4" if isinstance(methods[module_name], Int4WeightOnlyMethod) else "int8"
        for name in names:
            counts[f"{raws[name].type_name} -> {kind}"] += 1
    consumed = {
        name
        for pieces in parts.values()
        for _, name in pieces
        if name != "model.embed_tokens.weight"
    }
    summary = ", ".join(f"{k} ({v})" for k, v in sorted(counts.items()))
    return methods, saved, consumed, summary


def _from_cache(packed: dict[str, torch.Tensor], name: str) -> LinearMethod:
    if f"{name}.int4_codes" in packed:
        pairs = packed[f"{name}.int4_codes"]
        codes = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)
        return Int4WeightOnlyMethod(
            codes, packed[f"{name}.int4_scale"], packed[f"{name}.int4_zero"]
        )
    return Int8WeightOnlyMethod(packed[f"{name}.int8_weight"], packed[f"{name}.int8_scales"])


def _read_cache(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """# NOTE: tensors are copied out of the file's buffer: safetensors places them at any 8-byte
    offset, and ``_weight_int8pack_mm`` segfaults on an unaligned weight from 4 input rows up."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if "consumed" not in meta:
            return None
        return {k: f.get_tensor(k).clone() for k in f.keys()}, meta  # noqa: SIM118


def _write_cache(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Written to a temporary file and renamed into place (workers may race)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
