"""The worker's side of structured outputs: the compiled grammars the engine sent, a matcher
per grammar request, and each grammar step's bitmask, filled while the device runs the step's
forward and sent to it in one transfer; the sampling kernel reads it (``DeviceMask``), or it
masks the logits first where the step samples otherwise (and on the CPU).

Only TP rank 0 keeps them: every rank samples, but all take rank 0's tokens.

NOTE: filling on a thread of its own, started with the step (so that the fill overlaps the
forward's launch), was measured slower on an H200 host (session 22): that thread has to win
the interpreter back from the runner's after each xgrammar call.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from bastion.core.structured_output.bitmask import DeviceMask, GrammarBitmaskApplier
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

    @property
    def num_words(self) -> int:
        """int32 words of one bitmask row (0 before the vocabulary arrived)."""
        return self._num_words

    def stage(self, rows: list[tuple[int, RequestGrammar]], num_logits_rows: int,
              device: torch.device, target: torch.Tensor | None = None) -> DeviceMask | None:
        """What each ``(r, grammar)`` allows next for logits row ``r``, on its way to a GPU
        ``device`` (into ``target``, laid out as ``GrammarBitmaskApplier.upload`` says, when
        given; None: no row's grammar can go on; a terminated one is left unmasked: its
        request ends with this step, whose token the engine drops)."""
        rows = [(row, g) for row, g in rows if not g.is_terminated]
        if not rows:
            return None
        bitmask = self._applier.buffer(len(rows), self._num_words, device, num_logits_rows)
        self._filler.fill([g for _, g in rows], bitmask)
        return self._applier.upload(bitmask, [row for row, _ in rows], num_logits_rows, device,
                                    target)

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, RequestGrammar]]) -> None:
        """Mask logits row ``r`` with what its grammar allows next, for each ``(r, grammar)``
        (as ``stage``, applied to the logits now)."""
        if logits.is_cuda:
            staged = self.stage(rows, logits.shape[0], logits.device)
            if staged is not None:
                staged.apply(logits)
            return
        rows = [(row, g) for row, g in rows if not g.is_terminated]
        if rows:
            bitmask = self._applier.buffer(len(rows), self._num_words, logits.device)
            self._filler.fill([g for _, g in rows], bitmask)
            self._applier.apply(logits, bitmask, [row for row, _ in rows])
