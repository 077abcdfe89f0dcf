"""The launcher of ``paged_attention.c``: decode rows of a step, attending over the paged KV
cache in place (float32 on the CPU)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bastion.ops.cpu import cpu_kernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _I64,
             _I64, _I64, ctypes.c_float, _P, _I64, _I64, ctypes.c_int)


def _kernel() -> Callable[..., int] | None:
    return cpu_kernel("paged_attention", "paged_decode_attention_f32", _ARGTYPES, _I64)


def can_run(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernel takes these tensors: float32 CPU tensors, the caches contiguous,
    and the kernel on and built (``ops/cpu``). Other dtypes keep the reference: the kernel
    accumulates in float32 and would not be the reference's arithmetic."""
    return (query.device.type == "cpu" and query.dtype == k_cache.dtype == v_cache.dtype
            == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and _kernel() is not None)


def paged_decode_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                               seq_ids: torch.Tensor | None, max_seq_len: int, scale: float,
                               out: torch.Tensor) -> None:
    """For each sequence of ``seq_ids`` (None: all), which has one new token at row
    ``query_start_loc[i]`` of ``query`` [T, Hq, D], write its attention over its first
    ``seq_lens[i]`` cached keys and values (through ``block_tables`` [B, W], int32; entries past
    a sequence's last block are never read) to the same row of ``out``. ``max_seq_len`` bounds
    every such ``seq_lens[i]`` (it sizes the scratch). Check ``can_run`` first.

    ValueError when the tensors disagree on their shapes, or when a sequence's length, block ids
    or query row would take the kernel outside its buffers (it checks and skips those)."""
    kernel = _kernel()
    num_rows, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"query {tuple(query.shape)} and caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} disagree on the head size")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} "
                         "KV heads")
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {query.dtype} {tuple(query.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("seq_ids", seq_ids)):
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.int32
                              or t.stride(-1) != 1):
            raise ValueError(f"{name} must be a CPU int32 tensor with unit stride; got "
                             f"{t.dtype} on {t.device}, strides {t.stride()}")
    num_batch = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] < num_batch \
            or query_start_loc.shape[0] < num_batch:
        raise ValueError(f"{num_batch} sequences need as many block table rows and query "
                         f"starts; got {tuple(block_tables.shape)} and "
                         f"{tuple(query_start_loc.shape)}")
    num_seqs = num_batch if seq_ids is None else seq_ids.shape[0]
    if num_seqs == 0:
        return
    query = query.contiguous()
    num_threads = torch.get_num_threads()
    stride = num_q_heads // num_kv_heads * (max_seq_len + head_dim)
    scratch = torch.empty(num_threads, stride, dtype=torch.float32)
    num_bad = kernel(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), block_tables.shape[1], num_batch, seq_lens.data_ptr(),
        query_start_loc.data_ptr(), None if seq_ids is None else seq_ids.data_ptr(), num_seqs,
        num_rows, num_blocks, out.data_ptr(), num_q_heads, num_kv_heads, head_dim, block_size,
        scale, scratch.data_ptr(), stride, max_seq_len, num_threads)
    if num_bad:
        raise ValueError(
            f"{num_bad} (sequence, KV head) pairs of a decode step point outside the cache: a "
            f"sequence id past {num_batch}, a length outside [1, {max_seq_len}] or past its "
            f"table of {block_tables.shape[1]} blocks of {block_size}, a block id outside "
            f"[0, {num_blocks}), or a query row outside [0, {num_rows})")
