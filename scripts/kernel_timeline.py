"""Where a decode step's device time goes when its kernels overlap.

Under programmatic dependent launch (``ops/triton/pdl.py``) a kernel's grid starts while the one
before it drains, so the sum of the kernels' own times says little about a layer's length. This
lays the kernels of one traced run out in time instead: the layers (the runs between two starts
of a marker kernel, e.g. attention) that share the most common sequence of kernel names, and
for each position in that sequence the median start from the layer's start, length, and gap
from the end of the kernel before it (negative: the two overlapped). A layer's span is from
its marker's start to the next one's.

    from kernel_timeline import kernels_of, layer_timeline, format_timeline
    print(format_timeline(layer_timeline(kernels_of(prof), "attention")))
"""

from __future__ import annotations

import collections
import itertools
import statistics
from typing import NamedTuple


class Kernel(NamedTuple):
    name: str
    start: float  # us
    end: float  # us


class Position(NamedTuple):
    """One kernel of the layer's sequence (medians over the layers, us)."""

    name: str
    start: float  # from the layer's start
    length: float
    gap: float  # from the end of the kernel before it; negative: they overlapped


class Timeline(NamedTuple):
    positions: list[Position]
    span: float  # median us from a layer's marker to the next one's
    busy: float  # median us of the span in which at least one kernel runs
    num_layers: int  # layers with the common sequence (the others are left out)


def kernels_of(prof) -> list[Kernel]:
    """The device kernels of a ``torch.profiler.profile`` run, by start."""
    kernels = [Kernel(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    return sorted(kernels, key=lambda k: k.start)


def layer_timeline(kernels: list[Kernel], marker: str) -> Timeline:
    """The layers between consecutive kernels whose name contains ``marker`` (the last such
    kernel opens no layer: nothing closes it), reduced to those with the most common sequence
    of names (a step's first and last layers carry its other kernels and drop out)."""
    starts = [i for i, k in enumerate(kernels) if marker in k.name]
    layers = list(itertools.pairwise(starts))
    if not layers:
        raise ValueError(f"fewer than two kernels named like {marker!r}")
    names = collections.Counter(tuple(k.name for k in kernels[i:j]) for i, j in layers)
    common = names.most_common(1)[0][0]
    kept = [(i, j) for i, j in layers if tuple(k.name for k in kernels[i:j]) == common]
    positions = []
    for p, name in enumerate(common):
        starts_p, lengths, gaps = [], [], []
        for i, _ in kept:
            k = kernels[i + p]
            starts_p.append(k.start - kernels[i].start)
            lengths.append(k.end - k.start)
            if i + p > 0:
                gaps.append(k.start - kernels[i + p - 1].end)
        positions.append(Position(name, statistics.median(starts_p),
                                  statistics.median(lengths),
                                  statistics.median(gaps) if gaps else 0.0))
    spans = [kernels[j].start - kernels[i].start for i, j in kept]
    busy = [_covered(kernels[i:j], kernels[i].start, kernels[j].start) for i, j in kept]
    return Timeline(positions, statistics.median(spans), statistics.median(busy), len(kept))


def _covered(kernels: list[Kernel], lo: float, hi: float) -> float:
    """How much of [lo, hi) at least one of ``kernels`` runs in."""
    total, reach = 0.0, lo
    for k in sorted(kernels, key=lambda k: k.start):
        start, end = max(k.start, reach), min(k.end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def format_timeline(t: Timeline, width: int = 60) -> str:
    lines = [(f"one layer ({t.num_layers} alike): span {t.span:.1f} us, some kernel running "
              f"{t.busy:.1f} us of it"),
             f"{'start us':>9} {'length':>7} {'gap':>6}  kernel"]
    lines += [f"{p.start:9.1f} {p.length:7.1f} {p.gap:6.1f}  {p.name[:width]}"
              for p in t.positions]
    return "\n".join(lines)
