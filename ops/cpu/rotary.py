"""The launcher of ``rotary.c``: neox-style rotary embedding of a step's queries and keys with
the store of keys and values in the paged cache (float32 on the CPU)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bastion.ops.cpu import cpu_kernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P,
             _P, _P, _P, _I64, ctypes.c_int)


def _kernel() -> Callable[..., int] | None:
    return cpu_kernel("rotary", "rotary_store_f32", _ARGTYPES, _I64)


def can_run(query: torch.Tensor, key: torch.Tensor, is_neox_style: bool,
            fused: dict[str, object]) -> bool:
    """Whether the C kernel takes this call: float32 CPU rows, neox style, no per-head norm
    (Qwen3's q/k norms take the reference), and the kernel built."""
    return (is_neox_style and fused.get("q_weight") is None and query.device.type == "cpu"
            and query.dtype == key.dtype == torch.float32 and _kernel() is not None)


def rotary_store_cpu(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int, *,
                     value: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                     v_cache: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None,
                     **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_emb_ref`` without the norms: rotated copies of ``query`` [T, Hq*D] and
    ``key`` [T, Hk*D] (rows may be strided views), and with ``k_cache`` the store of the
    rotated key and ``value`` at ``slot_mapping`` (slots < 0 skipped). ``positions`` must index
    rows of ``cos_sin_cache``. Check ``can_run`` first."""
    num_tokens = positions.shape[0]
    if query.shape[0] != num_tokens or key.shape[0] != num_tokens or (
            k_cache is not None and (value.shape[0] != num_tokens
                                     or slot_mapping.shape[0] != num_tokens)):
        raise ValueError(f"{num_tokens} positions need as many query, key, value and slot rows")
    rotary_dim = cos_sin_cache.shape[1]
    q2, k2 = query.reshape(num_tokens, -1), key.reshape(num_tokens, -1)
    if (q2.shape[1] % head_size or k2.shape[1] % head_size or rotary_dim > head_size
            or rotary_dim % 2):
        raise ValueError(f"query/key widths {q2.shape[1]}, {k2.shape[1]} and rotary dim "
                         f"{rotary_dim} do not fit heads of {head_size}")
    if (positions.dtype != torch.int64 or not positions.is_contiguous() or q2.stride(1) != 1
            or k2.stride(1) != 1 or cos_sin_cache.dtype != torch.float32
            or not cos_sin_cache.is_contiguous()):
        raise ValueError("rotary needs int64 positions, query/key rows of unit stride and a "
                         "contiguous float32 cos_sin_cache")
    store = k_cache is not None
    if store:
        v2 = value.reshape(num_tokens, -1)
        if (v2.shape != k2.shape or v2.stride(1) != 1 or v2.dtype != torch.float32
                or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32
                or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or k_cache.shape[-1] * k_cache.shape[-2] != k2.shape[1]
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
            raise ValueError("storing needs float32 value rows like key's, contiguous float32 "
                             "caches [num_blocks, block_size, Hk, D] and int64 slot_mapping")
    q_out = torch.empty(q2.shape, dtype=torch.float32)
    k_out = torch.empty(k2.shape, dtype=torch.float32)
    if not num_tokens:
        return q_out, k_out
    max_position = cos_sin_cache.shape[0]
    num_slots = k_cache.numel() // k2.shape[1] if store else 0
    num_bad = _kernel()(
        positions.data_ptr(), num_tokens, q2.data_ptr(), q2.stride(0), k2.data_ptr(),
        k2.stride(0), v2.data_ptr() if store else None, v2.stride(0) if store else 0,
        cos_sin_cache.data_ptr(), max_position, rotary_dim, q2.shape[1] // head_size,
        k2.shape[1] // head_size, head_size, q_out.data_ptr(), k_out.data_ptr(),
        k_cache.data_ptr() if store else None, v_cache.data_ptr() if store else None,
        slot_mapping.data_ptr() if store else None, num_slots, torch.get_num_threads())
    if num_bad:
        raise ValueError(f"{num_bad} of {num_tokens} tokens have a position outside "
                         f"[0, {max_position}) or a KV slot past the cache's {num_slots}")
    return q_out, k_out
