"""A step's grammar bitmask on the logits' device: numpy's bit unpacking and a torch mask on the
CPU; on a GPU one transfer of the filled rows and a row map (``DeviceMask``), read by the
sampling kernel or applied by a Triton kernel of its own; and a torch reference beside them
for the tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DeviceMask:
    """A step's grammar bitmasks on the logits' device: ``bitmask`` int32 [R, words] in the
    order they were filled, and ``mask_rows`` int32 [N], each logits row's bitmask row (-1: the
    row has no grammar). A plain sampling step reads them inside its sampling kernel;
    ``apply`` masks the logits themselves for the others."""

    bitmask: torch.Tensor
    mask_rows: torch.Tensor

    def apply(self, logits: torch.Tensor) -> None:
        from bastion.ops.triton.grammar_bitmask import apply_bitmask_rows_triton

        apply_bitmask_rows_triton(logits, self.bitmask, self.mask_rows)


class GrammarBitmaskApplier:
    """Stages bitmasks for one model runner. On a GPU a step's row map and its bitmask rows
    share one pinned host buffer (the map first), filled in place (``buffer``) and sent in one
    transfer that does not block (``upload``), into fresh device memory or into a fixed
    ``target`` that captured sampling graphs read (``mask_target``); two such buffers take
    turns, so a fill never waits for the transfer of the step just before it."""

    def __init__(self) -> None:
        self._host: list[torch.Tensor | None] = [None, None]  # pinned int32, flat, in turn
        self._sent: list[torch.cuda.Event | None] = [None, None]  # each one's last transfer
        self._turn = 0
        self._filling: torch.Tensor | None = None  # the buffer ``buffer`` handed out last

    def buffer(self, num_rows: int, num_words: int, device: torch.device,
               num_logits_rows: int = 0) -> np.ndarray:
        """Where to fill ``num_rows`` rows for logits of ``num_logits_rows`` rows on
        ``device``: on a GPU, the pinned buffer that ``upload`` sends (no copy)."""
        if device.type != "cuda":
            return np.empty((num_rows, num_words), dtype=np.int32)
        self._filling = self._take(num_logits_rows + num_rows * num_words)
        return (self._filling[num_logits_rows:num_logits_rows + num_rows * num_words]
                .numpy().reshape(num_rows, num_words))

    def upload(self, bitmask: np.ndarray, rows: list[int], num_logits_rows: int,
               device: torch.device, target: torch.Tensor | None = None) -> DeviceMask:
        """Send ``bitmask`` (row ``i`` for logits row ``rows[i]``) to ``device`` with its row
        map, in one transfer that does not block; into ``target`` (int32, flat: the map of
        ``num_logits_rows`` entries, then the rows) when given."""
        num_rows, num_words = bitmask.shape
        size = num_logits_rows + num_rows * num_words
        flat = self._filling
        if (flat is None or flat.numel() < size  # not filled in place
                or bitmask.ctypes.data != flat.data_ptr() + 4 * num_logits_rows):
            flat = self._take(size)
            flat[num_logits_rows:size].numpy().reshape(num_rows, num_words)[:] = bitmask
        self._filling = None
        host = flat[:size]
        mask_rows = host[:num_logits_rows].numpy()
        mask_rows.fill(-1)
        mask_rows[rows] = np.arange(num_rows, dtype=np.int32)
        if target is None:
            on_device = host.to(device, non_blocking=True)
        else:
            on_device = target[:size]
            on_device.copy_(host, non_blocking=True)
        self._record(flat)
        return DeviceMask(on_device[num_logits_rows:].view(num_rows, num_words),
                          on_device[:num_logits_rows])

    def apply(self, logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
        """In place: logits row ``rows[i]`` keeps only the tokens bitmask row ``i`` allows
        (int32 words, little-endian: bit ``t % 32`` of word ``t // 32`` is token ``t``).
        Other rows are not touched."""
        if not rows:
            return
        if logits.is_cuda:
            self.upload(bitmask, rows, logits.shape[0], logits.device).apply(logits)
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

    def _take(self, size: int) -> torch.Tensor:
        """The next pinned buffer in turn, of ``size`` int32 or more, once the transfer that
        last read it has run (it has: the step it served has sampled since)."""
        turn = self._turn
        self._turn ^= 1
        if self._sent[turn] is not None:
            self._sent[turn].synchronize()
        host = self._host[turn]
        if host is None or host.numel() < size:
            host = self._host[turn] = torch.empty(max(size, 2 * (0 if host is None
                                                                  else host.numel())),
                                                  dtype=torch.int32, pin_memory=True)
        return host

    def _record(self, flat: torch.Tensor) -> None:
        turn = 0 if flat is self._host[0] else 1
        if self._sent[turn] is None:
            self._sent[turn] = torch.cuda.Event()
        self._sent[turn].record()


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
