"""Unified paged attention: one Triton kernel for prefill, chunked prefill and decode.

Each program handles one *query block* (``BLOCK_Q`` consecutive new tokens of one sequence) times
all ``Hq / Hk`` query heads that share one KV head, so every K/V tile is loaded once per KV head
and reused by the whole GQA group (the M dimension of the dots is ``BLOCK_Q * num_q_per_kv``).
Keys and values (cached prefix and the new tokens, which the caller stored first) are gathered
from the paged cache through the block table, position by position, so the tile size does not
have to match the KV block size. Softmax is online (flash-attention style) in float32, in the
log2 domain.

For decode at small batch the grid is too small to fill the GPU, so the context may be split
into ``num_splits`` ranges (flash-decoding): each split writes its unnormalised partial output,
running max and running sum, and the last split of a sequence and KV head to finish merges them
(``attention_reduce``'s kernel does it instead with ``BASTION_FUSED_SPLIT_MERGE=0``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from bastion import envs
from bastion.ops.triton.attention_reduce import merge_attention_splits_triton, merge_splits
from bastion.ops.triton.counters import zeroed_counters
from bastion.ops.triton.pdl import release_early, use_pdl, wait_for_previous

if TYPE_CHECKING:
    from bastion.ops.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
# Decode splits the context until the grid has about this many programs. Two or three run on
# each of an H200's 132 SMs at a time; a grid of a few waves keeps the last one from idling most
# SMs (41 sequences x 8 KV heads over 1.4k context: 78 us with 4 splits against 88 us with 1).
# BASTION_DECODE_SPLIT_TARGET (default 12 x 132) / BASTION_DECODE_SPLIT_MIN_KEYS (256) override
# the two bounds for A/B runs of the whole engine (bastion.envs).
_MAX_SPLITS = 16


class KernelConfig(NamedTuple):
    """Launch shape of one attention call: keys per loop step, warps, pipeline stages, and rows
    of a program's query block (query tokens x the query heads of one KV head; a decode block
    holds one token, so its other rows are padding)."""

    tile: int
    num_warps: int
    num_stages: int
    block_m: int = 64


def _config(env: str, default: KernelConfig) -> KernelConfig:
    """``default``, or ``tile,warps,stages[,block_m]`` from the environment variable ``env`` (for
    benchmarks that compare launch shapes inside the whole engine); a field left out keeps
    ``default``'s value (decode's 16 rows, not the 64 a bare KernelConfig would get)."""
    value = envs.get(env)
    if not value:
        return default
    try:
        given = [int(v) for v in value.split(",")]
        if not 3 <= len(given) <= len(default):
            raise ValueError
        return KernelConfig(*given, *default[len(given):])
    except (TypeError, ValueError):
        raise ValueError(f"{env} must be 'tile,num_warps,num_stages[,block_m]'; got "
                         f"{value!r}") from None


# A decode grid of at most this many (sequence, KV head) programs takes SMALL_DECODE: its
# programs are latency-bound (a handful of keys each after the split), not bandwidth-bound.
SMALL_DECODE_PROGRAMS = 64


def decode_config(num_seqs: int, num_kv_heads: int) -> KernelConfig:
    # decode at 256 x 1.1k context: 319 us with 64-key tiles against 377 us with 32 (H200). A few
    # sequences: Qwen3-30B-A3B at batch 1 (4 KV heads) 329.7-334.3 ms a batch with 32-key tiles
    # and 2 stages against 335.3-339.7 with 64 and 3 (H200, docs/BENCHMARKS.md, session 29).
    small = num_seqs * num_kv_heads <= SMALL_DECODE_PROGRAMS
    return _config("BASTION_DECODE_ATTENTION_CONFIG",
                   KernelConfig(32, 4, 2, 16) if small else KernelConfig(64, 4, 3, 16))


def prefill_config() -> KernelConfig:
    # 32-key tiles, 4 warps, 64-row query blocks. A workload-like 16k-token chunk of whole
    # prompts: 335 us against 402 us with 64-key tiles, 8 warps and 128 rows (the earlier
    # default), and the 12 prefill steps of the offline nano-vllm run 0.386 / 0.392 s against
    # 0.398-0.403 s (same H200, alternating runs).
    return _config("BASTION_PREFILL_ATTENTION_CONFIG", KernelConfig(32, 4, 3, 64))


# NOTE: Triton compiles a variant per integer argument that is 1, a multiple of 16 or neither.
# The batch's sequence count and block-table width change every step, and a compile in the middle
# of serving costs ~1 s, so those two are not specialised on.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _unified_attention_kernel(
    out_ptr,  # [T, Hq, D], written when NUM_SPLITS == 1
    part_out_ptr,  # [T, Hq, NUM_SPLITS, HEAD_PAD] float32, written when NUM_SPLITS > 1
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] float32: running max (log2 domain), running sum
    done_ptr,  # int32 [grid 0 x grid 1], zeros: splits finished per program group (FUSED_MERGE)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_blk,
    stride_k_off,
    stride_k_h,
    stride_v_blk,
    stride_v_off,
    stride_v_h,
    stride_bt,
    NUM_Q_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    DECODE: tl.constexpr,
    SKIP_DECODE_ROWS: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    # NOTE: at the very start, so every program waits (most of a decode grid's may exit below).
    wait_for_previous(USE_PDL)
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE:
        # At most one new token per sequence: program i is sequence i's only query block.
        seq_idx = q_block_id
    else:
        # Sequence i owns query blocks [qsl[i] // BLOCK_Q + i, ...): a strictly increasing
        # start that needs no host-side prefix sum (so the launch is CUDA-graph safe). Binary
        # search it. NOTE: decode skips this: its log2(B) dependent loads delay every program.
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if mid_start <= q_block_id:
                lo = mid + 1
            else:
                hi = mid
        seq_idx = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    # A mixed batch runs two launches: decode programs take the sequences with one new token,
    # the others (SKIP_DECODE_ROWS) the rest.
    if DECODE:
        q_block_local = 0
        if q_len != 1:
            return
    else:
        q_block_local = q_block_id - (q_start // BLOCK_Q + seq_idx)
        if SKIP_DECODE_ROWS and q_len == 1:
            return
    # NOTE: the grid is an upper bound on the number of query blocks; spare programs exit here.
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    ctx_len = seq_len - q_len  # new tokens are the last q_len tokens of the context

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, TILE)
    q_local = q_block_local * BLOCK_Q + offs_m // NUM_Q_PER_KV
    head = kv_head * NUM_Q_PER_KV + offs_m % NUM_Q_PER_KV
    row_ok = (offs_m // NUM_Q_PER_KV < BLOCK_Q) & (q_local < q_len)
    d_ok = offs_d < HEAD_DIM
    q_tok = (q_start + q_local).to(tl.int64)
    q_pos = ctx_len + q_local

    q = tl.load(
        q_ptr + q_tok[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Causality bounds the keys this block can see by its last token's position.
    kv_end = ctx_len + tl.minimum(q_len, (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    # Splits that see a key. A CUDA graph fixes NUM_SPLITS by its captured bound while the real
    # contexts are often far shorter; with the fused merge the splits past these exit here, and
    # neither store, count nor are read back (Qwen3-30B-A3B at batch 1, 160 keys: 3 of 16).
    live = tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)
    if FUSED_MERGE and split >= live:
        return

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt

    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE + offs_t
        k_ok = k_pos < kv_end
        blk = tl.load(bt_row + k_pos // KV_BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_blk = (k_pos % KV_BLOCK_SIZE).to(tl.int64)
        k_off = blk * stride_k_blk + in_blk * stride_k_off + kv_head * stride_k_h
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=d_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_off = blk * stride_v_blk + in_blk * stride_v_off + kv_head * stride_v_h
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # NOTE: without the fused merge every split stores, even one with no tiles (m = -inf,
        # l = 0): the merge kernel reads all.
        row = (q_tok * tl.num_programs(1) * NUM_Q_PER_KV + head) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
        if FUSED_MERGE:
            # The last split of this query block and KV head to finish merges them all, so no
            # second kernel runs. Every thread's stores precede the count (barrier, then the
            # atomic's release); the merging program reads the partials from L2.
            tl.debug_barrier()
            group = done_ptr + q_block_id * tl.num_programs(1) + kv_head
            if tl.atomic_add(group, 1, sem="acq_rel") == live - 1:
                tl.store(group, 0)  # ready for the next launch (CUDA-graph replays too)
                tl.debug_barrier()
                out = merge_splits(part_out_ptr, part_ml_ptr, row - split, row_ok, offs_d,
                                   BLOCK_M, HEAD_PAD, NUM_SPLITS, live)
                tl.store(
                    out_ptr + q_tok[:, None] * stride_o_t + head[:, None] * stride_o_h
                    + offs_d[None, :],
                    out.to(out_ptr.dtype.element_ty),
                    mask=row_ok[:, None] & d_ok[None, :],
                )


# A/B switches of the whole engine (bastion.envs): BASTION_SPLIT_MIXED_ATTENTION=0 runs a mixed
# batch's decode rows in the prefill launch; BASTION_FUSED_SPLIT_MERGE=0 merges a split decode
# in a second kernel instead of in its last split's program.

# Launch shapes that did not fit this GPU -> the smaller shape that did.
_FITTED: dict[KernelConfig, KernelConfig] = {}


def _smaller(config: KernelConfig) -> KernelConfig | None:
    """The next shape down in shared memory: fewer pipeline stages, then smaller key tiles."""
    if config.num_stages > 1:
        return config._replace(num_stages=config.num_stages - 1)
    if config.tile > 16:
        return config._replace(tile=config.tile // 2)
    return None


def _pick_num_splits(num_q_blocks: int, num_kv_heads: int, max_query_len: int,
                     max_seq_len: int) -> int:
    # Split only decode batches: a prefill block already has plenty of work (and every split
    # count is a kernel variant to compile: decode sees only those of the captured batch sizes).
    # The choice must not depend on the step's context lengths so that a captured CUDA graph
    # stays valid: ``max_seq_len`` is the bound the graph was captured for (a power of two
    # keeps eager runs, where it is the batch's longest context, to a few variants).
    if max_query_len > 1:
        return 1
    programs = max(num_q_blocks * num_kv_heads, 1)
    # A split of fewer than the minimum keys (256) is not worth its merge (Llama-3.1-8B, batch 8,
    # 160-token contexts: 657 ms a batch with 16 splits against 635 ms with 8).
    min_keys = envs.get("BASTION_DECODE_SPLIT_MIN_KEYS")
    by_length = 1 << max(0, (max_seq_len // min_keys).bit_length() - 1)
    return max(1, min(_MAX_SPLITS, by_length,
                      envs.get("BASTION_DECODE_SPLIT_TARGET") // programs))


def _block_m(config: KernelConfig, num_q_per_kv: int) -> int:
    """Rows of a program's query block: query tokens x the query heads of one KV head."""
    return max(config.block_m, triton.next_power_of_2(num_q_per_kv))


