"""Paged attention: causal attention of new tokens over their whole context in the paged cache.

On a GPU, one Triton kernel (``triton/unified_attention.py``). On the CPU, decode rows go
through a C kernel that reads the cache in place (``cpu/paged_attention.c``; float32 only) and
prefill rows through ``scaled_dot_product_attention`` over their gathered context; other dtypes,
or a machine without a C compiler, take the torch reference for every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bastion.ops.attention_metadata import AttentionMetadata
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.cpu import paged_attention as cpu_attention

# Decode batches gather their context in chunks of at most this many key elements (per cache),
# so a large batch never materialises one huge gathered copy of the cache.
_MAX_GATHER_ELEMENTS = 1 << 26


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``query`` [T, Hq, D] -> ``out`` [T, Hq, D].

    Reads every key/value of each sequence (the cached prefix and the new tokens, which were
    stored first) from the caches [num_blocks, block_size, Hk, D] through ``meta.block_tables``.
    GQA: ``Hq`` is a multiple of ``Hk``. Rows of padding tokens past the last sequence are zero.
    """
    if use_triton(query, k_cache):
        launcher = triton_launcher("unified_attention", "paged_attention_triton")
        if launcher is not None:
            return launcher(query, k_cache, v_cache, meta, scale)
    if cpu_attention.can_run(query, k_cache, v_cache):
        return _paged_attention_cpu(query, k_cache, v_cache, meta, scale)
    return paged_attention_ref(query, k_cache, v_cache, meta, scale)


def _paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode rows in one call of the C kernel, each prefill (or chunk) as the reference does."""
    decode_ids = meta.decode_seq_ids
    is_all_decode = len(decode_ids) == meta.num_seqs
    # Rows no sequence owns (padding) must read zero, as the reference leaves them.
    out = (torch.empty_like(query) if is_all_decode and query.shape[0] == meta.num_seqs
           else torch.zeros_like(query))
    if decode_ids:
        seq_ids = None if is_all_decode else torch.tensor(decode_ids, dtype=torch.int32)
        cpu_attention.paged_decode_attention_cpu(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            seq_ids, meta.max_decode_seq_len, scale, out)
    if not is_all_decode:
        decode_set = set(decode_ids)
        starts = meta.query_start_loc_cpu
        for i in range(meta.num_seqs):
            if i not in decode_set and starts[i + 1] > starts[i]:
                _prefill_one(query, k_cache, v_cache, meta, scale, i, out)
    return out


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    out = torch.zeros_like(query)
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decode_ids = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    if decode_ids:
        _decode_batch(query, k_cache, v_cache, meta, scale, decode_ids, out)
    if len(decode_ids) < len(seq_lens):
        decode_set = set(decode_ids)
        for i in range(len(seq_lens)):
            if i not in decode_set and starts[i + 1] > starts[i]:
                _prefill_one(query, k_cache, v_cache, meta, scale, i, out)
    return out


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., length, Hk, D] context rows.

    One ``index_select`` over the cache viewed as rows of whole blocks: on a CPU it is 3x
    faster than advanced indexing (16 sequences x 20 blocks: 0.27 against 0.89 ms).
    """
    block_size, tail = cache.shape[1], cache.shape[2:]
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1).long())
    rows = rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, *tail)
    return rows[..., :length, :, :]


def _prefill_one(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, i: int, out: torch.Tensor) -> None:
    start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
    seq_len, q_len = meta.seq_lens_cpu[i], end - start
    block_size = k_cache.shape[1]
    block_ids = meta.block_tables[i, : (seq_len + block_size - 1) // block_size]
    k = _gather_context(k_cache, block_ids, seq_len).transpose(0, 1)  # [Hk, S, D]
    v = _gather_context(v_cache, block_ids, seq_len).transpose(0, 1)
    q = query[start:end].transpose(0, 1)  # [Hq, q_len, D]
    if q_len == seq_len:
        mask, causal = None, True
    else:
        # New token j sits at position seq_len - q_len + j and sees keys up to that position.
        pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= pos[:, None]
        causal = False
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       is_causal=causal, scale=scale,
                                       enable_gqa=q.shape[0] != k.shape[0])
    out[start:end] = o.transpose(0, 1)


def _decode_batch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, seq_ids: list[int],
                  out: torch.Tensor) -> None:
    """One new token per sequence: batched gather + masked matmul, chunked over sequences."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    max_len = max(meta.seq_lens_cpu[i] for i in seq_ids)
    per_seq = max_len * num_kv_heads * head_dim
    chunk = max(1, _MAX_GATHER_ELEMENTS // per_seq)
    num_blocks = (max_len + block_size - 1) // block_size
    ids = torch.tensor(seq_ids, device=query.device)
    token_idx = meta.query_start_loc[ids].long()
    for lo in range(0, len(seq_ids), chunk):
        idx, tok = ids[lo:lo + chunk], token_idx[lo:lo + chunk]
        tables = meta.block_tables[idx, :num_blocks]
        k = _gather_context(k_cache, tables, max_len).to(query.dtype)  # [b, L, Hk, D]
        v = _gather_context(v_cache, tables, max_len).to(query.dtype)
        q = query[tok].view(-1, num_kv_heads, group, head_dim)  # [b, Hk, G, D]
        scores = torch.einsum("bkgd,blkd->bkgl", q, k) * scale
        lens = meta.seq_lens[idx].long()
        invalid = torch.arange(max_len, device=query.device)[None, :] >= lens[:, None]
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        o = torch.einsum("bkgl,blkd->bkgd", probs, v)
        out[tok] = o.reshape(-1, num_q_heads, head_dim)
