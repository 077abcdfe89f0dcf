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

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from bastion import envs
from bastion.core.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from bastion.ops.lora import (
    LoRAIndex,
    build_lora_index,
    lora_expand,
    lora_shrink,
    max_row_tiles,
)


class Slice(NamedTuple):
    module: str  # the PEFT module name (q_proj, ...)
    offset: int  # first output column on this rank
    size: int  # output columns on this rank


class LoRAState:
    """What every LoRA layer of one model shares: the step's ``LoRAIndex`` (each row's slot and
    the rows grouped by slot, fixed device buffers, so captured graphs read them in place), the
    slots' scales, whether this step has any adapter row at all (eager steps without one skip
    LoRA), and the scratch ``h`` passes through from shrink to expand (``max_width``: the widest
    layer's stacked rank) with the expand's tile counters."""

    def __init__(
        self, max_loras: int, max_tokens: int, max_width: int, device: torch.device
    ) -> None:
        self.max_tokens = max_tokens
        # One buffer, so a step's index is one copy: [slot_starts | token_slots | row_ids].
        self.index_buffer = torch.zeros(
            max_loras + 1 + 2 * max_tokens, dtype=torch.int32, device=device
        )
        starts, token_slots, row_ids = self.index_buffer.split(
            [max_loras + 1, max_tokens, max_tokens]
        )
        token_slots.fill_(-1)
        self.index = LoRAIndex(token_slots, row_ids, starts)
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.is_active = False
        # NOTE: one scratch for every layer: a layer's expand has read and zeroed it before the
        # next layer's shrink adds into it (the side stream waits for the main one first).
        # Zero between calls, persistent, so captured graphs use it in place; so are the
        # counters.
        self.scratch = torch.zeros(max_tokens * max_width, dtype=torch.float32, device=device)
        self.tile_counts = torch.zeros(
            max_loras, max_row_tiles(max_tokens), dtype=torch.int32, device=device
        )
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def side_stream(self) -> torch.cuda.Stream | None:
        """The stream a layer's shrink overlaps its base matmul on: only inside a CUDA graph
        capture (eager steps would pay the host cost of the stream switches) and unless
        BASTION_LORA_SIDE_STREAM=0."""
        if (self._side_stream is None or not torch.cuda.is_current_stream_capturing()
                or not envs.get("BASTION_LORA_SIDE_STREAM")):
            return None
        return self._side_stream

    def set_rows(self, token_slots: np.ndarray) -> None:
        """This step's slot of every row, from the first (later rows, a graph's padding, get
        -1), with the rows grouped by slot: one copy to the device, not waited for."""
        n = len(token_slots)
        if n > self.max_tokens:
            raise RuntimeError(f"a step of {n} rows exceeds the LoRA index of {self.max_tokens}")
        num_slots = self.scales.shape[0]
        row_ids, starts = build_lora_index(token_slots, num_slots)
        pad = np.full(self.max_tokens - n, -1, dtype=np.int32)
        host = np.concatenate([starts, np.asarray(token_slots, dtype=np.int32), pad, row_ids])
        copy = torch.from_numpy(host)
        if self.index_buffer.is_cuda:
            copy = copy.pin_memory()
        self.index_buffer[: len(host)].copy_(copy, non_blocking=True)
        self.is_active = len(row_ids) > 0

    def h(self, num_tokens: int, width: int) -> torch.Tensor:
        """The ``[T, width]`` view of the scratch for one layer's shrink and expand."""
        return self.scratch[: num_tokens * width].view(num_tokens, width)


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
        # NOTE: the slices tile the output in order from column 0, as lora_slices makes them.
        self.slice_ends = tuple(part.offset + part.size for part in slices)
        num_slots = state.scales.shape[0]
        input_size = layer.weight.shape[1]
        output_size = layer.weight.shape[0]
        self.lora_a = torch.zeros(
            num_slots, len(slices) * max_rank, input_size, dtype=dtype, device=device
        )
        # B is block-diagonal over the slices (slice i's columns read only rank block i), so one
        # expand launch serves a fused layer; the kernel reads only the blocks (slice_ends).
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

    def apply(self, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``base()`` (the layer's own matmul of ``x``) with each row's adapter delta added
        (rows of slot -1 keep the base output).

        While a CUDA graph is captured the shrink, which reads only ``x``, runs on the
        state's side stream beside the base matmul and the expand joins both: at decode sizes
        the shrink is a few microseconds of latency that the GEMM hides."""
        state = self.state
        if not state.is_active:
            return base()
        h = state.h(x.shape[0], self.lora_a.shape[1])
        side = state.side_stream()
        if side is None:
            y = base()
            lora_shrink(x, self.lora_a, state.index, h)
        else:
            main = torch.cuda.current_stream()
            side.wait_stream(main)  # x is ready, and the last layer's expand has zeroed h
            with torch.cuda.stream(side):
                lora_shrink(x, self.lora_a, state.index, h)
            y = base()
            main.wait_stream(side)
        lora_expand(
            h, self.lora_b, state.index, state.scales, y, state.tile_counts, self.slice_ends
        )
        return y


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
