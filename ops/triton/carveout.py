"""Every loaded Triton kernel's preferred split of a SM's on-chip memory between L1 and shared
memory (``BASTION_SMEM_CARVEOUT``, A/B runs).

A SM changes that split only while it holds no program. The staged down product
(``moe_down_smem.py``) needs 204 KB of shared memory a program; the kernels around it need
none, so the driver runs them with a small carve-out and a staged program can become resident
on a SM only once the up kernel's programs there have drained, which is the overlap the
staged form exists for. Preferring the largest carve-out for every kernel lets them share SMs.

The preference is the CUDA function attribute ``PREFERRED_SHARED_MEMORY_CARVEOUT`` (a
percentage of the most shared memory, or -1 for the driver's choice), set on the kernels
loaded so far and, through Triton's load hook, on every kernel loaded after.
"""

from __future__ import annotations

import ctypes
import sys

_PREFERRED_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_state: dict = {"percent": -1, "lib": None}  # lib: libcuda, loaded with the hook added


def apply(percent: int) -> None:
    """Prefer ``percent`` (-1: the driver's choice) for every Triton kernel of bastion's, now
    and as more load. Cheap when unchanged: the few-token MoE launcher calls it on every
    launch (so a model without MoE layers never applies it)."""
    if percent == _state["percent"]:
        return
    if _state["lib"] is None:
        import triton

        _state["lib"] = ctypes.CDLL("libcuda.so.1")
        triton.knobs.runtime.kernel_load_end_hook.add(_on_load)
    _state["percent"] = percent
    for function in _loaded_functions():
        _set(function, percent)


def _on_load(module, function, name, group, key) -> None:  # Triton passes these in order
    if _state["percent"] != -1:
        _set(function, _state["percent"])


def _set(function: int, percent: int) -> None:
    rc = _state["lib"].cuFuncSetAttribute(ctypes.c_void_p(function),
                                          ctypes.c_int(_PREFERRED_CARVEOUT), ctypes.c_int(percent))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(carve-out {percent}) returned CUDA error {rc}")


def _loaded_functions():
    """The CUDA function handles of bastion's Triton and Gluon kernels loaded so far."""
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if not name.startswith("bastion.") or module is None:
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, JITFunction):
                continue
            for cache in value.device_caches.values():
                for kernel in cache[0].values():
                    if getattr(kernel, "function", None):
                        yield kernel.function
