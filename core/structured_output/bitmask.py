"""Applying a step's grammar bitmask to its logits, on the logits' device: xgrammar's kernel
(C++ on the CPU, CUDA/Triton on a GPU), with a torch reference beside it for the tests."""

from __future__ import annotations

import numpy as np
import torch

from bastion.ipc.messages import GrammarBitmask


def apply_grammar_bitmask(logits: torch.Tensor, msg: GrammarBitmask,
                          row_of: dict[str, int]) -> None:
    """In place: each row ``row_of[request_id]`` of ``logits`` keeps only the tokens its
    request's bitmask row allows. Rows of requests not in ``msg`` are not touched."""
    import xgrammar as xgr

    pairs = [(row_of[rid], i) for i, rid in enumerate(msg.request_ids) if rid in row_of]
    if not pairs:
        return
    rows = [row for row, _ in pairs]
    sent = np.frombuffer(msg.bitmask, dtype=np.int32).reshape(len(msg.request_ids),
                                                              msg.num_words)
    # NOTE: xgrammar's kernel reads bitmask row ``i`` for logits row ``i``, so the rows are
    # laid out in the logits' order (rows without a grammar allow everything and are skipped).
    host = np.full((logits.shape[0], msg.num_words), -1, dtype=np.int32)
    host[rows] = sent[[i for _, i in pairs]]
    bitmask = torch.from_numpy(host)
    if logits.is_cuda:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


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
