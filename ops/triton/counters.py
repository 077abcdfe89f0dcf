"""Zeroed int32 counters for kernels whose last program of a group finishes the group's work
(a split decode's merge): each group's program counts itself in with an atomic add, and the
one that sees the count reach the group's size resets it to zero, so the buffer is zero again
after every launch and a CUDA graph can replay it."""

from __future__ import annotations

import torch

# Per (owner, device); each owner its own buffer, so two kinds of kernel never share a count.
_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
# Buffers outgrown by a larger need: kept, since a CUDA graph captured with one still uses it.
_OUTGROWN: list[torch.Tensor] = []


def zeroed_counters(owner: str, device: torch.device, needed: int) -> torch.Tensor:
    """At least ``needed`` counters, all zero between launches, kept for ``owner``'s kernels."""
    counters = _COUNTERS.get((owner, device))
    if counters is None or counters.numel() < needed:
        # NOTE: a graph's size runs eagerly before its capture, so a new buffer is never
        # allocated inside one; the one it replaces stays alive for graphs captured with it.
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(needed, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[(owner, device)] = counters
    return counters


def counters_of(owner: str, device: torch.device) -> torch.Tensor | None:
    """``owner``'s counters on ``device`` (tests check they are back at zero), or None."""
    return _COUNTERS.get((owner, device))