def _block_q(config: KernelConfig, num_q_per_kv: int) -> int:
    """Query tokens a program's block holds (rows past ``BLOCK_Q`` whole tokens are masked)."""
    return _block_m(config, num_q_per_kv) // num_q_per_kv


def _launch(grid: tuple[int, int, int], config: KernelConfig, args: tuple,
            **consts: object) -> None:
    """One launch of the kernel in ``config``'s shape, or in the largest smaller shape that fits
    this GPU (found once and remembered per shape)."""
    num_q_per_kv = consts["NUM_Q_PER_KV"]
    asked, config = config, _FITTED.get(config, config)
    while True:
        try:
            _unified_attention_kernel[grid](
                *args, BLOCK_Q=_block_q(config, num_q_per_kv),
                BLOCK_M=_block_m(config, num_q_per_kv), TILE=config.tile,
                num_warps=config.num_warps, num_stages=config.num_stages,
                launch_pdl=bool(consts["USE_PDL"]), **consts)
            return
        except OutOfResources as exc:
            # The shapes are tuned on an H200 (228 KiB of shared memory a SM); a smaller GPU
            # gets fewer pipeline stages, then smaller key tiles, once, remembered per shape.
            smaller = _smaller(config)
            if smaller is None:
                raise
            logger.warning("attention launch shape %s does not fit this GPU (%s); using %s",
                           tuple(config), exc, tuple(smaller))
            config = _FITTED[asked] = smaller


