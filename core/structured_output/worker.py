"""The worker's side of structured outputs: the compiled grammars the engine sent, a matcher
per grammar request, and each grammar step's bitmask, filled while the device runs the step's
forward and applied to its logits before sampling.

Only TP rank 0 keeps them: every rank samples, but all take rank 0's tokens.

With ``BASTION_GRAMMAR_EARLY_FILL=1`` the fill starts with the step instead (``start_fill``):
on a thread of its own, it waits for the previous step's tokens, advances the matchers and
fills while the runner's thread prepares and launches the forward (xgrammar's fill releases
the GIL); the runner then only applies it (``finish_fill``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bastion import envs
from bastion.core.structured_output.bitmask import GrammarBitmaskApplier
from bastion.core.structured_output.fill import BitmaskFiller
from bastion.core.structured_output.manager import RequestGrammar
from bastion.ipc.messages import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerGrammars:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._vocabulary: Any = None  # xgrammar TokenizerInfo
        self._num_words = 0
        self._compiled: dict[str, Any] = {}
        self._filler = BitmaskFiller()
        self._applier = GrammarBitmaskApplier()
        self.early = envs.get("BASTION_GRAMMAR_EARLY_FILL")
        self._thread: ThreadPoolExecutor | None = None  # the early fill's, on first use

    def learn(self, sched: SchedulerOutput) -> None:
        """Take the vocabulary and compiled grammars ``sched`` brings (before its requests)."""
        if not self.enabled:
            return
        import xgrammar as xgr

        if sched.grammar_vocabulary is not None:
            start = time.perf_counter()
            self._vocabulary = xgr.TokenizerInfo.deserialize_json(
                bytes(sched.grammar_vocabulary).decode())
            self._num_words = int(xgr.get_bitmask_shape(1, self._vocabulary.vocab_size)[1])
            logger.info("structured outputs: vocabulary of %d tokens received in %.2f s",
                        self._vocabulary.vocab_size, time.perf_counter() - start)
        for grammar_id in sched.dropped_grammar_ids:
            self._compiled.pop(grammar_id, None)
        for grammar_id, payload in sched.grammars.items():
            if self._vocabulary is None:
                raise RuntimeError(f"grammar {grammar_id} arrived before the vocabulary")
            self._compiled[grammar_id] = xgr.CompiledGrammar.deserialize_json(
                bytes(payload).decode(), self._vocabulary)

    def matcher_for(self, new: NewRequestData) -> RequestGrammar | None:
        """A new request's matcher, advanced by the tokens it already has (None: no grammar,
        or not this rank's to keep)."""
        if not self.enabled or new.grammar_id is None:
            return None
        compiled = self._compiled.get(new.grammar_id)
        if compiled is None:
            raise RuntimeError(f"request {new.request_id} names grammar {new.grammar_id}, "
                               "which this worker was never sent")
        spec = new.sampling_params.structured_outputs
        grammar = RequestGrammar(compiled, new.eos_token_id,
                                 spec.start_after_token_id if spec is not None else None)
        # NOTE: the engine checked these tokens against its own matcher before it scheduled the
        # request; a refusal here leaves the row unmasked and the engine ends the request.
        return grammar if grammar.catch_up(new.output_token_ids) else None

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, RequestGrammar]]) -> None:
        """Mask logits row ``r`` with what its grammar allows next, for each ``(r, grammar)``
        whose grammar can still go on (a terminated one is left unmasked: its request ends
        with this step, whose token the engine drops)."""
        rows = [(row, g) for row, g in rows if not g.is_terminated]
        if rows:
            bitmask = self._fill([g for _, g in rows], logits.device)
            self._applier.apply(logits, bitmask, [row for row, _ in rows])

    def _fill(self, grammars: list[RequestGrammar], device: torch.device) -> np.ndarray:
        """What each of ``grammars`` allows next, filled where the transfer to ``device`` reads
        it."""
        bitmask = self._applier.buffer(len(grammars), self._num_words, device)
        self._filler.fill(grammars, bitmask)
        return bitmask

    # ------------------------------------------------------------------ early fill

    def start_fill(self, rows: list[GrammarRow], pending: Any, device: torch.device) -> Future:
        """Fill ``rows`` on the fill thread: each row's matcher first takes ``row.folded`` and,
        where ``row.pending_index`` is set, that token of ``pending`` (the step in flight, a
        ``StepHandle``). No one else may touch these matchers until ``finish_fill``."""
        if self._thread is None:
            def bind() -> None:
                if device.type == "cuda":  # a new thread starts on GPU 0
                    torch.cuda.set_device(device)

            self._thread = ThreadPoolExecutor(1, "grammar-fill", initializer=bind)
        return self._thread.submit(self._fill_rows, rows, pending, device)

    def _fill_rows(self, rows: list[GrammarRow], pending: Any,
                   device: torch.device) -> tuple[list[GrammarRow], np.ndarray]:
        tokens = (pending.token_ids() if any(r.pending_index is not None for r in rows)
                  else [])
        for row in rows:
            row.broken = not all(row.grammar.accept(t) for t in row.folded)
        # The tokens of the step in flight, one per row: in one call.
        taking = [r for r in rows if not r.broken and r.pending_index is not None]
        taken = RequestGrammar.accept_each([r.grammar for r in taking],
                                           [tokens[r.pending_index] for r in taking])
        for row, ok in zip(taking, taken):
            row.broken = not ok
        live = [r for r in rows if not r.broken and not r.grammar.is_terminated]
        return live, self._fill([r.grammar for r in live], device)

    def finish_fill(self, logits: torch.Tensor, fill: Future,
                    logits_row: dict[str, int]) -> None:
        """Mask ``logits`` with a fill ``start_fill`` began (afterwards each of its rows says
        whether its grammar refused a token: ``broken``)."""
        live, bitmask = fill.result()
        self._applier.apply(logits, bitmask, [logits_row[r.request_id] for r in live])

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)


@dataclass
class GrammarRow:
    """One grammar row of a step whose fill starts early: the output tokens its matcher has not
    taken yet that are on the host (``folded``), and the index of its token in the step in
    flight, if it has one there."""

    request_id: str
    grammar: RequestGrammar
    folded: list[int]
    pending_index: int | None
    broken: bool = False
