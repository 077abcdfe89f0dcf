"""Applying a step's grammar bitmask to its logits, on the logits' device: xgrammar's kernel
(C++ on the CPU, Triton on a GPU), with a torch reference beside it for the tests."""

from __future__ import annotations

import numpy as np
import torch

from bastion.ipc.messages import GrammarBitmask


class GrammarBitmaskApplier:
    """Applies bitmasks for one model runner; on a GPU through a pinned host buffer kept from
    step to step, so applying one costs one host copy and one transfer that does not block."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # pinned int32 [rows, words], grown on demand
        self._copied: torch.cuda.Event | None = None  # the last transfer out of it

    def apply(self, logits: torch.Tensor, msg: GrammarBitmask, row_of: dict[str, int]) -> None:
        """In place: each row ``row_of[request_id]`` of ``logits`` keeps only the tokens its
        request's bitmask row allows. Rows of requests not in ``msg`` are not touched."""
        import xgrammar as xgr

        pairs = [(row_of[rid], i) for i, rid in enumerate(msg.request_ids) if rid in row_of]
        if not pairs:
            return
        num_rows = logits.shape[0]
        rows = [row for row, _ in pairs]
        sent = np.frombuffer(msg.bitmask, dtype=np.int32).reshape(len(msg.request_ids),
                                                                  msg.num_words)
        host = self._buffer(num_rows, msg.num_words, logits.is_cuda)
        # NOTE: xgrammar's kernel reads bitmask row ``i`` for logits row ``i``, so the rows are
        # laid out in the logits' order (rows without a grammar allow everything).
        source = np.full(num_rows, -1, dtype=np.int64)
        source[rows] = [i for _, i in pairs]
        if len(pairs) == num_rows:
            np.take(sent, source, axis=0, out=host)
        else:
            host[source < 0] = -1
            host[rows] = sent[source[rows]]
        bitmask = self._host[:num_rows] if logits.is_cuda else torch.from_numpy(host)
        if not logits.is_cuda:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                            indices=rows)
            return
        device_bitmask = bitmask.to(logits.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        # Every row, so the kernel gets no index list (a list would be copied to the device
        # from pageable memory on every call).
        xgr.apply_token_bitmask_inplace(logits, device_bitmask, vocab_size=logits.shape[1])

    def _buffer(self, num_rows: int, num_words: int, pinned: bool) -> np.ndarray:
        """A host array for ``num_rows`` rows; on a GPU the pinned buffer, once the transfer
        that last read it has run (it has: the step it served has sampled since)."""
        if not pinned:
            return np.empty((num_rows, num_words), dtype=np.int32)
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != num_words:
            rows = max(num_rows, 0 if host is None else host.shape[0])
            self._host = torch.empty((rows, num_words), dtype=torch.int32, pin_memory=True)
        return self._host[:num_rows].numpy()


def apply_grammar_bitmask(logits: torch.Tensor, msg: GrammarBitmask,
                          row_of: dict[str, int]) -> None:
    """``GrammarBitmaskApplier.apply`` without a buffer kept between calls."""
    GrammarBitmaskApplier().apply(logits, msg, row_of)


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
