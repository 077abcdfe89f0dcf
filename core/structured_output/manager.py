"""Grammars for the engine core: compiled off the busy loop, cached, matched per request, and
turned into each step's next-token bitmask.

The matchers live here, in the process that schedules (as in vLLM V1): the scheduler advances
a request's matcher by exactly the tokens it appends, and once the step before a launched step
is folded in the engine fills that step's bitmask (on the fill thread, ``fill``) while the device
computes the forward; the workers only apply it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from bastion.core.structured_output.fill import BitmaskFill, BitmaskFiller
from bastion.core.structured_output.spec import (
    JSON_SCHEMA_OPTIONS,
    GrammarKey,
    GrammarSpecError,
    clean_error,
    grammar_key,
)
from bastion.ipc.messages import StructuredOutputsParams

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

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; False when the grammar does not allow it."""
        if not self.is_active:
            self.is_active = token_id == self.start_after_token_id
            return True
        if not self.matcher.accept_token(token_id):
            return False
        self.is_terminated = token_id in self._stop_token_ids
        return True

    def allows_no_token(self) -> bool:
        """Whether no token can follow (a dead end: the grammar needs text that no token of
        the vocabulary spells). Asked only after a token was refused, off the fill's path."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.matcher_vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())


class StructuredOutputManager:
    """Compiles (on its own threads), caches by ``GrammarKey`` and fills bitmasks (``fill``;
    ``max_fill_threads``: xgrammar threads one large fill is split over).

    ``load_tokenizer`` is called once, on a compile thread, when the first grammar arrives: a
    server that never sees one never pays for the vocabulary's table.
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: Callable[[], int],
                 max_compile_threads: int = 2, max_cached: int = 256,
                 max_fill_threads: int | None = None) -> None:
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_compile_threads, thread_name_prefix="grammar")
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._max_cached = max_cached
        self._max_fill_threads = max_fill_threads
        # None: on a thread of its own when this process has the cores (``fill``); read when
        # the first bitmask is filled.
        self.fill_in_background: bool | None = None
        self._filler: BitmaskFiller | None = None
        self.num_words = 0  # int32 words of one bitmask row, known once the compiler exists

    # --------------------------------------------------------------------------- compile

    def use_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer (or xgrammar ``TokenizerInfo``) to compile against, before the first
        grammar arrives."""
        self._load_tokenizer = lambda: tokenizer

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec``, as a future (shared by equal specs)."""
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
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
                self.num_words = int(xgr.get_bitmask_shape(1, vocab_size)[1])
                logger.info("structured outputs: grammar compiler for a vocabulary of %d "
                            "built in %.2f s", vocab_size, time.perf_counter() - start)
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        compiler = self._compiler_for()
        try:
            if key.kind == "json":
                return compiler.compile_json_schema(key.text, **JSON_SCHEMA_OPTIONS)
            if key.kind == "regex":
                return compiler.compile_regex(key.text)
            if key.kind == "grammar":
                return compiler.compile_grammar(key.text)
            return compiler.compile_builtin_json_grammar()
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others
            raise GrammarSpecError(f"the {key.kind} grammar cannot be compiled: "
                                   f"{clean_error(exc)}") from None

    @staticmethod
    def attach_grammar(request: Request) -> None:
        """Give a request whose compilation finished its matcher, advanced by the tokens it
        already has (a request resumed after a fault continues its grammar from the tokens it
        streamed; a preempted one keeps its matcher). Raises ``GrammarSpecError``."""
        compiled = request.grammar_future.result()  # raises the compile's GrammarSpecError
        request.grammar_future = None
        spec = request.sampling_params.structured_outputs
        grammar = RequestGrammar(compiled, request.eos_token_id, spec.start_after_token_id)
        for token_id in request.output_token_ids:
            if not grammar.accept(token_id):
                # Not the client's input: its tokens were made under this grammar.
                raise ValueError(f"the request's tokens so far do not match its grammar "
                                 f"(token {token_id})")
        request.grammar = grammar

    @staticmethod
    def wait_any(futures: list[Future], timeout_s: float) -> None:
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------------- bitmask

    def fill_bitmask(self, step_id: int, request_ids: list[str],
                     grammars: list[RequestGrammar]) -> BitmaskFill:
        """Start filling one step's bitmask: row ``i`` is what ``grammars[i]`` allows next (a
        grammar not active yet allows everything). Its matchers must not be advanced before the
        fill's ``result()``."""
        if self._filler is None:
            self._filler = BitmaskFiller(self._max_fill_threads, self.fill_in_background)
        return self._filler.fill(step_id, request_ids, grammars, self.num_words)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._filler is not None:
            self._filler.shutdown()
