"""Tensor-parallel linear layers.

Column-parallel layers split output features over TP ranks (no communication in forward);
row-parallel layers split input features and all-reduce their output. Each layer's base matmul
is its ``quant_method`` (a dense ``F.linear`` unless the loader kept the weights quantized, see
layers/quantization.py); whatever wraps a layer adds to that output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bastion.core.models.layers.quantization import UNQUANTIZED, LinearMethod
from bastion.ops.communicator import get_tp_group


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _base_matmul(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A TP layer's own matmul (its ``quant_method``), with each row's LoRA delta added when
    the layer has adapter slots (core/lora/layers.py)."""
    if layer.lora is None:
        return layer.quant_method.apply(layer, x, bias)
    return layer.lora.apply(x, lambda: layer.quant_method.apply(layer, x, bias))


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match the parameter's "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    """The full layer on every rank (e.g. the MoE router)."""

    quant_method: LinearMethod = UNQUANTIZED

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _new_param(output_size, input_size)
        self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = _new_param(output_size)
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's rows (output features) split over TP ranks."""

    quant_method: LinearMethod = UNQUANTIZED

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.output_size_per_partition = _divide(output_size, self.tp.world_size, "output size")
        self.gather_output = gather_output
        self.lora = None  # core/lora LoRASlots, when LoRA is enabled
        self.weight = _new_param(self.output_size_per_partition, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _new_param(self.output_size_per_partition)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _base_matmul(self, x, self.bias)
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj -> gate_up_proj);
    each rank holds its slice of every part, parts in order."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = [_divide(s, self.tp.world_size, "output size") for s in output_sizes]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear loads one part at a time (shard_id)")
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        target = param.data.narrow(0, offset, size)
        default_weight_loader(target, loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; heads are split over TP ranks.

    When there are fewer KV heads than ranks, each KV head is replicated on
    ``world_size / total_num_kv_heads`` consecutive ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            _divide(tp_size, total_num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        output = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output, bias)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: str | None = None) -> None:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp.rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp.rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be q, k or v; got {shard_id!r}")
        target = param.data.narrow(0, offset, size)
        default_weight_loader(target, loaded.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's columns (input features) split over TP ranks; the partial
    products are summed by an all-reduce, then the bias is added once."""

    quant_method: LinearMethod = UNQUANTIZED

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size_per_partition = _divide(input_size, self.tp.world_size, "input size")
        self.reduce_results = reduce_results
        self.lora = None  # core/lora LoRASlots; added to the partial product (core/lora/layers.py)
        self.weight = _new_param(output_size, self.input_size_per_partition)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _new_param(output_size)
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _base_matmul(self, x, None)  # the bias is added once, after the reduce
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
