"""bastion: an LLM inference server for long-lived daemons."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the wire types (``bastion.ipc``) does not pull in torch.
    if name == "LLM":
        from bastion.procs.llm import LLM

        return LLM
    if name == "SamplingParams":
        from bastion.ipc.messages import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from bastion.ipc.messages import LoRARequest

        return LoRARequest
    raise AttributeError(name)
