"""Continuous batching: one token budget per step shared by decodes and chunked prefills."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from bastion.core.config import CacheConfig, SchedulerConfig
from bastion.core.kv_cache_manager import KVCacheManager
from bastion.core.request import Request, RequestStatus
from bastion.core.structured_output.manager import RequestGrammar, StructuredOutputManager
from bastion.core.structured_output.spec import GrammarSpecError
from bastion.ipc.messages import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Policy, in order: running requests first (decodes and unfinished prefills), each taking
    what it needs from the step's token budget; when blocks run out the lowest-priority running
    request (the newest, under FCFS) is preempted by recompute; then waiting requests are
    admitted while budget, ``max_num_seqs`` and blocks allow.
    """

    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, max_model_len: int, num_spec_tokens: int = 0,
                 num_lookahead_tokens: int = 0, max_loras: int = 0,
                 structured_output: StructuredOutputManager | None = None,
                 is_async_spec: bool = False) -> None:
        self.config = sched_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.known_by_workers: set[str] = set()
        self.finished_ids: list[str] = []  # to tell the workers next step
        self.rejected: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.iteration_tokens: list[int] = []  # per step since the last stats report
        self.num_blocks = num_blocks
        self.step_id = 0
        # The requests each step still in flight scheduled, by step id: an update applies a
        # token only to the very request its step ran (an id may be reused in between).
        self.scheduled: dict[int, dict[str, Request]] = {}
        # Speculative decoding: each decode row may carry up to this many draft tokens (0: off).
        self.num_spec_tokens = num_spec_tokens
        self.spec_stats = _SpecStats(num_spec_tokens)
        # Under async scheduling the workers draft: a decode row gets up to this many draft
        # slots as placeholders (-1), which its worker fills with its own drafts.
        self.is_async_spec = is_async_spec and bool(num_spec_tokens)
        # Draft model: slots past a sampling row's tokens where the draft writes the KV of the
        # tokens it proposes (scratch, rewritten by the next step).
        self.num_lookahead_tokens = num_lookahead_tokens
        # Distinct adapters one batch may mix (the workers' device slots); 0: LoRA is off.
        self.max_loras = max_loras
        self.removing_loras: set[int] = set()  # unloaded; freed once their requests are done

        # Structured outputs: requests whose grammar is still compiling wait here, out of
        # ``waiting``, so the requests behind them are admitted meanwhile.
        self.structured_output = structured_output
        self.compiling: list[Request] = []

    # ---------------------------------------------------------------- admission and removal

    def add_request(self, request: Request) -> None:
        if request.deadline is not None and request.deadline < time.time():
            # Its deadline passed on the way here: answer now rather than after a prefill.
            error = "the request's deadline passed before it could be scheduled"
            request.finish(FinishReason.TIMEOUT, error=error)
            self.rejected.append(EngineCoreOutput(request.request_id, [], FinishReason.TIMEOUT,
                                                  error=error))
            return
        if request.request_id in self.requests:
            self._reject(request, FinishReason.ERROR,  # the server's own ids: a bug, not input
                         f"request id {request.request_id!r} is already in use")
            return
        error = self._admission_error(request)
        if error is not None:
            self._reject(request, FinishReason.REJECTED, error)
            return
        self.requests[request.request_id] = request
        request.max_num_tokens = min(request.max_num_tokens, self.max_model_len)
        if request.sampling_params.structured_outputs is not None:
            request.grammar_future = self.structured_output.compile(
                request.sampling_params.structured_outputs)
            self.compiling.append(request)
            return
        self._enqueue(request)

    def _reject(self, request: Request, reason: FinishReason, error: str) -> None:
        request.finish(reason, error=error)
        self.rejected.append(EngineCoreOutput(request.request_id, [], reason, error=error))

    def _admission_error(self, request: Request) -> str | None:
        """Why the request's own input can never be served here (the API answers 400)."""
        if request.lora_request is not None and not self.max_loras:
            return (f"the request names LoRA adapter {request.lora_request.lora_name!r} but "
                    "LoRA is not enabled (--enable-lora)")
        if request.num_prompt_tokens == 0:
            return "the prompt is empty"
        if request.sampling_params.structured_outputs is not None and not self.structured_output:
            return "this engine was built without structured outputs"
        if request.num_tokens >= self.max_model_len:
            return (f"the prompt has {request.num_prompt_tokens} tokens; this engine accepts at "
                    f"most {self.max_model_len - 1} (max_model_len {self.max_model_len})")
        num_blocks = -(-min(request.num_tokens + 1, self.max_model_len) // self.block_size)
        if num_blocks > self.kv.num_blocks:
            return (f"the request needs {num_blocks} KV blocks but the pool has only "
                    f"{self.kv.num_blocks}; it can never be scheduled")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and request.num_tokens > budget:
            return (f"the prompt has {request.num_prompt_tokens} tokens but, with chunked "
                    f"prefill off, a step computes at most {budget} "
                    "(max_num_batched_tokens); it can never be scheduled")
        return None

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            self.waiting.append(request)
            self.waiting = deque(sorted(self.waiting, key=Request.sort_key))
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.finish(FinishReason.ABORT)
            self._remove(request)
            outputs.append(EngineCoreOutput(request_id, [], FinishReason.ABORT))
        return outputs

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.compiling:
            self.compiling.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        if request.request_id in self.known_by_workers:
            self.known_by_workers.discard(request.request_id)
            self.finished_ids.append(request.request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.compiling)

    def _admit_compiled(self) -> None:
        """Move requests whose grammar is ready to ``waiting`` (or fail them); with nothing
        else to run, wait a little for one instead of spinning the busy loop."""
        if not (self.waiting or self.running):
            self.structured_output.wait_any([r.grammar_future for r in self.compiling], 0.01)
        for request in [r for r in self.compiling if r.grammar_future.done()]:
            self.compiling.remove(request)
            try:
                self.structured_output.attach_grammar(request)
            except ValueError as exc:
                self.requests.pop(request.request_id, None)
                reason = (FinishReason.REJECTED if isinstance(exc, GrammarSpecError)
                          else FinishReason.ERROR)
                self._reject(request, reason, str(exc))
                continue
            self._enqueue(request)

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        if self.compiling:
            self._admit_compiled()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False
        spec_tokens: dict[str, list[int]] = {}
        is_speculating = bool(self.num_spec_tokens)

        index = 0
        running = self.running
        while index < len(running) and budget > 0:
            request = running[index]
            in_flight = request.num_output_placeholders
            if in_flight and self._at_length_limit(request, in_flight):
                index += 1  # its last token is already in flight; the next update finishes it
                continue
            num_new = min(request.num_tokens + in_flight - request.num_computed_tokens, budget)
            if is_speculating:
                new_block_ids, drafts = self._allocate_spec(request, num_new, budget)
                num_new += len(drafts)
                if drafts:
                    spec_tokens[request.request_id] = drafts
            else:
                new_block_ids = self.kv.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self._pick_victim(self.running[index:])
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                continue  # the request preempted itself; self.running shrank
            cached = CachedRequestData(request.request_id, new_block_ids,
                                       request.num_computed_tokens)
            if request.num_freed_blocks:
                cached.num_freed_blocks, request.num_freed_blocks = request.num_freed_blocks, 0
            cached_reqs.append(cached)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1

        # NOTE: no admissions in a step that preempted: the pool is too tight to grow.
        loras = {r.lora_id for r in self.running if r.lora_id}
        skipped: list[Request] = []  # waiting behind an adapter this batch has no slot for
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: re-admit it once the token is known
            if request.lora_id and request.lora_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            computed = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - computed.num_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            lookahead = (self._lookahead(request, num_new + computed.num_tokens)
                         if self.num_lookahead_tokens else 0)
            if (self.kv.allocate_slots(request, num_new + lookahead, computed) is None
                    and (not lookahead
                         or self.kv.allocate_slots(request, num_new, computed) is None)):
                break
            self.waiting.popleft()
            if request.lora_id:
                loras.add(request.lora_id)
            request.num_freed_blocks = 0  # the workers get its whole block table anew
            request.num_computed_tokens += computed.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed.num_tokens
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            new_reqs.append(NewRequestData(
                request.request_id, request.prompt_token_ids, request.sampling_params,
                self.kv.block_ids(request.request_id), request.num_computed_tokens,
                list(request.output_token_ids), request.eos_token_id, request.lora_request,
                None if request.compiled_grammar is None
                else self.structured_output.ship(request)))
            self.known_by_workers.add(request.request_id)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))  # they keep their place in the queue

        scheduled = {}
        grammar_ids = []
        for request_id, n in num_scheduled.items():
            request = scheduled[request_id] = self.requests[request_id]
            request.num_computed_tokens += n
            num_drafts = len(spec_tokens.get(request_id, ()))
            if (request.num_computed_tokens
                    == request.num_tokens + request.num_output_placeholders + num_drafts):
                # This step samples the request's next token (past its drafts). Until it is
                # folded in, its drafts and that token are placeholders, as if every draft were
                # accepted; the fold gives the rejected ones back.
                request.num_output_placeholders += 1 + num_drafts
                if request.grammar is not None:
                    grammar_ids.append(request_id)
        self.step_id += 1
        if scheduled:
            self.scheduled[self.step_id] = scheduled
            self.iteration_tokens.append(sum(num_scheduled.values()))
        out = SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                              sum(num_scheduled.values()), self.finished_ids, self.step_id)
        if self.removing_loras:
            out.removed_lora_ids = self._take_removable_loras()
        if spec_tokens:
            out.scheduled_spec_decode_tokens = spec_tokens
        if grammar_ids:
            out.structured_output_request_ids = grammar_ids
        if self.structured_output is not None:
            self.structured_output.shipments.take(out)
        self.finished_ids = []
        return out

    def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter once none of its accepted requests is left (they finish first);
        the workers hear of it in the step after."""
        self.removing_loras.add(lora_id)

    def _take_removable_loras(self) -> list[int]:
        in_use = {r.lora_id for r in self.requests.values()}
        done = sorted(self.removing_loras - in_use)
        self.removing_loras.difference_update(done)
        return done

    def _allocate_spec(self, request: Request, num_new: int,
                       budget: int) -> tuple[list[int] | None, list[int]]:
        """Blocks for a running row's ``num_new`` tokens plus its drafts (and the draft
        model's lookahead slots); without room for the extras, for ``num_new`` alone."""
        drafts: list[int] = []
        if request.grammar is not None:
            # NOTE: grammar rows do not speculate: a draft the grammar forbids would need its
            # matcher rolled back, and the mask of each draft position filled ahead.
            request.spec_token_ids = []
        elif request.spec_token_ids or self.is_async_spec:
            drafts = self._take_drafts(request, num_new, budget)
        lookahead = (self._lookahead(request, num_new + len(drafts))
                     if self.num_lookahead_tokens else 0)
        new_block_ids = self.kv.allocate_slots(request, num_new + len(drafts) + lookahead)
        if new_block_ids is None and (drafts or lookahead):  # no room: decode plainly
            drafts = []
            new_block_ids = self.kv.allocate_slots(request, num_new)
        return new_block_ids, drafts

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Lookahead slots for a row that samples this step (its ``num_new`` tokens reach its
        end), within max_model_len."""
        end = request.num_computed_tokens + num_new
        if end < request.num_tokens:
            return 0  # a prefill chunk short of the prompt's end samples nothing
        return max(min(self.num_lookahead_tokens, self.max_model_len - end), 0)

    def _take_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The drafts a decode row runs this step: as many as the token budget and the
        request's length limit leave room for (a draft past max_tokens could never be emitted).
        Under async speculation, placeholder slots for the worker's drafts instead.
        """
        if self.is_async_spec:
            return self._draft_slots(request, num_new, budget)
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return []  # not a plain decode row (a prefill chunk, or a token in flight)
        room = min(budget - 1, request.max_num_tokens - request.num_tokens - 1)
        return drafts[:max(room, 0)]

    def _draft_slots(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Async speculation: placeholders (-1) for the drafts a decode row may run this step.

        NOTE: the drafts are the worker's, proposed right after the step still in flight for
        this request (if any), so their number is not known here: as many slots as the token
        budget, ``k`` and the length limit allow are reserved, and the worker fills as many as
        it has drafts for and its exact length limit allows. The limit here counts the step in
        flight as emitting only its one sampled token (it may accept none of its drafts), so
        the worker always has as many slots as a synchronous step would give it drafts: the
        same drafts are verified either way, and a seeded request draws the same random numbers
        (its tokens do not depend on async scheduling). Slots the worker leaves empty are given
        back at the fold like rejected drafts.
        """
        num_known = request.num_tokens + request.num_output_placeholders
        if num_new != 1 or request.num_computed_tokens != num_known - 1:
            return []  # not a plain decode row (a prefill chunk)
        num_fewest = request.num_tokens + (1 if request.num_output_placeholders else 0)
        room = min(budget - 1, request.max_num_tokens - num_fewest - 1, self.num_spec_tokens)
        return [-1] * max(room, 0)

    @staticmethod
    def _at_length_limit(request: Request, num_in_flight: int = 0) -> bool:
        """Whether the request's tokens, plus ``num_in_flight`` not known yet, reach
        max_tokens or max_model_len (then scheduling it again would pass its end)."""
        return len(request.all_token_ids) + num_in_flight >= request.max_num_tokens

    def _pick_victim(self, candidates: list[Request]) -> Request:
        # Only requests not yet scheduled this step are candidates (``candidates`` starts at the
        # one asking for blocks), so nothing already in this step's batch is pulled out of it.
        if self.config.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the blocks and start over from the prompt plus outputs."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_freed_blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.request_id in self.known_by_workers:
            self.known_by_workers.discard(request.request_id)
            self.finished_ids.append(request.request_id)
        self._enqueue(request, front=True)

    # ------------------------------------------------------------------------------- update

    def update_from_output(self, sched: SchedulerOutput,
                           result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self.rejected = self.rejected, []
        scheduled = self.scheduled.pop(sched.step_id, {})
        if result.sampled_token_id_lists:
            self._update_spec(sched, result, scheduled, outputs)
            outputs.extend(self.expire_deadlines())
            return outputs
        self._collect_prompt_logprobs(result)
        requests, logprobs_rows = self.requests, result.logprobs
        live = []  # (row, request, token) of the requests not finished or aborted meanwhile
        for i, (request_id, token_id) in enumerate(zip(result.request_ids,
                                                       result.sampled_token_ids)):
            request = scheduled.get(request_id)
            if request is not None and requests.get(request_id) is request:
                live.append((i, request, token_id))
        grammar_ok = self._accept_grammar_tokens(live)
        for i, request, token_id in live:
            request_id = request.request_id
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            # NOTE: a request preempted while this step ran keeps the token: its KV was intact
            # when the step computed it, and its recompute will include it.
            request.append_output_token(token_id)
            self._check_stop(request, token_id, grammar_ok.get(request_id))
            output = EngineCoreOutput(
                request_id, [token_id], request.finish_reason, request.stop_reason,
                max(request.num_cached_tokens, 0),
                logprobs_rows[i] if i < len(logprobs_rows) else None, request.error)
            output.prompt_logprobs = request.take_prompt_logprobs()
            if len(request.output_token_ids) == 1 and request.scheduled_time is not None:
                output.queue_time_s = request.scheduled_time - request.queued_time
                output.prefill_time_s = time.monotonic() - request.scheduled_time
            outputs.append(output)
            if request.status == RequestStatus.FINISHED:
                self._remove(request)
        outputs.extend(self.expire_deadlines())
        return outputs

    def _update_spec(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                     scheduled: dict[str, Request], outputs: list[EngineCoreOutput]) -> None:
        """Fold a speculative step: each request emitted its accepted drafts and one token
        more. Tokens are appended one by one and a stop ends the request at exactly that token;
        the KV slots of rejected drafts are given back."""
        drafts_by_id = sched.scheduled_spec_decode_tokens
        logprobs_rows, next_drafts = result.logprobs, result.draft_token_ids
        self._collect_prompt_logprobs(result)
        for i, (request_id, token_ids) in enumerate(zip(result.request_ids,
                                                        result.sampled_token_id_lists)):
            request = scheduled.get(request_id)
            if request is None or self.requests.get(request_id) is not request:
                continue
            drafts = drafts_by_id.get(request_id, ())
            request.num_output_placeholders = max(
                request.num_output_placeholders - 1 - len(drafts), 0)
            num_accepted = len(token_ids) - 1
            # Async speculation: ``drafts`` are the slots this step had; the worker verified
            # as many drafts as it had (at most that many), and says how many.
            num_verified = (result.num_draft_tokens[i] if i < len(result.num_draft_tokens)
                            else len(drafts))
            if num_verified:
                self.spec_stats.observe(num_verified, num_accepted)
            num_rejected = len(drafts) - num_accepted
            # NOTE: a request preempted while this step ran starts over from its tokens
            # (these included); its progress and blocks are already gone.
            is_running = request.status == RequestStatus.RUNNING
            if is_running:
                # NOTE: only the accepted drafts' KV is valid; the rejected positions are
                # computed again (with the right tokens) by later steps. Under async
                # scheduling the step after this one (if in flight) was scheduled as if every
                # draft were accepted: the same correction puts it where its worker ran it.
                request.num_computed_tokens -= num_rejected
            emitted = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                emitted.append(token_id)
                self._check_stop(request, token_id)
                if request.status == RequestStatus.FINISHED:
                    break
            logprobs = logprobs_rows[i] if i < len(logprobs_rows) else None
            if logprobs is not None and len(emitted) < len(token_ids):
                n = len(emitted)
                logprobs = type(logprobs)(logprobs.token_ids[:n], logprobs.logprobs[:n],
                                          logprobs.ranks[:n])
            outputs.append(EngineCoreOutput(request_id, emitted, request.finish_reason,
                                            request.stop_reason,
                                            max(request.num_cached_tokens, 0), logprobs,
                                            prompt_logprobs=request.take_prompt_logprobs()))
            if request.status == RequestStatus.FINISHED:
                self._remove(request)
                continue
            if num_rejected > 0 and is_running:
                # NOTE: blocks past the corrected count hold no slot of a step in flight either,
                # but for a draft model's lookahead: that step's drafts are written past its
                # tokens, so its lookahead slots stay with the request until it is folded too.
                keep = request.num_computed_tokens
                if request.num_output_placeholders:
                    keep += self.num_lookahead_tokens
                request.num_freed_blocks += self.kv.trim(request, keep)
            if not self.is_async_spec:
                request.spec_token_ids = list(next_drafts[i]) if i < len(next_drafts) else []

    def _collect_prompt_logprobs(self, result: ModelRunnerOutput) -> None:
        for part in result.prompt_logprobs:
            request = self.requests.get(part.request_id)
            if request is not None:
                request.add_prompt_logprobs(part)

    @staticmethod
    def _accept_grammar_tokens(live: list[tuple[int, Request, int]]) -> dict[str, bool]:
        """Advance the grammars of a plain step's ``live`` requests by their tokens, in one
        xgrammar call: whether each accepted its token, by request id."""
        rows = [(request, token_id) for _, request, token_id in live
                if request.grammar is not None]
        if not rows:
            return {}
        taken = RequestGrammar.accept_each([r.grammar for r, _ in rows], [t for _, t in rows])
        return {r.request_id: ok for (r, _), ok in zip(rows, taken)}

    def _check_stop(self, request: Request, token_id: int,
                    grammar_ok: bool | None = None) -> None:
        """End ``request`` if ``token_id`` (just appended) ends it. ``grammar_ok``: whether
        its grammar took the token already (None: take it here)."""
        grammar = request.grammar
        if grammar_ok is None and grammar is not None:
            grammar_ok = grammar.accept(token_id)
        if grammar is not None and not grammar_ok:
            # The step's bitmask allowed only what the grammar accepts. When it allowed
            # nothing, the grammar is a dead end for this vocabulary (a regex of characters no
            # token spells): the request's input. Otherwise this is a bug. Either way the
            # request cannot go on under its grammar.
            if grammar.allows_no_token():
                request.finish(FinishReason.REJECTED, error=(
                    f"no token of the model's vocabulary can continue the request's grammar "
                    f"after {request.num_output_tokens - 1} output tokens"))
            else:
                request.finish(FinishReason.ERROR, error=f"token {token_id} does not match "
                               "the request's grammar")
            return
        params = request.sampling_params
        is_eos = token_id == request.eos_token_id and not params.ignore_eos
        if ((is_eos or token_id in params.stop_token_ids)
                and request.num_output_tokens >= params.min_tokens):
            request.finish(FinishReason.STOP, stop_reason=None if is_eos else token_id)
        elif grammar is not None and grammar.is_terminated:
            request.finish(FinishReason.STOP)  # complete and stopped (ignore_eos kept going)
        elif self._at_length_limit(request):
            request.finish(FinishReason.LENGTH)

    def expire_deadlines(self) -> list[EngineCoreOutput]:
        now = time.time()
        expired = [r for r in self.requests.values() if r.deadline is not None and r.deadline < now]
        outputs = []
        for request in expired:
            error = "the request's deadline passed before it could complete"
            request.finish(FinishReason.TIMEOUT, error=error)
            self._remove(request)
            outputs.append(EngineCoreOutput(request.request_id, [], FinishReason.TIMEOUT,
                                            error=error))
        return outputs

    def take_rejected(self) -> list[EngineCoreOutput]:
        outputs, self.rejected = self.rejected, []
        return outputs

    # ----------------------------------------------------------------------- fault handling

    def drop_all(self) -> None:
        """Forget every request and the whole KV state."""
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self.compiling.clear()
        self.rejected.clear()
        self.kv.reset()
        self.scheduled.clear()
        self.known_by_workers.clear()
        self.finished_ids.clear()
        if self.structured_output is not None:  # the workers may be new processes
            self.structured_output.shipments.forget()

    def make_stats(self) -> SchedulerStats:
        stats = SchedulerStats(len(self.running), len(self.waiting) + len(self.compiling),
                               self.kv.usage(),
                               self.kv.prefix_queries, self.kv.prefix_hits, self.num_preemptions,
                               self.step_id, self.iteration_tokens, self.num_blocks)
        if self.spec_stats.num_drafts:
            self.spec_stats.fill(stats)
        if self.max_loras:
            stats.running_lora_adapters = _lora_names(self.running)
            stats.waiting_lora_adapters = _lora_names(self.waiting)
        self.kv.prefix_queries = self.kv.prefix_hits = self.num_preemptions = 0
        self.iteration_tokens = []
        return stats


def _lora_names(requests: Iterable[Request]) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


class _SpecStats:
    """Speculative decoding counters since the last report (vLLM's spec_decode_* names)."""

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def fill(self, stats: SchedulerStats) -> None:
        stats.spec_num_drafts = self.num_drafts
        stats.spec_num_draft_tokens = self.num_draft_tokens
        stats.spec_num_accepted_tokens = self.num_accepted_tokens
        stats.spec_num_accepted_tokens_per_pos = self.accepted_per_pos
        self.reset()
