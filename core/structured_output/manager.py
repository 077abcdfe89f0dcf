"""Grammars for the engine core: compiled off the busy loop, cached, matched per request, and
sent to the workers, which fill each step's next-token bitmask.

A grammar's compiled form exists twice. The engine's matcher (``RequestGrammar``, advanced by
the scheduler by exactly the tokens it appends) decides when a request's grammar is complete
and whether a token broke it. TP rank 0's worker keeps a matcher of its own per request
(``structured_output.worker``), advanced by the tokens it sampled, and fills the bitmask while
the device runs the step's forward: the mask is then on no round trip between processes (in
SGLang the scheduler that holds the matchers shares the worker's process for the same
reason). The engine compiles once and sends the compiled grammar (xgrammar's serialized form)
to the workers with the first step that brings them a request under it (``GrammarShipments``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

from bastion.core.structured_output.spec import (
    JSON_SCHEMA_OPTIONS,
    GrammarKey,
    GrammarSpecError,
    clean_error,
    grammar_key,
)
from bastion.ipc.messages import SchedulerOutput, StructuredOutputsParams

if TYPE_CHECKING:
    from bastion.core.request import Request

logger = logging.getLogger(__name__)


class RequestGrammar:
    """One request's matcher. With ``start_after_token_id`` (reasoning models) the grammar
    constrains nothing until that token has been output, and applies to what follows it."""

    def __init__(self, compiled: Any, eos_token_id: int | None,
                 start_after_token_id: int | None = None) -> None:
        import xgrammar as xgr

        stop = [eos_token_id] if eos_token_id is not None else None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop)
        self.matcher_vocab_size = compiled.tokenizer_info.vocab_size
        self.start_after_token_id = start_after_token_id
        self.is_active = start_after_token_id is None
        # NOTE: a matcher terminates exactly when it accepts a stop token (xgrammar's default,
        # terminate_without_stop_token off), so the fold asks a set instead of the matcher:
        # one call fewer per grammar row and step.
        self._stop_token_ids = frozenset(self.matcher.stop_token_ids)
        self.is_terminated = False
        self.num_accepted = 0  # output tokens consumed

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; False when the grammar does not allow it."""
        if not self.is_active:
            self.is_active = token_id == self.start_after_token_id
            self.num_accepted += 1
            return True
        if not self.matcher.accept_token(token_id):
            return False
        self._took(token_id)
        return True

    def _took(self, token_id: int) -> None:
        """The matcher accepted ``token_id``."""
        self.is_terminated = token_id in self._stop_token_ids
        self.num_accepted += 1

    def catch_up(self, token_ids: list[int]) -> bool:
        """Accept ``token_ids[self.num_accepted:]`` (a worker's matcher follows the request's
        output list); False when one is refused (the grammar is then left where it stopped)."""
        while self.num_accepted < len(token_ids):
            if not self.accept(token_ids[self.num_accepted]):
                return False
        return True

    @staticmethod
    def accept_each(grammars: list[RequestGrammar], token_ids: list[int]) -> list[bool]:
        """``grammars[i].accept(token_ids[i])`` for every ``i``: the active matchers in one
        call of xgrammar's (half the time of one call each, and without the GIL)."""
        import xgrammar as xgr

        ok = [True] * len(grammars)
        active = []
        for i, grammar in enumerate(grammars):
            # Others (waiting for their start token, or another kind of grammar: the tests'
            # stand-ins) take their token one by one.
            if grammar.is_active and isinstance(grammar, RequestGrammar):
                active.append(i)
            else:
                ok[i] = grammar.accept(token_ids[i])
        if active:
            taken = xgr.BatchGrammarMatcher.batch_accept_token(
                [grammars[i].matcher for i in active], [token_ids[i] for i in active])
            for i, accepted in zip(active, taken):
                ok[i] = accepted
                if accepted:
                    grammars[i]._took(token_ids[i])
        return ok

    def allows_no_token(self) -> bool:
        """Whether no token can follow (a dead end: the grammar needs text that no token of
        the vocabulary spells). Asked only after a token was refused, off the fill's path."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.matcher_vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())


class CompiledGrammar(NamedTuple):
    """A compile's result: xgrammar's compiled grammar, its id on the wire (a digest of its
    key) and its serialized form for the workers."""

    grammar: Any
    grammar_id: str
    payload: bytes


class StructuredOutputManager:
    """Compiles (on its own threads) and caches by ``GrammarKey``; keeps the record of what the
    workers hold (``shipments``).

    ``load_tokenizer`` is called once, on a compile thread, when the first grammar arrives: a
    server that never sees one never pays for the vocabulary's table.
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: Callable[[], int],
                 max_compile_threads: int = 2, max_cached: int = 256) -> None:
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_compile_threads, thread_name_prefix="grammar")
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._max_cached = max_cached
        self.vocabulary = b""  # the compiler's TokenizerInfo, serialized, once it exists
        self.shipments = GrammarShipments(max_cached)

    # --------------------------------------------------------------------------- compile

    def use_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer (or xgrammar ``TokenizerInfo``) to compile against, before the first
        grammar arrives."""
        self._load_tokenizer = lambda: tokenizer

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The ``CompiledGrammar`` of ``spec``, as a future (shared by equal specs)."""
        key = grammar_key(spec)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._cache[key] = self._pool.submit(self._compile, key)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return future

    def _compiler_for(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                start = time.perf_counter()
                tokenizer = self._load_tokenizer()
                vocab_size = self._vocab_size()
                # A ready TokenizerInfo is taken as it is (benchmarks of dummy models).
                info = (tokenizer if isinstance(tokenizer, xgr.TokenizerInfo) else
                        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
                self.vocabulary = info.serialize_json().encode()
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
                logger.info("structured outputs: grammar compiler for a vocabulary of %d "
                            "built in %.2f s", vocab_size, time.perf_counter() - start)
            return self._compiler

    def _compile(self, key: GrammarKey) -> CompiledGrammar:
        compiler = self._compiler_for()
        try:
            if key.kind == "json":
                compiled = compiler.compile_json_schema(key.text, **JSON_SCHEMA_OPTIONS)
            elif key.kind == "regex":
                compiled = compiler.compile_regex(key.text)
            elif key.kind == "grammar":
                compiled = compiler.compile_grammar(key.text)
            else:
                compiled = compiler.compile_builtin_json_grammar()
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others
            raise GrammarSpecError(f"the {key.kind} grammar cannot be compiled: "
                                   f"{clean_error(exc)}") from None
        digest = hashlib.blake2b(f"{key.kind}\0{key.text}".encode(), digest_size=12).hexdigest()
        return CompiledGrammar(compiled, digest, compiled.serialize_json().encode())

    def attach_grammar(self, request: Request) -> None:
        """Give a request whose compilation finished its matcher, advanced by the tokens it
        already has (a request resumed after a fault continues its grammar from the tokens it
        streamed; a preempted one keeps its matcher). Raises ``GrammarSpecError``."""
        compiled = request.grammar_future.result()  # raises the compile's GrammarSpecError
        request.grammar_future = None
        spec = request.sampling_params.structured_outputs
        grammar = RequestGrammar(compiled.grammar, request.eos_token_id,
                                 spec.start_after_token_id)
        if not grammar.catch_up(request.output_token_ids):
            # Not the client's input: its tokens were made under this grammar.
            raise ValueError(f"the request's tokens so far do not match its grammar (token "
                             f"{request.output_token_ids[grammar.num_accepted]})")
        request.grammar, request.compiled_grammar = grammar, compiled

    def ship(self, request: Request) -> str | None:
        """The id of ``request``'s grammar for its ``NewRequestData``, recording the grammar
        (and before the first, the vocabulary) for the step's shipment."""
        compiled = request.compiled_grammar
        if compiled is None:
            return None
        self.shipments.add(compiled, self.vocabulary)
        return compiled.grammar_id

    @staticmethod
    def wait_any(futures: list[Future], timeout_s: float) -> None:
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarShipments:
    """The engine's record of the compiled grammars its workers hold (at most ``max_held``,
    least recently shipped forgotten first) and what the next step must bring them.

    The workers learn a grammar from the step that first brings them a request under it, and
    the vocabulary before the first grammar. ``forget`` (fault recovery: the workers may be new
    processes) starts over.
    """

    def __init__(self, max_held: int) -> None:
        self.max_held = max_held
        self._held: OrderedDict[str, None] = OrderedDict()
        self._vocabulary_sent = False
        self._grammars: dict[str, bytes] = {}
        self._vocabulary: bytes | None = None
        self._dropped: list[str] = []

    def add(self, compiled: CompiledGrammar, vocabulary: bytes) -> None:
        if not self._vocabulary_sent:
            self._vocabulary, self._vocabulary_sent = vocabulary, True
        grammar_id = compiled.grammar_id
        if grammar_id in self._held:
            self._held.move_to_end(grammar_id)
            return
        self._held[grammar_id] = None
        self._grammars[grammar_id] = compiled.payload
        # NOTE: never one this step brings: a request of this step needs it.
        for old in [g for g in self._held if g not in self._grammars][
                :max(len(self._held) - self.max_held, 0)]:
            del self._held[old]
            self._dropped.append(old)

    def take(self, out: SchedulerOutput) -> None:
        """Put what the workers must learn before ``out`` runs into it."""
        if self._grammars:
            out.grammars, self._grammars = self._grammars, {}
        if self._vocabulary is not None:
            out.grammar_vocabulary, self._vocabulary = self._vocabulary, None
        if self._dropped:
            out.dropped_grammar_ids, self._dropped = self._dropped, []

    def forget(self) -> None:
        self._held.clear()
        self._grammars.clear()
        self._dropped.clear()
        self._vocabulary, self._vocabulary_sent = None, False
