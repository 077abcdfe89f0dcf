"""Filling a step's next-token bitmask from its rows' matchers (TP rank 0's worker, while the
device runs the step's forward).

xgrammar's batch fill runs in C++ with the GIL released, on one thread by default. Asked for
more (``BASTION_GRAMMAR_FILL_THREADS``), a fill of ``_PARALLEL_MIN_ROWS`` rows or more is split
over xgrammar's threads, which it starts anew for every call: on an H200 host, 8 of them made a
32-row fill 1.15 ms against 0.12 ms on one thread (session 22).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from bastion import envs

# Rows from which one fill is split over xgrammar's threads (fewer are not worth starting them:
# xgrammar starts its threads anew for every call, tens of microseconds each).
_PARALLEL_MIN_ROWS = 16


def default_fill_threads() -> int:
    """Threads of one parallel fill: half the cores this process may run on, at most 8.

    NOTE: xgrammar's own default ("auto") is half of ``std::thread::hardware_concurrency``, the
    host's CPU count even in a container limited to a few of them, and it starts that many
    threads on every call."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class BitmaskFiller:
    """Fills bitmasks through xgrammar's batch API (``num_threads`` threads for a large one)."""

    def __init__(self, num_threads: int | None = None) -> None:
        self.num_threads = (num_threads or envs.get("BASTION_GRAMMAR_FILL_THREADS")
                            or default_fill_threads())
        self._serial: Any = None  # xgrammar BatchGrammarMatcher(1) / (num_threads), on first use
        self._parallel: Any = None

    def fill(self, grammars: list[Any], bitmask: np.ndarray) -> None:
        """Row ``i`` of ``bitmask`` (int32 ``[len(grammars), words]``): what ``grammars[i]``
        (a ``RequestGrammar``) allows next (bit ``t % 32`` of word ``t // 32`` set: token ``t``
        allowed); a grammar not active yet allows everything."""
        active = [i for i, g in enumerate(grammars) if g.is_active]
        if len(active) < len(grammars):
            bitmask.fill(-1)
        if active:
            self._batch_matcher(len(active)).batch_fill_next_token_bitmask(
                [grammars[i].matcher for i in active], bitmask, active)

    def _batch_matcher(self, num_rows: int) -> Any:
        import xgrammar as xgr

        if num_rows >= _PARALLEL_MIN_ROWS and self.num_threads > 1:
            if self._parallel is None:
                self._parallel = xgr.BatchGrammarMatcher(self.num_threads)
            return self._parallel
        if self._serial is None:
            self._serial = xgr.BatchGrammarMatcher(1)
        return self._serial
