"""Per-step attention metadata, handed to every ``Attention`` layer without threading it
through the model's ``forward`` signature (the vLLM forward-context pattern). The metadata type
itself is the kernels' contract and lives in ``bastion.ops.attention_metadata``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bastion.ops.attention_metadata import AttentionMetadata, build_attention_metadata

__all__ = ["AttentionMetadata", "build_attention_metadata", "get_forward_context",
           "set_forward_context"]


_forward_context: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    """Make ``meta`` visible to ``get_forward_context()`` for the duration of one forward."""
    global _forward_context
    previous = _forward_context
    _forward_context = meta
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> AttentionMetadata | None:
    return _forward_context
