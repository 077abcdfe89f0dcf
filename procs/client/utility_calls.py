"""Utility calls (``add_lora``, ``remove_lora``, ...) on every engine of this server, and
their results, which come back on the output channel among the steps' outputs."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from bastion.ipc.messages import UtilityCall, UtilityResult


class UtilityCalls:
    """Calls awaiting their results, by call id. ``send(engine_id, call)`` delivers a call."""

    def __init__(self, send: Callable[[int, UtilityCall], None]) -> None:
        self._send = send
        self._call_ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}

    async def call(self, engine_ids: list[int], method: str, args: list[object],
                   timeout_s: float) -> list[object]:
        """Run ``method`` on every engine; results in engine order. An engine's failure raises
        ``ValueError`` with its message."""
        loop = asyncio.get_running_loop()
        calls = {}
        for engine_id in engine_ids:
            call_id = next(self._call_ids)
            calls[engine_id] = self._pending[call_id] = loop.create_future()
            self._send(engine_id, UtilityCall(call_id, method, args))
        try:
            async with asyncio.timeout(timeout_s):
                results = [await calls[i] for i in engine_ids]
        finally:
            for call_id in [c for c, f in self._pending.items() if f in calls.values()]:
                del self._pending[call_id]
        for result in results:
            if result.failure is not None:
                raise ValueError(result.failure.partition(": ")[2] or result.failure)
        return [r.result for r in results]

    def resolve(self, result: UtilityResult) -> None:
        """An engine's answer; one to a call that timed out (or is unknown) is dropped."""
        future = self._pending.pop(result.call_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def __len__(self) -> int:
        return len(self._pending)
