"""Process-group wrappers the parallel layers use: identity when the group has one rank.

``init_model_parallel`` installs the tensor-parallel and expert-parallel groups once per worker
(and again after a fault-tolerance re-init); without it both are single-rank and no
``torch.distributed`` set-up is needed.

Collectives call the c10d process group's own methods, so a group built outside
``torch.distributed``'s global state (``procs.distributed.StatelessGroup.pg``) works the same as
one from ``dist.new_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupCoordinator:
    """One communication group as seen from this rank.

    NOTE: layers keep a reference to the coordinator they were built with, so a re-created
    group (new epoch) is swapped in with ``bind``; rank and size must stay the same because the
    weights were sharded for them.
    """

    def __init__(self, rank: int = 0, world_size: int = 1,
                 group: dist.ProcessGroup | None = None) -> None:
        if world_size > 1 and group is None:
            raise ValueError("a group with more than one rank needs a torch.distributed group")
        self.rank = rank
        self.world_size = world_size
        self.group = group

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup) -> GroupCoordinator:
        return cls(group.rank(), group.size(), group)

    def bind(self, other: GroupCoordinator) -> None:
        """Take over ``other``'s rank, size and process group (in place)."""
        self.rank, self.world_size, self.group = other.rank, other.world_size, other.group

    def detach(self) -> None:
        """Drop the process group but keep rank and size: until the next ``bind`` every
        collective fails loudly instead of silently computing a single-rank result."""
        self.group = None

    def _pg(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError(f"rank {self.rank} of {self.world_size}: the process group was "
                               "destroyed; re-create it (reinit_distributed) before running")
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place when there is more than one rank)."""
        if self.world_size == 1:
            return x
        self._pg().allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's equally shaped ``x`` along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._pg().allgather([parts], [x.contiguous()]).wait()
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
        self._pg()._reduce_scatter_base(out, moved).wait()
        return out.movedim(0, dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place)."""
        if self.world_size == 1:
            return x
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._pg().broadcast([x], opts).wait()
        return x


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
    construction time. Calling it again (a new epoch) rebinds the same coordinator objects, so
    an already built model uses the new groups.
    """
    _TP_GROUP.bind(_as_coordinator(tp_group))
    _EP_GROUP.bind(_as_coordinator(ep_group))


def destroy_model_parallel() -> None:
    """Back to single-rank groups (a fresh model is built afterwards)."""
    init_model_parallel(None, None)


def detach_model_parallel() -> None:
    """The groups are gone but the sharded model stays: collectives fail until the next
    ``init_model_parallel`` (fault recovery between destroying and re-creating groups)."""
    _TP_GROUP.detach()
    _EP_GROUP.detach()


def get_tp_group() -> GroupCoordinator:
    return _TP_GROUP


def get_ep_group() -> GroupCoordinator:
    return _EP_GROUP
