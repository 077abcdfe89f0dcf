"""Filling a step's next-token bitmask, off the engine's thread where there are cores for it.

A grammar step's bitmask can be filled only once the step before it is folded in (its matchers
then hold every token but the one the step samples), and the device samples that step only once
the bitmask arrives: the fill sits on the path from one step's tokens to the next step's
sampling. The engine therefore starts it right after the fold and collects it after it has
scheduled and sent the next step; on the fill thread it runs while the engine schedules.

xgrammar's fill runs in C++ with the GIL released, but the thread that calls it needs the GIL to
get there; a waiting thread gets it only when the holder blocks, or after the interpreter's
switch interval (5 ms, several steps). ``BitmaskFiller`` therefore blocks until the fill thread
has taken the job (a hand-off of two thread wake-ups) instead of letting the fill start whenever
the engine next happens to block. A process on one core cannot run the two side by side; there
the fill runs on the engine's thread, at once.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from bastion.ipc.messages import GrammarBitmask

# Rows from which one fill is split over xgrammar's threads (fewer are not worth starting them:
# xgrammar starts its threads anew for every call, tens of microseconds each).
_PARALLEL_MIN_ROWS = 16
# Cores this process may run on from which fills run on their own thread.
_BACKGROUND_MIN_CPUS = 2


def default_fill_threads() -> int:
    """Threads of one parallel fill: half the cores this process may run on, at most 8.

    NOTE: xgrammar's own default ("auto") is half of ``std::thread::hardware_concurrency``, the
    host's CPU count even in a container limited to a few of them, and it starts that many
    threads on every call."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def default_fill_in_background() -> bool:
    return len(os.sched_getaffinity(0)) >= _BACKGROUND_MIN_CPUS


class BitmaskFill:
    """One step's bitmask, being filled; ``result()`` waits for it, once the caller needs it:
    before the step's sampling. ``future``: the fill's (start, end) times."""

    def __init__(self, step_id: int, request_ids: list[str], bitmask: np.ndarray,
                 future: Future | None) -> None:
        self.step_id = step_id
        self.request_ids = request_ids
        self._bitmask = bitmask
        self._future = future
        self.fill_s = 0.0  # the fill's own time, known after ``result()``

    def result(self) -> GrammarBitmask:
        if self._future is not None:
            start, end = self._future.result()
            self.fill_s, self._future = end - start, None
        # NOTE: a view, not a copy: in process the runner reads the engine's array; the codec
        # writes it into the message (and a worker decodes a view of the frame it received).
        return GrammarBitmask(self.step_id, self.request_ids,
                              memoryview(self._bitmask.reshape(-1).view(np.uint8)),
                              self._bitmask.shape[1])


class BitmaskFiller:
    """Fills bitmasks through xgrammar's batch API (``num_threads`` threads for a large one),
    on a daemon thread of its own when ``background``, one fill at a time in order."""

    def __init__(self, num_threads: int | None = None, background: bool | None = None) -> None:
        self.num_threads = num_threads or default_fill_threads()
        self.background = default_fill_in_background() if background is None else background
        self._serial: Any = None  # xgrammar BatchGrammarMatcher(1) / (num_threads), on first use
        self._parallel: Any = None
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = (
            queue.SimpleQueue())
        self._taken = threading.Semaphore(0)
        if self.background:
            threading.Thread(target=self._serve, name="grammar-fill", daemon=True).start()

    def fill(self, step_id: int, request_ids: list[str], grammars: list[Any],
             num_words: int) -> BitmaskFill:
        """Start filling row ``i`` with what ``grammars[i]`` (a ``RequestGrammar``) allows
        next; a grammar not active yet allows everything. The matchers must not be advanced
        until the fill's ``result()``."""
        bitmask = np.empty((len(grammars), num_words), dtype=np.int32)
        active = [i for i, g in enumerate(grammars) if g.is_active]
        if len(active) < len(grammars):
            bitmask.fill(-1)
        if not active:
            return BitmaskFill(step_id, request_ids, bitmask, None)
        matchers = [grammars[i].matcher for i in active]

        def run() -> tuple[float, float]:
            start = time.perf_counter()
            self._batch_matcher(len(active)).batch_fill_next_token_bitmask(
                matchers, bitmask, active)
            return start, time.perf_counter()

        if self.background:
            return BitmaskFill(step_id, request_ids, bitmask, self._submit(run))
        # NOTE: at once, not when the result is asked: right after the fold the matchers' state
        # is still in this core's caches (filled after a schedule instead, 128 rows took twice
        # as long in the median).
        done: Future = Future()
        done.set_result(run())
        return BitmaskFill(step_id, request_ids, bitmask, done)

    def _batch_matcher(self, num_rows: int) -> Any:
        import xgrammar as xgr

        if num_rows >= _PARALLEL_MIN_ROWS and self.num_threads > 1:
            if self._parallel is None:
                self._parallel = xgr.BatchGrammarMatcher(self.num_threads)
            return self._parallel
        if self._serial is None:
            self._serial = xgr.BatchGrammarMatcher(1)
        return self._serial

    def _submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the fill thread; returns once the thread has started it."""
        future: Future = Future()
        self._jobs.put((fn, future))
        self._taken.acquire()
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            self._taken.release()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
                future.set_exception(exc)

    def shutdown(self) -> None:
        if self.background:
            self._jobs.put(None)
