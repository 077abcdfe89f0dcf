"""Process-group wrappers the parallel layers use: identity when the group has one rank.

``init_model_parallel`` installs the tensor-parallel and expert-parallel groups once per worker
(and again after a fault-tolerance re-init); without it both are single-rank and no
``torch.distributed`` set-up is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupCoordinator:
    """One communication group as seen from this rank."""

    def __init__(self, rank: int = 0, world_size: int = 1,
                 group: dist.ProcessGroup | None = None) -> None:
        if world_size > 1 and group is None:
            raise ValueError("a group with more than one rank needs a torch.distributed group")
        self.rank = rank
        self.world_size = world_size
        self.group = group

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup) -> GroupCoordinator:
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place when there is more than one rank)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's equally shaped ``x`` along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/world_size slice along ``dim``."""
        if self.world_size == 1:
            return x
        if x.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split "
                             f"into {self.world_size} ranks")
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // self.world_size, *moved.shape[1:]),
                          dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, moved, group=self.group)
        return out.movedim(0, dim)

    def all_gather_sizes(self, num_rows: int, device: torch.device) -> list[int]:
        """Every rank's row count (ranks may hold different numbers of tokens)."""
        if self.world_size == 1:
            return [num_rows]
        sizes = self.all_gather(torch.tensor([num_rows], device=device), dim=0)
        return sizes.tolist()

    def all_gatherv(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate rows of every rank along dim 0 where rank r holds ``sizes[r]`` rows."""
        if self.world_size == 1:
            return x
        width = max(max(sizes), 1)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        gathered = self.all_gather(padded, dim=0).view(self.world_size, width, *x.shape[1:])
        return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)], dim=0)

    def reduce_scatterv(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Inverse of ``all_gatherv``: sum over ranks, keep this rank's ``sizes[rank]`` rows."""
        if self.world_size == 1:
            return x
        width = max(max(sizes), 1)
        padded = x.new_zeros((self.world_size, width, *x.shape[1:]))
        for r, part in enumerate(torch.split(x, sizes, dim=0)):
            padded[r, : sizes[r]] = part
        out = self.reduce_scatter(padded.view(-1, *x.shape[1:]), dim=0)
        return out[: sizes[self.rank]]


def _as_coordinator(group: GroupCoordinator | dist.ProcessGroup | None) -> GroupCoordinator:
    if group is None:
        return GroupCoordinator()
    if isinstance(group, GroupCoordinator):
        return group
    return GroupCoordinator.from_process_group(group)


_TP_GROUP = GroupCoordinator()
_EP_GROUP = GroupCoordinator()


def init_model_parallel(tp_group: GroupCoordinator | dist.ProcessGroup | None,
                        ep_group: GroupCoordinator | dist.ProcessGroup | None) -> None:
    """Install the groups the model's layers shard over; ``None`` means a single rank.

    # NOTE: call before building the model: layers read their rank and shard sizes at
    construction time.
    """
    global _TP_GROUP, _EP_GROUP
    _TP_GROUP = _as_coordinator(tp_group)
    _EP_GROUP = _as_coordinator(ep_group)


def destroy_model_parallel() -> None:
    """Back to single-rank groups (before a group is re-created at a new epoch)."""
    init_model_parallel(None, None)


def get_tp_group() -> GroupCoordinator:
    return _TP_GROUP


def get_ep_group() -> GroupCoordinator:
    return _EP_GROUP
