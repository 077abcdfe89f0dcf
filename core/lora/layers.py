"""One linear layer's adapter slots: stacked A and B on the device, applied after the base
matmul.

A fused layer (qkv_proj, gate_up_proj) holds several PEFT modules as slices of its output:
their A matrices are stacked along the rank and their B matrices block-diagonally (slice i's
output columns read rank block i), so one shrink and one expand serve the whole layer. Tensor parallelism shards the adapter like its base layer:

- column-parallel (qkv, gate_up): A is replicated, B is split by output rows like W, so each
  rank's ``x A^T B_r^T`` is exactly its columns of the full delta;
- row-parallel (o, down): A is split by input columns like W, B is replicated; each rank adds
  ``x_r A_r^T B^T`` to its partial product before the all-reduce, which sums the partials
  ``sum_r x_r A_r^T = x A^T`` through B (linear), so no extra collective is needed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bastion.core.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from bastion.ops.lora import lora_expand, lora_shrink, lora_split_k, max_split_scratch


class Slice(NamedTuple):
    module: str  # the PEFT module name (q_proj, ...)
    offset: int  # first output column on this rank
    size: int  # output columns on this rank


class LoRAState:
    """What every LoRA layer of one model shares: the per-token slot index of the current step
    (a fixed device buffer, so captured graphs read it in place), the slots' scales, whether
    this step has any adapter row at all (eager steps without one skip LoRA), and the scratch
    the shrink's partials pass through to the expand (``max_width``: the widest layer's
    stacked rank)."""

    def __init__(
        self, max_loras: int, max_tokens: int, max_width: int, device: torch.device
    ) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.is_active = False
        # NOTE: one buffer for every layer: a layer's expand reads it before the next layer's
        # shrink writes it (one stream). Persistent, so captured graphs use it in place, and
        # never zeroed: the shrink writes every partial the expand reads.
        self.scratch = torch.zeros(
            max_split_scratch(max_tokens) * max_width, dtype=torch.float32, device=device
        )

    def partials(self, num_tokens: int, hidden: int, width: int) -> torch.Tensor:
        """The ``[SPLIT_K, T, width]`` view of the scratch for one layer's shrink."""
        split_k = lora_split_k(num_tokens, hidden)
        return self.scratch[: split_k * num_tokens * width].view(split_k, num_tokens, width)


class LoRASlots:
    """``max_loras`` adapter slots of one linear layer (rank padded to ``max_rank``)."""

    def __init__(
        self,
        layer: torch.nn.Module,
        slices: list[Slice],
        state: LoRAState,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.slices = slices
        self.state = state
        self.max_rank = max_rank
        num_slots = state.scales.shape[0]
        input_size = layer.weight.shape[1]
        output_size = layer.weight.shape[0]
        self.lora_a = torch.zeros(
            num_slots, len(slices) * max_rank, input_size, dtype=dtype, device=device
        )
        # B is block-diagonal over the slices (slice i's columns read only rank block i), so one
        # expand launch serves a fused layer; the zero blocks cost a few MB of reads a step.
        self.lora_b = torch.zeros(
            num_slots, output_size, len(slices) * max_rank, dtype=dtype, device=device
        )

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter's (already sharded) ``A [r, in]``, ``B [out, r]`` per module into
        ``slot``; modules it does not adapt stay zero."""
        r = self.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, part in enumerate(self.slices):
            if part.module not in weights:
                continue
            a, b = weights[part.module]
            rank = a.shape[0]
            self.lora_a[slot, i * r : i * r + rank].copy_(a)
            self.lora_b[slot, part.offset : part.offset + part.size, i * r : i * r + rank].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each row's adapter delta into ``y`` (rows of slot -1 keep the base output)."""
        if not self.state.is_active:
            return
        num_tokens = x.shape[0]
        slots = self.state.token_slots[:num_tokens]
        h = self.state.partials(num_tokens, x.shape[1], self.lora_a.shape[1])
        lora_shrink(x, self.lora_a, slots, h)
        lora_expand(h, self.lora_b, slots, self.state.scales, y)


def lora_slices(layer: torch.nn.Module, modules: tuple[str, ...]) -> list[Slice]:
    """The PEFT modules a layer's output is made of, with their columns on this rank."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.q_size, layer.kv_size
        return [Slice(modules[0], 0, q), Slice(modules[1], q, kv), Slice(modules[2], q + kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        offsets = [sum(layer.output_sizes[:i]) for i in range(len(layer.output_sizes))]
        return [Slice(m, o, s) for m, o, s in zip(modules, offsets, layer.output_sizes)]
    return [Slice(modules[0], 0, layer.weight.shape[0])]


def shard_lora(
    layer: torch.nn.Module, part: Slice, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's share of one module's full ``A [r, in]`` and ``B [out, r]``."""
    tp = layer.tp
    if isinstance(layer, RowParallelLinear):
        size = layer.input_size_per_partition
        return a.narrow(1, tp.rank * size, size), b
    rank = tp.rank
    if isinstance(layer, QKVParallelLinear) and part.module in ("k_proj", "v_proj"):
        rank = tp.rank // layer.num_kv_head_replicas
    return a, b.narrow(0, rank * part.size, part.size)
