"""Applying a step's grammar bitmask to its logits, on the logits' device: numpy's bit unpacking
and a torch mask on the CPU, a Triton kernel with a row map on a GPU, and a torch reference
beside them for the tests."""

from __future__ import annotations

import numpy as np
import torch


class GrammarBitmaskApplier:
    """Applies bitmasks for one model runner. On a GPU the rows travel through pinned host
    buffers kept from step to step (a row map says which logits row each one masks,
    ``ops/triton/grammar_bitmask.py``): one host copy, two transfers that do not block, one
    launch."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # pinned int32 [rows, words], grown on demand
        self._host_rows: torch.Tensor | None = None  # pinned int32 [rows]: each one's logits row
        self._copied: torch.cuda.Event | None = None  # the last transfer out of them

    def buffer(self, num_rows: int, num_words: int, device: torch.device) -> np.ndarray:
        """Where to fill ``num_rows`` rows for logits on ``device``: the pinned buffer that the
        transfer reads (no copy in ``apply``) on a GPU."""
        if device.type == "cuda":
            return self._buffers(num_rows, num_words)[0]
        return np.empty((num_rows, num_words), dtype=np.int32)

    def apply(self, logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
        """In place: logits row ``rows[i]`` keeps only the tokens bitmask row ``i`` allows
        (int32 words, little-endian: bit ``t % 32`` of word ``t // 32`` is token ``t``).
        Other rows are not touched."""
        if not rows:
            return
        if logits.is_cuda:
            self._apply_on_device(logits, bitmask, rows)
            return
        # NOTE: numpy unpacks the bits and torch masks; at 32 rows of a 49k vocabulary that is
        # 1.1 ms against 5.3 for xgrammar's CPU kernel.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=logits.shape[1],
                             bitorder="little")
        disallowed = torch.from_numpy(bits == 0)
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(disallowed, float("-inf"))
            return
        for j, row in enumerate(rows):
            logits[row].masked_fill_(disallowed[j], float("-inf"))

    def _apply_on_device(self, logits: torch.Tensor, bitmask: np.ndarray,
                         rows: list[int]) -> None:
        from bastion.ops.triton.grammar_bitmask import apply_bitmask_rows_triton

        num_rows = len(rows)
        host, host_rows = self._buffers(num_rows, bitmask.shape[1])
        if bitmask.ctypes.data != host.ctypes.data:  # not filled in place (``buffer``)
            np.copyto(host, bitmask)
        host_rows[:] = rows
        device_bitmask = self._host[:num_rows].to(logits.device, non_blocking=True)
        device_rows = self._host_rows[:num_rows].to(logits.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        apply_bitmask_rows_triton(logits, device_bitmask, device_rows)

    def _buffers(self, num_rows: int, num_words: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the pinned buffers for ``num_rows`` rows, once the transfers that last read
        them have run (they have: the step they served has sampled since)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != num_words:
            size = max(num_rows, 0 if host is None else host.shape[0])
            self._host = torch.empty((size, num_words), dtype=torch.int32, pin_memory=True)
            self._host_rows = torch.empty(size, dtype=torch.int32, pin_memory=True)
        return self._host[:num_rows].numpy(), self._host_rows[:num_rows].numpy()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """``GrammarBitmaskApplier.apply`` without a buffer kept between calls."""
    GrammarBitmaskApplier().apply(logits, bitmask, rows)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  rows: list[int]) -> None:
    """The torch reference: ``logits[rows[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]``
    is clear; other rows untouched."""
    if not rows:
        return
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab_size]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(allowed == 0, float("-inf"))
