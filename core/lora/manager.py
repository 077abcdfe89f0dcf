"""A worker's adapters: the device slots of every LoRA layer, an LRU host cache, and the
per-token slot index the model runner builds each step."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from bastion.core.config import LoRAConfig
from bastion.core.lora.layers import LoRASlots, LoRAState, lora_slices, shard_lora
from bastion.core.lora.peft import LoRAError, load_peft_adapter
from bastion.ipc.messages import LoRARequest
from bastion.ops.lora import precompile_lora

logger = logging.getLogger(__name__)

# (attribute path of a linear layer inside a decoder layer, the PEFT modules it holds)
_TARGETS = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)


@dataclass
class _HostAdapter:
    """One adapter on the host, already sharded for this rank and in the model's dtype:
    ``weights[(layer, target)][module] = (A, B)``."""

    request: LoRARequest
    scale: float
    weights: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]]


class LoRAManager:
    """Owns ``max_loras`` device slots per LoRA layer and up to ``max_cpu_loras`` adapters in
    host memory, both evicted least recently used first; an adapter a batch uses is never
    evicted for that batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        hf_config: PretrainedConfig,
        config: LoRAConfig,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.hf_config = hf_config
        self.config = config
        self.dtype = dtype
        max_width = max(len(modules) for _, modules in _TARGETS) * config.max_lora_rank
        self.state = LoRAState(config.max_loras, max_tokens, max_width, device)
        self.layers: dict[tuple[int, str], LoRASlots] = {}
        self.mlp_layers: set[int] = set()
        for index, decoder_layer in enumerate(model.model.layers):
            for path, modules in _TARGETS:
                owner_name, attr = path.split(".")
                linear = getattr(getattr(decoder_layer, owner_name), attr, None)
                if linear is None:
                    continue  # an MoE layer's experts take no adapter
                if owner_name == "mlp":
                    self.mlp_layers.add(index)
                slots = LoRASlots(
                    linear,
                    lora_slices(linear, modules),
                    self.state,
                    config.max_lora_rank,
                    dtype,
                    device,
                )
                linear.lora = slots
                self.layers[(index, path)] = slots
        self._precompile(max_tokens)
        self.host: OrderedDict[int, _HostAdapter] = OrderedDict()
        self.slot_ids: list[int | None] = [None] * config.max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict(
            (s, None) for s in range(config.max_loras)
        )

    def _precompile(self, max_tokens: int) -> None:
        """Build every kernel variant a step can pick now, not in the steps that first need
        one (a Triton build takes about a second); no row is in a slot yet."""
        if not self.state.index.row_ids.is_cuda:
            return
        shapes: dict[tuple, LoRASlots] = {}
        for slots in self.layers.values():
            key = (tuple(slots.lora_a.shape), tuple(slots.lora_b.shape), slots.slice_ends)
            shapes.setdefault(key, slots)
        start = time.perf_counter()
        for slots in shapes.values():
            precompile_lora(
                slots.lora_a,
                slots.lora_b,
                slots.slice_ends,
                self.state.index,
                self.state.scales,
                self.state.tile_counts,
                max_tokens,
            )
        logger.info(
            "LoRA kernels for %d layer shapes built in %.1f s",
            len(shapes),
            time.perf_counter() - start,
        )

    # ------------------------------------------------------------------ host cache

    def add(self, request: LoRARequest) -> bool:
        """Read and check the adapter into the host cache (False: it was there already)."""
        if request.lora_int_id in self.host:
            self.host.move_to_end(request.lora_int_id)
            return False
        start = time.perf_counter()
        weights = load_peft_adapter(
            request.lora_path, self.hf_config, self.config.max_lora_rank, self.mlp_layers
        )
        sharded: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in weights.modules.items():
            target = next(((layer, path) for path, mods in _TARGETS if module in mods), None)
            slots = self.layers.get(target)
            if slots is None:
                raise LoRAError(f"adapter {request.lora_path}: layer {layer} has no {module}")
            part = next(p for p in slots.slices if p.module == module)
            a, b = shard_lora(slots.layer, part, a, b)
            sharded.setdefault(target, {})[module] = (
                a.to(self.dtype).contiguous(),
                b.to(self.dtype).contiguous(),
            )
        while len(self.host) >= self.config.num_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.info("LoRA adapter %d left the host cache (least recently used)", evicted)
        self.host[request.lora_int_id] = _HostAdapter(request, weights.scale, sharded)
        logger.info(
            "LoRA adapter %s (id %d, rank %d, %d modules) loaded in %.2f s",
            request.lora_name,
            request.lora_int_id,
            weights.rank,
            len(weights.modules),
            time.perf_counter() - start,
        )
        return True

    def remove(self, lora_id: int) -> bool:
        """Drop the adapter from the host cache and its device slot."""
        found = self.host.pop(lora_id, None) is not None
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
            self.slot_ids[slot] = None
            for slots in self.layers.values():
                slots.clear_slot(slot)
            self.slot_lru.move_to_end(slot, last=False)
            found = True
        return found

    def list_ids(self) -> list[int]:
        return list(self.host)

    # ------------------------------------------------------------------ one step

    def activate(self, requests: list[LoRARequest | None]) -> list[int]:
        """The device slot of each entry (-1: base model), loading adapters that are not in a
        slot into the least recently used slots this batch does not need."""
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        if len(wanted) > len(self.slot_ids):
            raise RuntimeError(
                f"a batch uses {len(wanted)} adapters; max_loras is {len(self.slot_ids)}"
            )
        slot_of = {lora_id: s for s, lora_id in enumerate(self.slot_ids) if lora_id is not None}
        for lora_id, request in wanted.items():
            if lora_id in slot_of:
                self.slot_lru.move_to_end(slot_of[lora_id])
                continue
            slot = next(s for s in self.slot_lru if self.slot_ids[s] not in wanted)
            self._load_slot(slot, request)
            slot_of[lora_id] = slot
        return [-1 if r is None else slot_of[r.lora_int_id] for r in requests]

    def _load_slot(self, slot: int, request: LoRARequest) -> None:
        self.add(request)  # from the host cache, or read now (a worker new to the adapter)
        adapter = self.host[request.lora_int_id]
        for key, slots in self.layers.items():
            slots.set_slot(slot, adapter.weights.get(key, {}))
        self.state.scales[slot] = adapter.scale
        self.slot_ids[slot] = request.lora_int_id
        self.slot_lru.move_to_end(slot)

    def set_token_slots(self, token_slots: np.ndarray) -> None:
        """This step's slot of every token row (padding included); LoRA runs in eager steps
        only when some row has an adapter."""
        self.state.set_rows(token_slots)
