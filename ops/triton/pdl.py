"""Programmatic dependent launch (Hopper on) for the kernels of a decode step.

A decode step at batch 1 is a chain of small kernels (per layer of Qwen3-30B-A3B: ten, most
a few microseconds long), and each one's ramp — its programs launched, their first loads in
flight — is time in which the device reads nothing. Launched with ``launch_pdl``, a kernel's
grid may start while the kernel before it drains: it reads what does not depend on that
kernel (weights, the step's staged metadata) meanwhile, and waits (``wait_for_previous``)
before it reads that kernel's output. Captured into a CUDA graph the dependency stays a
programmatic edge.

When a kernel lets the one after it launch is what the chain can prefetch across:
- late (``BASTION_PDL_EARLY=0``): a kernel lets the next launch once it has waited itself
  (``gdc_launch_dependents`` right after ``gdc_wait``), so a grid starts at most one kernel
  early, and its pre-wait reads of the outputs of the kernel *two* before it are safe;
- early (the default): every kernel lets the next launch as it starts (``release_early``), so
  the grids of a run of short kernels start together and each weight-bound kernel among them
  whose weights fit well inside L2 reads its whole weight tile while the latency-bound ones
  before it run: Qwen3-30B-A3B's o-projection (17 MB) while rotary and attention run, the
  next layer's QKV while the experts stream (into registers when one row's K is at most
  4096, ``ops/triton/gemv.py``; else into L2, ``prefetch_l2``). Only the MoE up kernel
  releases late: the down kernel after it reads the routing's ids before its wait. A kernel
  released early therefore reads nothing before its wait but weights and the step's staged
  metadata (written before the graph runs);
- in both, every program waits before it ends, or at least program 0 does (a grid must not
  end before the one before it, or a wait behind it would return early).

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
def release_early(USE_PDL: tl.constexpr):
    """At a kernel's start: let the next kernel launch now (early mode, ``USE_PDL == 2``)."""
    if USE_PDL == 2:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr, RELEASE: tl.constexpr = False):
    """Wait for the kernel before this one (its writes visible); in late mode (or with
    ``RELEASE``, for a kernel whose successor reads before its wait) let the next launch."""
    if USE_PDL:
        gdc_wait()
        if (USE_PDL == 1) | RELEASE:
            gdc_launch_dependents()


@triton.jit
def prefetch_l2(base_ptr, num_bytes, LINES: tl.constexpr):
    """Ask L2 for ``num_bytes`` from ``base_ptr`` (any pointer type), one ``prefetch`` per
    128-byte line over ``LINES`` lanes (a power of two; each lane takes every LINES-th line).
    A hint: nothing waits for it and nothing is read into registers."""
    base = base_ptr.to(tl.pointer_type(tl.int8))
    lane = tl.arange(0, LINES).to(tl.int64) * 128
    last = num_bytes - 1
    for start in range(0, num_bytes, LINES * 128):
        offs = tl.minimum(start + lane, last)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base + offs], dtype=tl.int32, is_pure=False, pack=1)


def use_pdl(device: torch.device) -> int:
    """How decode kernels on ``device`` launch: 0 without programmatic dependent launch,
    1 letting the next kernel launch after their wait, 2 as they start (see the module)."""
    if gdc_wait is None or not envs.get("BASTION_PDL") or not supports_pdl(device):
        return 0
    return 2 if envs.get("BASTION_PDL_EARLY") else 1


def use_grouped_moe_pdl(device: torch.device) -> int:
    """``use_pdl`` for the grouped-GEMM MoE path (``moe_align``, ``fused_moe``, ``moe_sum``)
    where ``BASTION_MOE_GROUPED_PDL`` asks for it, else 0. Each of those kernels waits before
    its first read, so in either mode it reads nothing early: the gain is the launch and the
    programs' ramp hidden behind the kernel before."""
    return use_pdl(device) if envs.get("BASTION_MOE_GROUPED_PDL") else 0


def evict_policy(device: torch.device) -> str:
    """The L2 policy of a decode step's weight loads in the matrix-vector and MoE expert kernels:
    ``evict_first``, since each is read once a step and should not push out what is read again
    (the down kernel's prefetched rows, activations, the KV cache); Qwen3-30B-A3B at batch 1
    on an H200: 333.8-342.9 ms a batch against 345.6-369.7 without (docs/BENCHMARKS.md, session
    29). Off without programmatic launch (``BASTION_PDL=0``) and with
    ``BASTION_L2_EVICT_FIRST=0``."""
    return "evict_first" if use_pdl(device) and envs.get("BASTION_L2_EVICT_FIRST") else ""


def use_prefetch(device: torch.device, num_bytes: int) -> bool:
    """Whether a weight-bound decode kernel reading ``num_bytes`` of weights prefetches them
    into L2 before its wait: only when the kernels before it let it start early, and only
    weights that fit well inside L2 (60 %). A larger product's early programs would pull in
    more than L2 holds and read it twice: Llama-3.1-8B's batch-1 decode took 10 % longer
    with every product prefetching (docs/BENCHMARKS.md, session 19)."""
    return (use_pdl(device) == 2 and envs.get("BASTION_L2_PREFETCH")
            and num_bytes <= 0.6 * _l2_bytes(device))


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def prefetch_lanes(num_warps: int) -> int:
    """One prefetch lane per thread of a program."""
    return 32 * num_warps


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` can start while the kernel before them drains (sm90 on)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
