"""MoE routing: softmax over the router logits, top-k, optional renormalisation, in one kernel.

One program takes ``BLOCK_T`` tokens with all their expert logits in registers (``E`` is at
most a few hundred), so routing costs one launch and no device-to-host traffic; the torch
reference is ``bastion.ops.moe.select_experts_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion.ops.triton.pdl import release_early, use_pdl, wait_for_previous


@triton.jit
def _moe_routing_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_real_ptr,
    num_tokens,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_early(USE_PDL)
    # The step's count of real tokens is staged before the step runs: read before the wait,
    # it is not a second round trip after the reductions (kernel_resources.py --order).
    if HAS_NUM_REAL:
        num_real = tl.load(num_real_ptr)
    wait_for_previous(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (cols[None, :] < NUM_EXPERTS)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :],
                mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past the end: finite, and never stored
    x = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = x / tl.sum(x, axis=1)[:, None]
    # Padding columns hold probability 0; a chosen expert is set to -1 so it is not chosen
    # again. Ties go to the lowest expert id (torch.topk on the CPU promises no order).
    probs = tl.where(mask, probs, -1.0)
    kcols = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        idx = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top_w = tl.where(kcols[None, :] == k, best[:, None], top_w)
        top_i = tl.where(kcols[None, :] == k, idx[:, None], top_i)
        probs = tl.where(cols[None, :] == idx[:, None], -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    if HAS_NUM_REAL:  # padding rows past the step's real tokens choose no expert
        top_i = tl.where((rows < num_real)[:, None], top_i, -1)
    out = rows[:, None] * TOP_K + kcols[None, :]
    out_mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=out_mask)
    tl.store(ids_ptr + out, top_i, mask=out_mask)


def moe_routing_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       num_real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` [T, E] -> (weights float32 [T, k], expert ids int32 [T, k]), the k
    largest softmax probabilities in descending order; rows at or past the device scalar
    ``num_real`` get id -1."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"moe routing expects [T, E] with a contiguous last dim; got "
                         f"{tuple(router_logits.shape)} strides {router_logits.stride()}")
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}]; got {top_k}")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // block_e, triton.next_power_of_2(num_tokens)))
    # NOTE: a decode step's few rows fit one warp, whose reductions (two for the softmax, two
    # per expert chosen) stay in registers instead of crossing warps through shared memory.
    num_warps = 1 if block_t * block_e <= 1024 else 4
    pdl = use_pdl(router_logits.device)
    _moe_routing_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_real if num_real is not None else ids, num_tokens,
        router_logits.stride(0),
        NUM_EXPERTS=num_experts, BLOCK_E=block_e, TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        HAS_NUM_REAL=num_real is not None, BLOCK_T=block_t, USE_PDL=pdl,
        num_warps=num_warps, launch_pdl=bool(pdl))
    return weights, ids
