"""The MoE layer for a handful of tokens: two matrix-vector kernels, no sort and no sum.

At decode batch sizes each routed expert sees one or two tokens, so the grouped GEMM of
``fused_moe.py`` pads every expert's rows to a 16-row block, needs the align step to sort the
pairs first and a third kernel to sum each token's k outputs. Here a token's (token, expert)
pair is its own row and nothing is sorted:

- ``up``: one program per (pair, ``BLOCK_N`` columns of the intermediate size) streams its
  expert's gate and up rows against the token's hidden state and writes
  ``silu(gate) * up`` for the pair;
- ``down``: one program per (token, ``BLOCK_N`` hidden columns) reads the token's k experts
  side by side, scales each expert's product by its routing weight and accumulates the sum
  over k in float32 before a single store, so every row of the output is written (a pair on another
  rank's expert, or id -1, adds zero) and no zero fill or top-k sum follows.

Both accumulate elementwise in a ``[BLOCK_N, BLOCK_K]`` float32 tile and reduce it once at the
end: the products are bound by the weight bytes, which each program reads exactly once. Two
tokens that chose the same expert read its weights twice, which is why the grouped GEMM takes
over from a few tokens on (the tuned tables in ``bastion.ops.moe_configs`` say where).

Other forms, off by default, for A/B runs (``bastion.envs``): the up kernel's products folded
into a ``[BLOCK_N, BLOCK_K / 8]`` sum (``BASTION_MOE_UP_FOLD``), its K spread over several
programs whose last adds the partials (``BASTION_MOE_UP_SPLIT``), either kernel's products
as tensor-core dots (``BASTION_MOE_UP_DOT``, ``BASTION_MOE_DOWN_DOT``), and the down kernel
let launch only as the up kernel's programs end (``BASTION_MOE_UP_RELEASE_AT_END``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion import envs
from bastion.ops.triton.counters import zeroed_counters
from bastion.ops.triton.fused_moe import dot_acc
from bastion.ops.triton.pdl import (evict_policy, prefetch_l2, prefetch_lanes, prefetch_lines_l2,
                                   release_early, release_now, use_pdl, use_prefetch,
                                   wait_for_previous)


@triton.jit
def _moe_gemv_up_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    ids_ptr,
    expert_offset,
    num_local,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVICT: tl.constexpr = "",
    AHEAD: tl.constexpr = 0,
    LANES: tl.constexpr = 32,
    DOT: tl.constexpr = False,
    IEEE: tl.constexpr = False,
    SPLIT: tl.constexpr = 1,
    FOLD: tl.constexpr = 0,
    RELEASE_AT_END: tl.constexpr = False,
    part_ptr=None,
    counts_ptr=None,
    k_split=0,
):
    # Released only after the wait: the down kernel reads the routing's ids before its own.
    # With RELEASE_AT_END (BASTION_MOE_UP_RELEASE_AT_END) only as the program ends, so that
    # the down kernel's grid launches as this one finishes (a program that returns early
    # releases as it exits), not beside it.
    wait_for_previous(USE_PDL, RELEASE=True, HOLD=RELEASE_AT_END)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64) - expert_offset
    if (expert < 0) | (expert >= num_local):
        return  # another rank's expert, or padding: the down kernel skips the pair
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # This program's K columns: all of them, or its split's share (BASTION_MOE_UP_SPLIT).
    if SPLIT == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(2) * k_split
        k_hi = tl.minimum(K, k_lo + k_split)
    if DOT:
        gate, up = _up_dot(x_ptr + token * stride_x, w13_ptr + expert * stride_we, offs_n, n_ok,
                           N, k_lo, k_hi, stride_wn, BLOCK_N, BLOCK_K, EVICT, IEEE)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        gate_ptrs = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn \
            + (k_lo + offs_k[None, :])
        up_ptrs = gate_ptrs + N * stride_wn
        x_ptrs = x_ptr + token * stride_x + k_lo + offs_k
        if FOLD > 0:
            # BASTION_MOE_UP_FOLD: the token's columns are read in the weights' layout (a
            # thread its own, from L1) rather than once and spread through shared memory at
            # a barrier a step, and each thread adds its FOLD adjacent products of a step
            # into one float32 sum: a [BLOCK_N, BLOCK_K / FOLD] accumulator instead of
            # [BLOCK_N, BLOCK_K], so that wider tiles keep few registers.
            x_ptrs = x_ptrs[None, :] + offs_n[:, None] * 0
        ACC_K: tl.constexpr = BLOCK_K // FOLD if FOLD > 0 else BLOCK_K
        acc_gate = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
        if AHEAD > 0:
            ahead_ptrs, active = _up_step_lines(w13_ptr + expert * stride_we, N, stride_wn,
                                                BLOCK_N, BLOCK_K, LANES)
        for k in range(k_lo, k_hi, BLOCK_K):
            if AHEAD > 0:
                # Triton pipelines no loop without a dot and ptxas issues a step's loads only
                # after the step before it is multiplied: one step in flight a program. The
                # step AHEAD on is asked of L2 now (the last step again near the end).
                prefetch_lines_l2(ahead_ptrs + tl.minimum(k + AHEAD * BLOCK_K, k_hi - BLOCK_K),
                                  active)
            k_ok = offs_k < k_hi - k
            if FOLD > 0:
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
            else:
                x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            mask = n_ok[:, None] & k_ok[None, :]
            g = tl.load(gate_ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
            u = tl.load(up_ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
            if FOLD > 0:
                acc_gate += tl.sum(tl.reshape(g * x, (BLOCK_N, BLOCK_K // FOLD, FOLD)), axis=2)
                acc_up += tl.sum(tl.reshape(u * x, (BLOCK_N, BLOCK_K // FOLD, FOLD)), axis=2)
            else:
                acc_gate += g * x
                acc_up += u * x
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        gate = tl.sum(acc_gate, axis=1)
        up = tl.sum(acc_up, axis=1)
    act_ptrs = act_ptr + pair.to(tl.int64) * stride_act + offs_n
    if SPLIT == 1:
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok)
    else:
        _up_merge_splits(gate, up, act_ptrs, part_ptr, counts_ptr, pair, offs_n, n_ok, N,
                         SPLIT)
    if RELEASE_AT_END:
        release_now(USE_PDL)


@triton.jit
def _up_merge_splits(gate, up, act_ptrs, part_ptr, counts_ptr, pair, offs_n, n_ok, N,
                     SPLIT: tl.constexpr):
    """``BASTION_MOE_UP_SPLIT``: each of a tile's ``SPLIT`` programs stores its partial gate
    and up sums (float32, ``part_ptr``'s rows ``[pair * SPLIT + split]``, gate then up), and
    the last of them to count itself in (``counts_ptr``, one a (pair, tile), back to zero
    after) adds the partials in split order, so the result does not depend on which
    finished last, and stores ``silu(gate) * up``."""
    rows = part_ptr + (pair.to(tl.int64) * SPLIT) * 2 * N + offs_n
    mine = rows + tl.program_id(2) * 2 * N
    tl.store(mine, gate, mask=n_ok)
    tl.store(mine + N, up, mask=n_ok)
    # NOTE: the barrier puts every thread's stores before the count's release.
    tl.debug_barrier()
    count_ptr = counts_ptr + pair * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == SPLIT - 1:
        tl.store(count_ptr, 0)  # ready for the next launch (CUDA-graph replays too)
        tl.debug_barrier()
        gate = tl.zeros_like(gate)
        up = tl.zeros_like(up)
        for s in tl.static_range(SPLIT):  # the other programs' stores are in L2, not in L1
            gate += tl.load(rows + s * 2 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
            up += tl.load(rows + s * 2 * N + N, mask=n_ok, other=0.0, cache_modifier=".cg")
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptrs, act.to(act_ptrs.dtype.element_ty), mask=n_ok)


@triton.jit
def _up_step_lines(w_ptr, N, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   LANES: tl.constexpr):
    """The 128-byte lines of a program's first K step of gate and up rows (bf16 or fp16
    weights from ``w_ptr``, one expert's ``[2N, K]``), one a thread over the first of
    ``LANES`` threads: (pointers, 1 where the thread asks for its line, else 0)."""
    lines_per_row: tl.constexpr = BLOCK_K // 64
    lane = tl.arange(0, LANES)
    active = (lane < 2 * BLOCK_N * lines_per_row).to(tl.int32)
    lane = lane % (2 * BLOCK_N * lines_per_row)
    row = lane // lines_per_row
    row = tl.where(row < BLOCK_N, tl.program_id(1) * BLOCK_N + row,
                   N + tl.program_id(1) * BLOCK_N + row - BLOCK_N)
    row = tl.minimum(row, 2 * N - 1)
    return w_ptr + row.to(tl.int64) * stride_wn + (lane % lines_per_row) * 64, active


@triton.jit
def _up_dot(x_row_ptr, w_ptr, offs_n, n_ok, N, k_lo, k_hi, stride_wn, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, EVICT: tl.constexpr, IEEE: tl.constexpr):
    """The up kernel's products over K columns ``[k_lo, k_hi)`` as tensor-core dots
    (``BASTION_MOE_UP_DOT``), so that Triton pipelines the weight loads over ``num_stages``:
    it pipelines only loads that feed a dot, and the elementwise loop has one K step in
    flight a program. The token is row 0 of a 16-row operand whose other rows are zero,
    ``[16, BLOCK_K] @ [BLOCK_K, BLOCK_N]`` with the expert's rows read K-contiguous as the
    grouped GEMM reads its B (``BLOCK_N`` >= 16); the same products and sums as the
    elementwise form, in another order. Returns the (gate, up) sums, ``[BLOCK_N]`` each."""
    rows = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_row_ptr + rows[:, None] * 0 + (k_lo + offs_k[None, :])
    gate_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k[:, None])
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = offs_k < k_hi - k
        x = tl.load(x_ptrs, mask=(rows[:, None] == 0) & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        g = tl.load(gate_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT)
        u = tl.load(up_ptrs, mask=w_mask, other=0.0, eviction_policy=EVICT)
        acc_gate = dot_acc(x, g, acc_gate, IEEE)
        acc_up = dot_acc(x, u, acc_up, IEEE)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # Rows 1-15 are exact zeros.
    return tl.sum(acc_gate, axis=0), tl.sum(acc_up, axis=0)


@triton.jit
def _moe_gemv_down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    ids_ptr,
    weights_ptr,
    expert_offset,
    num_local,
    N,
    K,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    W_BYTES: tl.constexpr,
    LINES: tl.constexpr,
    EVICT: tl.constexpr = "",
    DOT: tl.constexpr = False,
    IEEE: tl.constexpr = False,
):
    release_early(USE_PDL)
    # The token's k experts form the leading dim of one [k, BLOCK_N, BLOCK_K] tile, so every
    # step of the K loop has all k experts' loads in flight at once (a loop over the experts
    # would wait on each expert's bytes in turn).
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_j = tl.arange(0, BLOCK_TOPK)
    pair = token * TOP_K + offs_j
    j_ok = offs_j < TOP_K
    expert = tl.load(ids_ptr + pair, mask=j_ok, other=-1).to(tl.int64) - expert_offset
    local = j_ok & (expert >= 0) & (expert < num_local)
    expert = tl.where(local, expert, 0)
    weight = tl.load(weights_ptr + pair, mask=local, other=0.0).to(tl.float32)
    k_end = tl.where(local, K, 0)  # no column of a pair on no local expert is read
    if PREFETCH:  # each local expert's [BLOCK_N, K] rows into L2 while the up kernel runs
        n0 = tl.program_id(1) * BLOCK_N
        num_bytes = ((tl.minimum(N - n0, BLOCK_N) - 1) * stride_wn + K) * W_BYTES
        for j in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + token * TOP_K + j).to(tl.int64) - expert_offset
            if (e >= 0) & (e < num_local):
                prefetch_l2(w2_ptr + e * stride_we + n0.to(tl.int64) * stride_wn, num_bytes,
                            LINES)
    if DOT:
        wait_for_previous(USE_PDL)
        out = _down_dot(act_ptr + pair * stride_act, w2_ptr + expert * stride_we, local, weight,
                        offs_n, n_ok, K, stride_wn, BLOCK_TOPK, BLOCK_N, BLOCK_K, EVICT, IEEE)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = (w2_ptr + expert[:, None, None] * stride_we
                  + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :])
        a_ptrs = act_ptr + pair[:, None] * stride_act + offs_k[None, :]
        # The routing (two kernels back) has ended once the up kernel lets this one launch
        # (ops/triton/pdl.py): the ids and the first K step's weights are read before the wait
        # for the up kernel's products.
        k_ok = offs_k[None, :] < k_end[:, None]
        w = tl.load(w_ptrs, mask=k_ok[:, None, :] & n_ok[None, :, None], other=0.0,
                    eviction_policy=EVICT)
        wait_for_previous(USE_PDL)
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32) * weight[:, None]
        acc = w.to(tl.float32) * a[:, None, :]
        for k in range(BLOCK_K, K, BLOCK_K):
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            k_ok = offs_k[None, :] < (k_end - k)[:, None]
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32) * weight[:, None]
            w = tl.load(w_ptrs, mask=k_ok[:, None, :] & n_ok[None, :, None], other=0.0,
                        eviction_policy=EVICT)
            acc += w.to(tl.float32) * a[:, None, :]
        out = tl.sum(tl.sum(acc, axis=2), axis=0)
    tl.store(out_ptr + token * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_dot(act_ptrs, w_ptrs, local, weight, offs_n, n_ok, K, stride_wn,
              BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVICT: tl.constexpr, IEEE: tl.constexpr):
    """The down kernel's products as tensor-core dots (``BASTION_MOE_DOWN_DOT``), so that
    Triton pipelines the weight loads over ``num_stages``. ``act_ptrs``, ``w_ptrs``,
    ``local`` and ``weight`` hold the token's k pairs (``[BLOCK_TOPK]``: its activation row,
    its expert's ``[N, K]`` rows, whether that expert is on this rank, its routing weight).
    One batched dot a K step over the k experts: each expert's row is row 0 of a 16-row
    operand whose other rows are zero, against its ``[BLOCK_K, BLOCK_N]`` rows read
    K-contiguous (``BLOCK_N`` >= 16). A pair's locality and the K bound are separate masks,
    so that the K bound (a multiple of 16 wherever K is) lets the loads be 16 bytes wide.
    Returns ``sum_j weight_j * act_j @ W_j^T`` for the tile's ``BLOCK_N`` columns, in
    float32."""
    rows = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    # [BLOCK_TOPK, 16, BLOCK_K] activations and [BLOCK_TOPK, BLOCK_K, BLOCK_N] weights.
    a_ptrs = act_ptrs[:, None, None] + rows[None, :, None] * 0 + offs_k[None, None, :]
    b_ptrs = (w_ptrs[:, None, None] + offs_k[None, :, None]
              + offs_n[None, None, :].to(tl.int64) * stride_wn)
    a_mask = local[:, None, None] & (rows[None, :, None] == 0)
    b_mask = local[:, None, None] & n_ok[None, None, :]
    acc = tl.zeros((BLOCK_TOPK, 16, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k
        a = tl.load(a_ptrs, mask=a_mask & k_ok[None, None, :], other=0.0)
        b = tl.load(b_ptrs, mask=b_mask & k_ok[None, :, None], other=0.0,
                    eviction_policy=EVICT)
        acc = dot_acc(a, b, acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # Rows 1-15 are exact zeros; each expert's product is scaled, then the k are summed.
    return tl.sum(tl.sum(acc, axis=1) * weight[:, None], axis=0)


def fused_moe_gemv_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          expert_offset: int, config: dict) -> torch.Tensor:
    """``bastion.ops.moe.fused_moe`` for a few tokens: ``config`` holds the ``up`` and ``down``
    tiles (``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``num_warps``, ``num_stages``). Every row of
    the result is written; pairs on no local expert add zero."""
    num_tokens, hidden_size = hidden.shape
    num_local, two_n, k_in = w13.shape
    inter, top_k = two_n // 2, topk_ids.shape[1]
    if hidden.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe_gemv: hidden and the weights need a contiguous last dim")
    if k_in != hidden_size or tuple(w2.shape) != (num_local, hidden_size, inter):
        raise ValueError(f"fused_moe_gemv: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do "
                         f"not fit hidden {tuple(hidden.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError("fused_moe_gemv: one routing weight and id per (token, k)")
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    act = torch.empty((num_tokens * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    up, down = _tiles(config)
    pdl, evict = use_pdl(hidden.device), evict_policy(hidden.device)
    routed_bytes = num_tokens * top_k * w2[0].numel() * w2.element_size()  # at the most
    num_pairs, n_tiles = num_tokens * top_k, triton.cdiv(inter, up["BLOCK_SIZE_N"])
    split, k_split = _up_split(up, hidden_size)
    splits = {}
    if split > 1:  # the partial sums, and a count a (pair, tile) for the last split to merge
        splits = {"part_ptr": torch.empty((num_pairs * split, 2, inter), dtype=torch.float32,
                                          device=hidden.device),
                  "counts_ptr": zeroed_counters("moe_up", hidden.device, num_pairs * n_tiles),
                  "k_split": k_split}
    _moe_gemv_up_kernel[(num_pairs, n_tiles, split)](
        hidden, w13, act, ids, expert_offset, num_local, inter, hidden_size, hidden.stride(0),
        w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k,
        BLOCK_N=up["BLOCK_SIZE_N"], BLOCK_K=up["BLOCK_SIZE_K"], USE_PDL=pdl,
        EVICT=evict, SPLIT=split, FOLD=_up_fold(up),
        RELEASE_AT_END=bool(pdl) and envs.get("BASTION_MOE_UP_RELEASE_AT_END"),
        num_warps=up["num_warps"], num_stages=up["num_stages"],
        launch_pdl=bool(pdl), **_up_ahead(pdl, up, w13),
        **_dot_args("up", up, hidden), **splits)
    _moe_gemv_down_kernel[(num_tokens, triton.cdiv(hidden_size, down["BLOCK_SIZE_N"]))](
        act, w2, out, ids, weights, expert_offset, num_local, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), TOP_K=top_k,
        BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_N=down["BLOCK_SIZE_N"],
        BLOCK_K=down["BLOCK_SIZE_K"], USE_PDL=pdl,
        PREFETCH=(use_prefetch(hidden.device, routed_bytes)
                  and envs.get("BASTION_MOE_DOWN_PREFETCH")),
        W_BYTES=w2.element_size(), LINES=prefetch_lanes(down["num_warps"]), EVICT=evict,
        num_warps=down["num_warps"], num_stages=down["num_stages"], launch_pdl=bool(pdl),
        **_dot_args("down", down, hidden))
    return out


def _dot_args(part: str, tile: dict, hidden: torch.Tensor) -> dict:
    """``BASTION_MOE_UP_DOT=1`` / ``BASTION_MOE_DOWN_DOT=1`` (``part`` "up" / "down"): that
    kernel's products as dots (``_up_dot``, ``_down_dot``); its tile needs 16 columns or more
    (``BASTION_MOE_GEMV_CONFIG='up=16,...'``, ``'down=16,...'``)."""
    name = f"BASTION_MOE_{part.upper()}_DOT"
    if not envs.get(name):
        return {}
    if tile["BLOCK_SIZE_N"] < 16 or tile["BLOCK_SIZE_K"] < 16:
        raise ValueError(f"{name} needs {part} tiles of 16 columns or more, not "
                         f"{tile['BLOCK_SIZE_N']}x{tile['BLOCK_SIZE_K']} "
                         f"(BASTION_MOE_GEMV_CONFIG='{part}=16,...')")
    return {"DOT": True, "IEEE": hidden.dtype == torch.float32}


def _up_split(up: dict, k: int) -> tuple[int, int]:
    """``BASTION_MOE_UP_SPLIT=S``: how many programs share a tile's ``k`` columns, and how
    many columns each takes: whole ``BLOCK_SIZE_K`` steps, the same number each but the
    last, so at most S programs (fewer when K is short or the steps do not divide, e.g. 16
    steps with S=5: 4 of 4 steps); one program and all of K without the variable."""
    want, steps = envs.get("BASTION_MOE_UP_SPLIT"), triton.cdiv(k, up["BLOCK_SIZE_K"])
    if want <= 1:
        return 1, k
    per_split = triton.cdiv(steps, want)
    split = triton.cdiv(steps, per_split)
    return (split, per_split * up["BLOCK_SIZE_K"]) if split > 1 else (1, k)


def _up_fold(up: dict) -> int:
    """``BASTION_MOE_UP_FOLD=1``: the up tile's ``fold_width``; 0 without the variable."""
    if not envs.get("BASTION_MOE_UP_FOLD"):
        return 0
    return fold_width(up["BLOCK_SIZE_N"], up["BLOCK_SIZE_K"], up["num_warps"])


def fold_width(block_n: int, block_k: int, num_warps: int) -> int:
    """How many adjacent products a thread of the elementwise up kernel folds into one sum a
    step: the columns it holds of a row (Triton's layout for the tile gives a thread up to 16
    bytes of a row, 8 two-byte weights)."""
    return max(1, min(8, block_n * block_k // (32 * num_warps), block_k))


def _up_ahead(pdl: int, up: dict, w13: torch.Tensor) -> dict:
    """``BASTION_MOE_UP_AHEAD=D``: the up kernel's programs ask L2 for their rows' K step D
    ahead of the one they load (under programmatic launch, as the other decode prefetches;
    2-byte weights, tiles of whole 128-byte lines and K a multiple of the tile: else
    nothing)."""
    ahead = envs.get("BASTION_MOE_UP_AHEAD")
    if (not ahead or not pdl or w13.element_size() != 2 or up["BLOCK_SIZE_K"] % 64
            or w13.shape[2] % up["BLOCK_SIZE_K"]):
        return {}
    return {"AHEAD": ahead, "LANES": prefetch_lanes(up["num_warps"])}


def _tiles(config: dict) -> tuple[dict, dict]:
    """The up and down tiles: the tuned table's, or ``BASTION_MOE_GEMV_CONFIG``'s."""
    tiles = envs.get("BASTION_MOE_GEMV_CONFIG")
    return tiles.get("up", config["up"]), tiles.get("down", config["down"])
