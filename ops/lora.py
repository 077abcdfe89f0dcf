"""Batched LoRA over mixed adapters (Punica's shrink/expand): every token row carries the device
slot of its adapter (-1: none), and one launch serves every slot of a batch.

``lora_a`` is stacked ``[num_slots, R, K]`` and ``lora_b`` ``[num_slots, N, R]`` per slot; slots
are fixed-size (rank padded with zeros to ``R``), so shapes never change between steps and a
CUDA graph captured once serves any mix of adapters. No function here syncs with the host.

The shrink's result ``h`` is float32 ``[SPLIT_K, T, R]``: the K-split partial products, which the
expand sums while loading them (in a fixed order, so results are deterministic). The shrink
writes every partial of a row with a slot, so ``h`` needs no zeroing and can be a persistent
scratch buffer; rows of slot -1 are never written nor read.
"""

from __future__ import annotations

import torch

from bastion.ops._dispatch import triton_launcher, use_triton

# Splitting K pays while the rows fill few tiles (decode, short prefill chunks): a split reads
# at least 1024 columns of x and A, and the partials of a step stay
# within 8192 rows (1.5 MB at rank 48), so the scratch is small and in L2.
_MAX_SPLIT_K = 4
_MIN_SPLIT_COLUMNS = 1024
_MAX_SPLIT_ROWS = 8192
_MAX_SPLIT_TOKENS = 2048  # 32 row tiles of 64: programs enough without a split


def lora_split_k(num_tokens: int, hidden: int) -> int:
    """How many K splits the shrink of a ``[num_tokens, hidden]`` input uses (the leading dim
    of ``h``): into at most 4 (every expand program sums the partials it reads: 16-32 splits
    cost more there than they saved in the shrink, measured on an H200), each of at least
    1024 columns; from 2048 rows not at all."""
    if num_tokens >= _MAX_SPLIT_TOKENS:
        return 1
    by_rows = max(1, _MAX_SPLIT_ROWS // max(num_tokens, 1))
    return max(1, min(_MAX_SPLIT_K, hidden // _MIN_SPLIT_COLUMNS, by_rows))


def max_split_scratch(max_tokens: int) -> int:
    """Rows of ``[*, R]`` partials (``SPLIT_K * T``) the batches of up to ``max_tokens`` need."""
    return max(max_tokens, min(_MAX_SPLIT_ROWS, _MAX_SPLIT_K * max_tokens))


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, h: torch.Tensor
) -> None:
    """``h.sum(0)[t] = x[t] @ lora_a[token_slots[t]]^T`` into float32 partials ``[SPLIT_K, T,
    R]`` (written, not added); rows of slot -1 are left as they are (expand skips them)."""
    if use_triton(x, lora_a, token_slots, h):
        launcher = triton_launcher("lora_shrink", "lora_shrink_triton")
        if launcher is not None:
            launcher(x, lora_a, token_slots, h)
            return
    lora_shrink_ref(x, lora_a, token_slots, h)


def lora_expand(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """``y[t] += scales[s] * h.sum(0)[t] @ lora_b[s]^T`` with ``s = token_slots[t]``, in place;
    rows of slot -1 are left exactly as they are (the base model's output)."""
    if use_triton(h, lora_b, token_slots, scales, y):
        launcher = triton_launcher("lora_expand", "lora_expand_triton")
        if launcher is not None:
            launcher(h, lora_b, token_slots, scales, y)
            return
    lora_expand_ref(h, lora_b, token_slots, scales, y)


def lora_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, h: torch.Tensor
) -> None:
    # One matmul per slot over all rows, kept where the row is that slot's: no host sync, and
    # a row's value is exactly its own adapter's product. The whole product is the first
    # partial; the other partials of a row with a slot are zero.
    slots = token_slots.view(-1, 1)
    for slot in range(lora_a.shape[0]):
        part = x.float() @ lora_a[slot].float().T
        h[0].copy_(torch.where(slots == slot, part, h[0]))
    if h.shape[0] > 1:
        h[1:].masked_fill_((slots >= 0).view(1, -1, 1), 0.0)


def lora_expand_ref(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    y: torch.Tensor,
) -> None:
    slots = token_slots.view(-1, 1)
    total = h[0]
    for split in range(1, h.shape[0]):  # in order, as the kernel sums them
        total = total + h[split]
    for slot in range(lora_b.shape[0]):
        part = (total @ lora_b[slot].float().T) * scales[slot]
        y.copy_(torch.where(slots == slot, (y.float() + part).to(y.dtype), y))
