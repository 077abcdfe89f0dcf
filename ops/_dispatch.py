"""Choosing between a Triton launcher and its torch reference."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


@functools.cache
def triton_launcher(module: str, name: str) -> Callable[..., Any] | None:
    """``bastion.ops.triton.<module>.<name>``, or None when Triton or the kernel is unavailable.

    Looked up once per process; a missing kernel is logged once, then the torch reference runs.
    """
    try:
        return getattr(importlib.import_module(f"bastion.ops.triton.{module}"), name)
    except (ImportError, AttributeError) as exc:
        logger.warning("Triton kernel %s.%s unavailable (%s); using the torch reference",
                       module, name, exc)
        return None


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton runs only on CUDA tensors; everything on the CPU takes the reference path."""
    return all(t.is_cuda for t in tensors)
