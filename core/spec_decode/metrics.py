"""The engine's periodic speculative-decoding log line."""

from __future__ import annotations

import logging
import time

from bastion.ipc.messages import SchedulerStats

logger = logging.getLogger("bastion.core.spec_decode")


class SpecDecodingLogger:
    """Sums the per-step spec_decode counters and logs one line every ``interval_s``.

    Mean acceptance length is vLLM's: tokens a verify step emits on average, i.e.
    ``1 + accepted / drafts`` (1.0 means no draft was ever accepted).
    """

    def __init__(self, num_spec_tokens: int, interval_s: float = 10.0) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, stats: SchedulerStats) -> None:
        if stats.spec_num_drafts:
            self.num_drafts += stats.spec_num_drafts
            self.num_draft_tokens += stats.spec_num_draft_tokens
            self.num_accepted_tokens += stats.spec_num_accepted_tokens
            for pos, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
                self.accepted_per_pos[pos] += n
        now = time.monotonic()
        if self.num_drafts and now - self._last_log >= self.interval_s:
            logger.info("%s", self.summary())
            self._last_log = now
            self._reset()

    def summary(self) -> str:
        drafts = max(self.num_drafts, 1)
        per_pos = ", ".join(f"{n / drafts:.2f}" for n in self.accepted_per_pos)
        rate = self.num_accepted_tokens / max(self.num_draft_tokens, 1)
        return (f"SpecDecoding metrics: mean acceptance length {1 + self.num_accepted_tokens / drafts:.2f}, "
                f"accepted {self.num_accepted_tokens}/{self.num_draft_tokens} draft tokens "
                f"({100 * rate:.1f} %), {self.num_drafts} drafts, per-position acceptance "
                f"[{per_pos}]")
