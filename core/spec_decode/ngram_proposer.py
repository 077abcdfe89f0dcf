"""Prompt-lookup (n-gram) drafting: no model, only the sequence's own tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Drafts the tokens that followed the latest earlier occurrence of the sequence's suffix.

    Suffix lengths are tried from ``max_n`` down to ``min_n``; the longest one that occurred
    before wins, and the up to ``num_tokens`` tokens after that occurrence are the draft. No
    match: no draft (the step decodes plainly).
    """

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int]) -> list[int]:
        num = len(token_ids)
        if num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = tokens[num - n:]
            # Windows that start before the suffix does (the suffix matching itself is no news).
            windows = sliding_window_view(tokens[:num - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + self.num_tokens]
        return []
