"""The launcher of ``paged_attention.c``: decode rows of a step, attending over the paged KV
cache in place (float32 on the CPU)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from bastion.ops.cpu import load_cpu_kernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _kernel() -> Callable[..., None] | None:
    # -ffast-math: the dot products vectorise as reassociated sums and exp becomes glibc's
    # vector expf (0.55 against 0.83 ms for 16 sequences of 64-400 tokens, one core).
    lib = load_cpu_kernel("paged_attention", ("-ffast-math",))
    if lib is None:
        return None
    fn = lib.paged_decode_attention_f32
    fn.argtypes = [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64,
                   ctypes.c_float, _P, _I64, ctypes.c_int]
    fn.restype = None
    return fn


def can_run(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernel takes these tensors: float32 CPU tensors, the caches contiguous,
    and the kernel built (``ops/cpu``)."""
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
    ``seq_lens[i]`` cached keys and values (through ``block_tables`` [B, W], int32) to the same
    row of ``out``. ``max_seq_len`` bounds every such ``seq_lens[i]`` (it sizes the scratch).
    Check ``can_run`` first."""
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
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
        if t is not None and (t.dtype != torch.int32 or t.stride(-1) != 1):
            raise ValueError(f"{name} must be int32 with unit stride; got {t.dtype}, "
                             f"strides {t.stride()}")
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(f"block tables of {block_tables.shape[1]} blocks of {block_size} "
                         f"cannot hold a context of {max_seq_len} tokens")
    num_seqs = seq_lens.shape[0] if seq_ids is None else seq_ids.shape[0]
    if num_seqs == 0:
        return
    query = query.contiguous()
    num_threads = torch.get_num_threads()
    group = num_q_heads // num_kv_heads
    stride = group * (max_seq_len + head_dim)
    scratch = torch.empty(num_threads, stride, dtype=torch.float32)
    _kernel()(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
              block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(),
              None if seq_ids is None else seq_ids.data_ptr(), num_seqs, out.data_ptr(),
              num_q_heads, num_kv_heads, head_dim, block_size, scale, scratch.data_ptr(),
              stride, num_threads)
