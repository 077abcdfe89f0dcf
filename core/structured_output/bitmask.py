"""Applying a step's grammar bitmask to its logits, on the logits' device."""

from __future__ import annotations

import torch

from bastion.ipc.messages import GrammarBitmask


def bitmask_tensor(msg: GrammarBitmask, device: torch.device) -> torch.Tensor:
    """int32 [rows, num_words] on ``device`` (one copy of the message's bytes)."""
    host = torch.frombuffer(bytearray(msg.bitmask), dtype=torch.int32)
    return host.view(len(msg.request_ids), msg.num_words).to(device, non_blocking=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[rows[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is clear.
    Rows not in ``rows`` are not touched."""
    if not rows:
        return
    vocab_size = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of "
                         f"{vocab_size}")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab_size]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(allowed == 0, float("-inf"))
