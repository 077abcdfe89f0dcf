"""C kernels for the CPU path, built with the system C compiler on first use.

Each kernel is one ``<name>.c`` file beside this one, compiled into a shared library under
``$BASTION_CACHE_DIR/cpu-kernels/`` (named by a digest of its source, the flags and the CPU's
feature flags, so a cache shared between machines never hands one a binary it cannot run) and
called through ``ctypes`` with raw pointers: no Python headers, no torch headers, so a build takes
about a second, once. Without a compiler, or when the build fails, ``load_cpu_kernel`` returns
None (logged once) and the caller runs its torch reference; ``BASTION_CPU_KERNELS=0`` asks for
that path explicitly (A/B runs).

# NOTE: the kernels parallelise with OpenMP; the library asks for ``libgomp.so.1``, which torch
has already loaded in-process (its own copy has that soname), so they share torch's thread pool
instead of starting a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bastion import envs

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent
_COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11")
_LINK_FLAGS = ("-shared", "-fopenmp")
_LINK_LIBS = ("-lmvec", "-lm")  # libmvec: glibc's vector expf etc., which -ffast-math calls


@functools.cache
def load_cpu_kernel(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``ops/cpu/<name>.c`` (built now if it is not in the cache), or
    None when C kernels are off, there is no compiler, or the build fails.

    ``extra_flags`` go to the compile step only. # NOTE: that is where ``-ffast-math`` must go:
    linked with it, gcc 12 adds crtfastmath.o, which switches the whole process to
    flush-to-zero when the library loads.
    """
    if not envs.get("BASTION_CPU_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or $CC) found: the CPU kernel %s is not built; "
                       "using the torch reference", name)
        return None
    source = _SOURCE_DIR / f"{name}.c"
    flags = (*_COMPILE_FLAGS, *extra_flags)
    library = _cache_dir() / f"{name}-{_digest(source, compiler, flags)}.so"
    try:
        if not library.is_file():
            _build(compiler, flags, source, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as exc:
        lines = str(getattr(exc, "stderr", None) or exc).strip().splitlines()
        detail = next((line for line in lines if "error" in line), lines[-1] if lines else exc)
        logger.warning("CPU kernel %s unavailable (%s); using the torch reference", name, detail)
        return None


def _cache_dir() -> Path:
    """Beside the GGUF conversions (core/loader/gguf_loader.py's ``bastion_cache_dir``), named
    here so that ops/ does not import the loader."""
    root = envs.get("BASTION_CACHE_DIR") or Path.home() / ".cache" / "bastion"
    return Path(root) / "cpu-kernels"


def _digest(source: Path, compiler: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256(source.read_bytes())
    h.update(" ".join((compiler, *flags, *_LINK_FLAGS, *_LINK_LIBS)).encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        import platform

        return platform.processor()


def _build(compiler: str, flags: tuple[str, ...], source: Path, library: Path) -> None:
    """Compile and link in a temporary folder, then rename into place (processes may race)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".build-") as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        run = functools.partial(subprocess.run, check=True, capture_output=True, text=True,
                                timeout=120)
        run([compiler, *flags, "-c", str(source), "-o", str(obj)])
        run([compiler, *_LINK_FLAGS, str(obj), "-o", str(out), *_LINK_LIBS])
        os.replace(out, library)
    logger.info("built the CPU kernel %s (%s)", source.stem, library)
