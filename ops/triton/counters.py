"""Zeroed int32 counters for kernels whose last program of a group finishes the group's work
(split-K style), shared by every such kernel on a device: each launch leaves them at zero."""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def zeroed_counters(device: torch.device, needed: int) -> torch.Tensor:
    """At least ``needed`` counters, all zero between launches."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        # NOTE: the largest decode graph is warmed up (eagerly) before any capture, so the
        # buffer a graph holds is never replaced.
        counters = torch.zeros(max(needed, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
