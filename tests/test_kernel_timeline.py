"""scripts/kernel_timeline.py: a traced run's kernels laid out per layer (the benchmarks read
where a decode layer's time goes under overlapping launches from it)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

from kernel_timeline import Kernel, Position, format_timeline, layer_timeline


def _layer(t0: float, extra: bool = False) -> list[Kernel]:
    """attention [t0, t0+5), o_proj [t0+4, t0+9) (overlapping it), norm [t0+11, t0+12)."""
    kernels = [Kernel("attention", t0, t0 + 5), Kernel("o_proj", t0 + 4, t0 + 9),
               Kernel("norm", t0 + 11, t0 + 12)]
    if extra:  # a step's last layer carries its sampling
        kernels.append(Kernel("sample", t0 + 14, t0 + 15))
    return kernels


def test_layers_with_the_common_sequence_give_medians_of_start_length_and_gap():
    kernels = ([Kernel("embed", 0, 2)] + _layer(10) + _layer(30) + _layer(50, extra=True)
               + _layer(70))
    t = layer_timeline(kernels, "attention")
    # Layers open at 10, 30 and 50 (70 opens none); 50's carries "sample" and drops out.
    assert t.num_layers == 2
    assert t.positions == [Position("attention", 0.0, 5.0, 8.0),  # after embed / last norm
                           Position("o_proj", 4.0, 5.0, -1.0),
                           Position("norm", 11.0, 1.0, 2.0)]
    assert t.span == 20.0
    assert t.busy == 10.0  # [0, 9) and [11, 12) of each 20 us
    text = format_timeline(t)
    assert text.splitlines()[0] == ("one layer (2 alike): span 20.0 us, some kernel running "
                                    "10.0 us of it")
    assert text.splitlines()[3].split() == ["4.0", "5.0", "-1.0", "o_proj"]


def test_a_trace_with_fewer_than_two_markers_is_refused():
    with pytest.raises(ValueError, match="fewer than two"):
        layer_timeline(_layer(0), "attention")
