"""C kernels for the CPU path, built with the system C compiler on first use.

Each kernel is one ``<name>.c`` file beside this one, compiled into a shared library under
``$BASTION_CACHE_DIR/cpu-kernels/`` and called through ``ctypes`` with raw pointers: no Python
headers, no torch headers, so a build takes about a second, once. A kernel that calls others
(``LINKED``: the fused decode layers) links their objects into its library, each compiled with
its own flags. The library's name carries a digest of its sources and headers, the compiler
(path, size and time stamp), the flags and the CPU's feature flags: it is compiled with ``-march=native``, so a cache folder shared between machines (an NFS
home, a CI cache) never hands one machine a binary built for another's instruction set. Where
``-march=native`` does not compile, the kernel is built for the compiler's default target.

Without a compiler, or when a build fails, the caller runs its torch reference (logged once:
one line for a missing compiler, one per kernel for a failed build). ``BASTION_CPU_KERNELS=0``
asks for the references explicitly (A/B runs); it is read at every call, so a test can switch.

Builds are safe to race: each process compiles into its own temporary folder beside the cache
and renames the result into place (``os.replace``, atomic on one file system), so a reader sees
either no library or a whole one.

# NOTE: the kernels parallelise with OpenMP over ``torch.get_num_threads()`` threads (passed at
every call). The library asks for ``libgomp.so.1``, which torch's wheel has already loaded
in-process under that soname, so the kernels share torch's thread pool instead of starting a
second runtime whose idle threads would spin against torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bastion import envs

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent
_COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c11")
# Tried in order: the build machine's instruction set, then the compiler's default target.
_ARCH_FLAGS = (("-march=native",), ())
_LINK_FLAGS = ("-shared", "-fopenmp")
_LINK_LIBS = ("-lmvec", "-lm")  # libmvec: glibc's vector expf etc., which -ffast-math calls

# Each kernel's own compile flags. # NOTE: -ffast-math goes to the compile step only: linked
# with it, gcc adds crtfastmath.o, which switches the whole process to flush-to-zero on load.
KERNELS: dict[str, tuple[str, ...]] = {
    # Dot products vectorise as reassociated sums, exp becomes glibc's vector expf; within
    # float32 rounding of the reference (tests/test_cpu_kernels.py states the tolerance).
    "paged_attention": ("-ffast-math",),
    # No fused multiply-adds: each product and sum rounds as torch's do, bit for bit.
    "rotary": ("-ffp-contract=off",),
    # No -ffast-math: it would fold the NaN tests away.
    "argmax": (),
    # Intrinsics; no reassociation, so an input of one 1.0 yields each weight exactly.
    "quant_gemv": (),
    # Intrinsics (AVX-512 VNNI); no reassociation of the float32 sums.
    "quant_gemv4": (),
    # No contraction: the residual sum and the scaling round as torch's ops do.
    "rms_norm": ("-ffp-contract=off",),
    # exp becomes glibc's vector expf (as in paged_attention).
    "activation": ("-ffast-math",),
    # Only orchestration (copies, the residual's first copy): no arithmetic of its own to round.
    "decoder_layers": (),
}

# Kernels whose library also links the objects of the kernels they call, each compiled with
# that kernel's own flags above. # NOTE: so a fused call rounds exactly as the op-by-op calls
# do (one translation unit would give rotary -ffast-math, or attention no vector expf).
LINKED: dict[str, tuple[str, ...]] = {
    "decoder_layers": ("quant_gemv4", "rms_norm", "rotary", "paged_attention", "activation"),
}

# The kernels that take the model's activations: float32 only, the other dtypes keep the
# reference (argmax reads the logits, float32 in every model).
_ACTIVATION_KERNELS = ("paged_attention", "rotary", "quant_gemv", "quant_gemv4", "rms_norm",
                       "activation", "decoder_layers")

# Why a kernel is not built, by name (for the start-up line).
_unavailable: dict[str, str] = {}


def is_enabled() -> bool:
    """Whether the C kernels may run (``BASTION_CPU_KERNELS``, default 1)."""
    return envs.get("BASTION_CPU_KERNELS")


def cpu_kernel(name: str, symbol: str, argtypes: Sequence[Any],
               restype: Any = None) -> Callable[..., Any] | None:
    """The function ``symbol`` of ``ops/cpu/<name>.c`` with its ctypes signature, or None when
    C kernels are off or the library cannot be built (then the caller runs its reference)."""
    if not is_enabled():
        return None
    return _bind(name, symbol, tuple(argtypes), restype)


def vectorized_kernel(name: str, symbol: str, argtypes: Sequence[Any], restype: Any,
                      probe: str) -> Callable[..., Any] | None:
    """``cpu_kernel`` for a kernel whose library also exports ``probe`` (``int probe(void)``),
    nonzero when it was built with the vector instructions it needs; None when not (its scalar
    fallback, or no loop at all, would be slower than torch's own kernel)."""
    return bind_vectorized(name, symbol, tuple(argtypes), restype, probe) if is_enabled() else None


@functools.cache
def bind_vectorized(name: str, symbol: str, argtypes: tuple[Any, ...], restype: Any,
                    probe: str) -> Callable[..., Any] | None:
    """``vectorized_kernel`` without reading ``BASTION_CPU_KERNELS``: for a launcher whose
    caller has just checked it (a microsecond a call, at 120 calls a token)."""
    fn = _bind(name, symbol, argtypes, restype)
    check = _bind(name, probe, (), ctypes.c_int)
    return fn if fn is not None and check is not None and check() else None


@functools.cache
def _bind(name: str, symbol: str, argtypes: tuple[Any, ...],
          restype: Any) -> Callable[..., Any] | None:
    lib = load_cpu_kernel(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def load_cpu_kernel(name: str) -> ctypes.CDLL | None:
    """The library built from ``ops/cpu/<name>.c`` (built now if it is not in the cache), or
    None when C kernels are off, there is no compiler, or the build fails."""
    return _load(name) if is_enabled() else None


def describe_cpu_path(dtype: torch.dtype) -> str:
    """Which path a CPU model of activations ``dtype`` runs, for the engine's start-up line;
    builds (or loads) every kernel it will use now, so that no request waits for a compiler."""
    if not is_enabled():
        return "torch references (BASTION_CPU_KERNELS=0)"
    start = time.perf_counter()
    reasons: dict[str, list[str]] = {}  # why the reference runs -> kernels
    built = []
    for name in KERNELS:
        if name in _ACTIVATION_KERNELS and dtype != torch.float32:
            reason = f"{str(dtype).removeprefix('torch.')} activations"
        elif _load(name) is None:
            reason = _unavailable[name]
        else:
            built.append(name)
            continue
        reasons.setdefault(reason, []).append(name)
    if not built:
        return f"torch references ({'; '.join(reasons)})"
    text = (f"C kernels {', '.join(built)} (OpenMP, {torch.get_num_threads()} threads; ready in "
            f"{time.perf_counter() - start:.2f} s)")
    if reasons:
        text += "; torch references for " + ", ".join(
            f"{', '.join(names)} ({reason})" for reason, names in reasons.items())
    return text


@functools.cache
def _compiler() -> tuple[str, ...] | None:
    """The compiler's command: ``$CC`` (split as a shell would, so ``ccache gcc`` works), else
    ``cc`` or ``gcc`` on the PATH; None (logged once) when there is none."""
    command = shlex.split(os.environ.get("CC", ""))
    if not command:
        found = shutil.which("cc") or shutil.which("gcc")
        command = [found] if found else []
    if not command or shutil.which(command[0]) is None:
        logger.warning("no C compiler ($CC, cc or gcc): the CPU path runs the torch references "
                       "instead of its C kernels (ops/cpu)")
        return None
    return tuple(command)


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        _unavailable[name] = "no C compiler"
        return None
    parts = (name, *LINKED.get(name, ()))
    try:
        cache = _cache_dir()
        for arch in _ARCH_FLAGS:
            units = tuple((_SOURCE_DIR / f"{part}.c", (*_COMPILE_FLAGS, *arch, *KERNELS[part]))
                          for part in parts)
            library = cache / f"{name}-{_digest(units, compiler)}.so"
            try:
                if not library.is_file():
                    _build(compiler, units, library)
                return ctypes.CDLL(str(library))
            except subprocess.CalledProcessError as exc:
                if arch == _ARCH_FLAGS[-1]:
                    raise
                logger.info("CPU kernel %s: %s does not build (%s); trying the compiler's "
                            "default target", name, " ".join(arch), _first_error(exc.stderr))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = _first_error(getattr(exc, "stderr", None) or str(exc))
        logger.warning("CPU kernel %s unavailable (%s); using the torch reference", name, detail)
        _unavailable[name] = "its build failed"
    return None


def _first_error(text: str) -> str:
    lines = (text or "").strip().splitlines()
    return next((line for line in lines if "error" in line), lines[-1] if lines else "failed")


def _cache_dir() -> Path:
    """Beside the GGUF conversions (core/loader/gguf_loader.py's ``bastion_cache_dir``), named
    here so that ops/ does not import the loader."""
    root = envs.get("BASTION_CACHE_DIR") or Path.home() / ".cache" / "bastion"
    return Path(root) / "cpu-kernels"


def _digest(units: tuple[tuple[Path, tuple[str, ...]], ...], compiler: tuple[str, ...]) -> str:
    """Of every (source, compile flags) unit the library links, the link step, the compiler's
    binaries and the CPU's features."""
    h = hashlib.sha256()
    for source, flags in units:
        h.update(source.read_bytes())
        h.update(" ".join((*compiler, *flags)).encode())
    for header in sorted(_SOURCE_DIR.glob("*.h")):  # what the sources #include
        h.update(header.read_bytes())
    h.update(" ".join((*_LINK_FLAGS, *_LINK_LIBS)).encode())
    # The compiler's binaries themselves (an upgrade in place keeps the path), without running
    # them: every word of the command that names a program on the PATH.
    for word in compiler:
        path = shutil.which(word)
        if path is not None:
            stat = os.stat(os.path.realpath(path))
            h.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(f"{platform.machine()}\n{_cpu_flags()}".encode())
    return h.hexdigest()[:16]


@functools.cache
def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for): /proc/cpuinfo's ``flags`` line
    on x86, ``Features`` on Arm."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(compiler: tuple[str, ...], units: tuple[tuple[Path, tuple[str, ...]], ...],
           library: Path) -> None:
    """Compile each unit and link them in a temporary folder of this process, then rename the
    library into place."""
    library.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".build-") as tmp:
        out = Path(tmp) / "kernel.so"
        run = functools.partial(subprocess.run, check=True, capture_output=True, text=True,
                                timeout=120)
        objects = []
        for source, flags in units:
            objects.append(str(Path(tmp) / f"{source.stem}.o"))
            run([*compiler, *flags, "-c", str(source), "-o", objects[-1]])
        run([*compiler, *_LINK_FLAGS, *objects, "-o", str(out), *_LINK_LIBS])
        os.replace(out, library)
    logger.info("built the CPU kernel %s in %.1f s (%s)", units[0][0].stem,
                time.perf_counter() - start, library)
