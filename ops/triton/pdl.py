"""Programmatic dependent launch (Hopper on) for the kernels of a decode step.

A decode step at batch 1 is a chain of small kernels (per layer of Qwen3-30B-A3B: ten, most
a few microseconds long), and each one's ramp — its programs launched, their first loads in
flight — is time in which the device reads nothing. Launched with ``launch_pdl``, a kernel's
grid may start while the kernel before it drains: it reads what does not depend on that
kernel (weights, the step's staged metadata) meanwhile, and waits (``wait_for_previous``)
before it reads that kernel's output. Captured into a CUDA graph the dependency stays a
programmatic edge.

The rule every kernel here keeps, so that each may prefetch across one boundary safely:
- it waits before it reads the output of the kernel before it, and it lets the kernel after
  it launch only once it has waited (``gdc_launch_dependents`` right after ``gdc_wait``), so
  a kernel's pre-wait reads of the outputs of the kernel *two* before it are safe as well;
- every program waits before it ends, or at least program 0 does (a grid must not end before
  the one before it, or a wait behind it would return early).

A kernel launched without the attribute (cuBLAS, torch's own) starts only once the one
before it has ended, as usual; ``gdc_wait`` with no programmatic predecessor returns at once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from bastion import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without the intrinsics: no kernel asks for them
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Wait for the kernel before this one (its writes visible), then let the next launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def use_pdl(device: torch.device) -> bool:
    """Whether decode kernels on ``device`` launch with programmatic dependent launch."""
    return gdc_wait is not None and envs.get("BASTION_PDL") and supports_pdl(device)


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` can start while the kernel before them drains (sm90 on)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
