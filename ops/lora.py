"""Batched LoRA over mixed adapters (Punica's shrink/expand): every token row carries the device
slot of its adapter (-1: none), and one launch serves every slot of a batch.

``lora_a`` is stacked ``[num_slots, R, K]`` and ``lora_b`` ``[num_slots, N, R]`` per slot; slots
are fixed-size (rank padded with zeros to ``R``), so shapes never change between steps and a
CUDA graph captured once serves any mix of adapters. No function here syncs with the host.
"""

from __future__ import annotations

import torch

from bastion.ops._dispatch import triton_launcher, use_triton


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[t] += x[t] @ lora_a[token_slots[t]]^T`` (float32 ``[T, R]``, zeroed by the
    caller); rows of slot -1 are left as they are (expand skips them)."""
    if use_triton(x, lora_a, token_slots, out):
        launcher = triton_launcher("lora_shrink", "lora_shrink_triton")
        if launcher is not None:
            launcher(x, lora_a, token_slots, out)
            return
    lora_shrink_ref(x, lora_a, token_slots, out)


def lora_expand(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """``y[t] += scales[s] * h[t] @ lora_b[s]^T`` with ``s = token_slots[t]``, in place; rows of
    slot -1 are left exactly as they are (the base model's output)."""
    if use_triton(h, lora_b, token_slots, scales, y):
        launcher = triton_launcher("lora_expand", "lora_expand_triton")
        if launcher is not None:
            launcher(h, lora_b, token_slots, scales, y)
            return
    lora_expand_ref(h, lora_b, token_slots, scales, y)


def lora_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    # One matmul per slot over all rows, kept where the row is that slot's: no host sync, and
    # a row's value is exactly its own adapter's product.
    slots = token_slots.view(-1, 1)
    for slot in range(lora_a.shape[0]):
        part = x.float() @ lora_a[slot].float().T
        out.copy_(torch.where(slots == slot, out + part, out))


def lora_expand_ref(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    y: torch.Tensor,
) -> None:
    slots = token_slots.view(-1, 1)
    for slot in range(lora_b.shape[0]):
        part = (h @ lora_b[slot].float().T) * scales[slot]
        y.copy_(torch.where(slots == slot, (y.float() + part).to(y.dtype), y))
