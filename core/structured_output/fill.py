"""Filling a step's next-token bitmask from its rows' matchers (TP rank 0's worker, while the
device runs the step's forward).

xgrammar fills in C++ with the GIL released. A fill costs from a few microseconds a row to
tens, growing with the vocabulary: 32 rows of a JSON schema deep in strings and arrays took
0.12 ms on one thread with 49,152 tokens and 0.8-1.3 ms with 151,936 (Qwen3's width), about
an H200's whole decode step at batch 32 (docs/BENCHMARKS.md, session 25;
``scripts/bench_grammar_fill.py``). So a fill whose rows are expected to
cost more than ``_PARALLEL_MIN_US`` in all is split, rows interleaved, over
``BASTION_GRAMMAR_FILL_THREADS`` shares (by default two, one on fewer than four cores): the
calling thread fills one and threads that live as long as the filler the others (xgrammar's own
parallel fill starts its threads anew for every call: 8 of them made a cheap 32-row fill 1.15 ms
against 0.12 ms on one, session 22). The cost a row is learnt from the fills before.

Why two (session 26, an H200 host's 16 cores, ``scripts/bench_grammar_fill.py``): 32 rows with
Qwen3's width filled in 1.10 ms on one thread, 0.66 on two shares, 0.70 on four and 0.66 on
eight (each share's thread takes the GIL from the runner's to start and to end); in the engine
(``bench_structured.py --executor mp``, batch 32 at temperature 0.8) JSON steps cost +35/+26 %
over unconstrained ones with two shares against +66/+54 % with one.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bastion import envs

# A fill is split only when it has this many rows and is expected to take this long on one
# thread; each share gets at least _MIN_SHARE_US of expected work (a hand-off costs tens of us).
_PARALLEL_MIN_ROWS = 8
_PARALLEL_MIN_US = 200.0
_MIN_SHARE_US = 100.0


def default_fill_threads() -> int:
    """Shares of one split fill: two, or one (no split) where this process may run on fewer
    than four cores (the forward of a CPU device needs them)."""
    return 2 if len(os.sched_getaffinity(0)) >= 4 else 1


class BitmaskFiller:
    """Fills bitmasks through xgrammar's batch API, split over ``num_threads`` shares when a
    fill is expected to be long."""

    def __init__(self, num_threads: int | None = None) -> None:
        self.num_threads = (num_threads or envs.get("BASTION_GRAMMAR_FILL_THREADS")
                            or default_fill_threads())
        self._matchers: list[Any] = []  # xgrammar BatchGrammarMatcher(1) per share, on first use
        self._pool: ThreadPoolExecutor | None = None
        self.row_us = 0.0  # one row's fill, microseconds on one thread (learnt)
        self.last_shares = 0

    def fill(self, grammars: list[Any], bitmask: np.ndarray) -> None:
        """Row ``i`` of ``bitmask`` (int32 ``[len(grammars), words]``): what ``grammars[i]``
        (a ``RequestGrammar``) allows next (bit ``t % 32`` of word ``t // 32`` set: token ``t``
        allowed); a grammar not active yet allows everything."""
        active = [i for i, g in enumerate(grammars) if g.is_active]
        if len(active) < len(grammars):
            bitmask.fill(-1)
        if not active:
            return
        matchers = [grammars[i].matcher for i in active]
        shares = self.last_shares = self.shares(len(active))
        pool = self._thread_pool() if shares > 1 else None
        futures = [pool.submit(self._fill_share, k, matchers[k::shares], bitmask,
                               active[k::shares]) for k in range(1, shares)] if pool else []
        spent = self._fill_share(0, matchers[::shares], bitmask, active[::shares])
        spent += sum(f.result() for f in futures)
        self.row_us = spent * 1e6 / len(active)

    def shares(self, num_rows: int) -> int:
        """How many shares a fill of ``num_rows`` rows is split into."""
        expected = self.row_us * num_rows
        if self.num_threads < 2 or num_rows < _PARALLEL_MIN_ROWS or expected < _PARALLEL_MIN_US:
            return 1
        return max(1, min(self.num_threads, num_rows // 2, math.floor(expected / _MIN_SHARE_US)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _fill_share(self, share: int, matchers: list[Any], bitmask: np.ndarray,
                    rows: list[int]) -> float:
        """Fills ``rows``; returns the seconds it took on this thread."""
        start = time.perf_counter()
        self._matcher(share).batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return time.perf_counter() - start

    def _matcher(self, share: int) -> Any:
        import xgrammar as xgr

        while len(self._matchers) <= share:
            self._matchers.append(xgr.BatchGrammarMatcher(1))
        return self._matchers[share]

    def _thread_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            for share in range(self.num_threads):  # created here, not raced for by the shares
                self._matcher(share)
            self._pool = ThreadPoolExecutor(self.num_threads - 1,
                                            thread_name_prefix="bastion-grammar-fill")
        return self._pool