def _check_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "paged_attention expects query [T, Hq, D] and k_cache = v_cache shape "
            f"[num_blocks, block_size, Hk, D]; got {tuple(query.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    _, num_heads, head_dim = query.shape
    _, _, num_kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"head dims must match and Hq must be a multiple of Hk; got query {tuple(query.shape)}"
            f" and cache {tuple(k_cache.shape)}"
        )
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention needs the head dim contiguous (stride 1)")
    if query.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtype mismatch: query {query.dtype}, cache {k_cache.dtype}")
    bt = meta.block_tables
    if bt.dtype != torch.int32 or bt.dim() != 2 or bt.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [B, max_blocks], row-major; got {bt.dtype}")
    for name in ("seq_lens", "query_start_loc"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor; got {t.dtype}")
    num_seqs = meta.seq_lens.shape[0]
    if meta.query_start_loc.shape[0] != num_seqs + 1 or bt.shape[0] < num_seqs:
        raise ValueError("query_start_loc must have B + 1 entries and block_tables B rows")


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query`` [T, Hq, D] over the paged cache; returns [T, Hq, D].

    The K/V of the new tokens must already be stored in ``k_cache``/``v_cache``
    ([num_blocks, block_size, Hk, D]). ``num_splits`` forces the number of context splits
    (default: from the batch shape and ``meta.max_seq_len``, never from the step's context
    lengths: under CUDA graphs that is the captured bound, so a graph stays valid; an eager
    decode batch passes its longest context, which meets at most five split counts, rounded to
    powers of two). Rows of padding tokens past ``query_start_loc[-1]`` come back as 0.
    ``config`` overrides the launch shape (benchmarks sweep it).
    """
    _check_inputs(query, k_cache, v_cache, meta)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = meta.seq_lens.shape[0]
    bt = meta.block_tables

    num_q_per_kv = num_heads // num_kv_heads
    is_decode = meta.max_query_len <= 1
    # A mixed batch's decode rows get their own launch with decode's 16-row blocks: a decode
    # token alone in a prefill-shaped block fills one of its 64 token slots, and the dots and
    # softmax still do all 128 rows.
    split_decode = (not is_decode and envs.get("BASTION_SPLIT_MIXED_ATTENTION")
                    and bool(meta.query_start_loc_cpu) and meta.num_decode_seqs > 0)
    main = config or (decode_config(num_seqs, num_kv_heads) if is_decode
                      else prefill_config())
    # Decode: one program per sequence. Otherwise an upper bound on the query blocks.
    num_q_blocks = (num_seqs if is_decode
                    else num_tokens // _block_q(main, num_q_per_kv) + num_seqs)
    if num_splits is None:
        num_splits = _pick_num_splits(num_q_blocks, num_kv_heads, meta.max_query_len,
                                      meta.max_seq_len)
    head_pad = max(16, triton.next_power_of_2(head_dim))

    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    num_real = meta.query_start_loc_cpu[-1] if meta.query_start_loc_cpu else num_tokens
    if num_real < num_tokens:
        out[num_real:].zero_()
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_ml = out  # unused by the kernel
    fused_merge = num_splits > 1 and envs.get("BASTION_FUSED_SPLIT_MERGE")
    done = (zeroed_counters("attention", query.device, num_q_blocks * num_kv_heads)
            if fused_merge else part_ml)
    args = (out, part_out, part_ml, done, query, k_cache, v_cache, bt, meta.seq_lens,
            meta.query_start_loc, scale * _LOG2E, num_seqs,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0))
    consts = {"NUM_Q_PER_KV": num_q_per_kv, "HEAD_DIM": head_dim, "HEAD_PAD": head_pad,
              "KV_BLOCK_SIZE": block_size, "NUM_SPLITS": num_splits,
              "IEEE_DOT": query.dtype == torch.float32, "FUSED_MERGE": fused_merge,
              "USE_PDL": use_pdl(query.device)}
    _launch((num_q_blocks, num_kv_heads, num_splits), main, args,
            DECODE=is_decode, SKIP_DECODE_ROWS=split_decode, **consts)
    if split_decode:
        _launch((num_seqs, num_kv_heads, num_splits),
                config or decode_config(meta.num_decode_seqs, num_kv_heads), args,
                DECODE=True, SKIP_DECODE_ROWS=False, **consts)
    if num_splits > 1 and not fused_merge:
        merge_attention_splits_triton(out, part_out, part_ml, meta.query_start_loc, num_seqs)
    return out
