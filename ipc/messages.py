"""Every type that crosses a process boundary.

NOTE: all structs are ``array_like=True, omit_defaults=True, gc=False``; new fields are appended
at the end with a default so that older peers keep decoding. Enums on the wire are ``IntEnum``.
"""

from __future__ import annotations

import enum

import msgspec

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class StructuredOutputsParams(msgspec.Struct, **_WIRE):
    """A constraint on the output, as vLLM's ``StructuredOutputsParams``: exactly one is set.

    ``json`` is a JSON schema as text (``json_object`` any JSON object), ``regex`` a regular
    expression, ``choice`` a list of literal outputs, ``grammar`` an EBNF (GBNF) grammar.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # Reasoning models (vLLM applies the grammar after the reasoning part): the grammar
    # constrains only the tokens after the first output token equal to this id.
    start_after_token_id: int | None = None

    def kinds(self) -> list[str]:
        named = {"json": self.json, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar}
        return [k for k, v in named.items() if v is not None] + (
            ["json_object"] if self.json_object else [])


class SamplingParams(msgspec.Struct, **_WIRE):
    """How to sample one request; field names and defaults follow vLLM's ``SamplingParams``.

    ``stop`` strings are matched by the front end (it owns detokenization); everything else is
    applied on the worker by the sampler.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Issue #21: set by the front end from response_format / structured_outputs / guided_* / tools.
    structured_outputs: StructuredOutputsParams | None = None
    # Issue #20: OpenAI's logit_bias, token id -> bias in [-100, 100] added to the logits before
    # sampling (after min_tokens, before the penalties, as vLLM V1).
    logit_bias: dict[int, float] | None = None
    # Issue #20: logprobs of every prompt token (the first has none) with the top ``k``; such a
    # request skips the prefix cache (vLLM's rule), so every prompt position runs the model.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise ``ValueError`` naming the field, what was given and what is accepted."""
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature",
               f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"logprobs must be in [0, 20], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop must be a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")
        if self.logit_bias is not None:
            _check(all(isinstance(t, int) and t >= 0 for t in self.logit_bias), "logit_bias",
                   "logit_bias keys must be non-negative token ids")
            bad = next((v for v in self.logit_bias.values()
                        if not (isinstance(v, (int, float)) and -100.0 <= v <= 100.0)), None)
            _check(bad is None, "logit_bias",
                   f"logit_bias values must be numbers in [-100, 100], got {bad!r}")
        if self.structured_outputs is not None:
            kinds = self.structured_outputs.kinds()
            _check(len(kinds) == 1, "structured_outputs",
                   f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                   f"json_object; got {kinds or 'none'}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5


class LoRARequest(msgspec.Struct, **_WIRE):
    """An adapter to run a request with, as vLLM's ``LoRARequest(name, id, path)``.

    ``lora_int_id`` (positive) identifies the adapter everywhere (slots, prefix-cache hashes);
    ``lora_path`` is a PEFT folder (adapter_config.json + adapter_model.safetensors) that every
    worker can read, so a worker that has not seen the adapter loads it on first use.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str


class InvalidParam(ValueError):
    """A client-caused error that names the offending parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParam(param, message)


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client or the server
    ERROR = 3  # the request could not be served (message in ``EngineCoreOutput.error``)
    # NOTE: its own reason, not ERROR: the API answers a passed deadline with 504
    # deadline_exceeded (a client's choice, not a server bug to retry), never with 500.
    TIMEOUT = 4  # the request's deadline passed before it could complete
    # The request's own input cannot be served, found only in the engine (a grammar that no
    # token of the vocabulary can continue): the API answers 400, as for input it checks itself.
    REJECTED = 5

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort", "error", "timeout", "rejected")[self]


# ---------------------------------------------------------------------------------------------
# API <-> engine core
# ---------------------------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, **_WIRE):
    """ADD: one sequence to generate (the front end fans ``n > 1`` out into ``n`` of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    deadline: float | None = None  # absolute time.time() after which the request fails
    priority: int = 0  # lower is served first when priority scheduling is on
    eos_token_id: int | None = None
    # Tokens already produced (and streamed) before a fault: the request resumes after them.
    resumed_output_token_ids: list[int] = []
    lora_request: LoRARequest | None = None  # None: the base model


class AbortRequests(msgspec.Struct, **_WIRE):
    """ABORT: request ids to drop; their blocks return to the pool."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, **_WIRE):
    """UTILITY: call a whitelisted engine method; the reply carries the same ``call_id``."""

    call_id: int
    method: str
    args: list = []


class UtilityResult(msgspec.Struct, **_WIRE):
    call_id: int
    result: object = None
    failure: str | None = None


class Logprobs(msgspec.Struct, **_WIRE):
    """Per generated token: the sampled token's logprob and rank, then the top-N alternatives."""

    token_ids: list[list[int]]  # [num_tokens][1 + N]: sampled token first
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the sampled token (1 = most likely)


class EngineCoreOutput(msgspec.Struct, **_WIRE):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended the request
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: Logprobs | None = None
    error: str | None = None
    # On the output with a request's first token only (metrics): seconds from its arrival at
    # the engine to its first scheduling, and from there to this token.
    queue_time_s: float = 0.0
    prefill_time_s: float = 0.0
    # With a request's first token, when it asked for prompt_logprobs: one row per prompt token
    # after the first (that token first, then the top-k).
    prompt_logprobs: Logprobs | None = None


class SchedulerStats(msgspec.Struct, **_WIRE):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up since the last report
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # since the last report
    step_counter: int = 0
    iteration_tokens: list[int] = []  # tokens of each step scheduled since the last report
    num_gpu_blocks: int = 0  # the KV block pool's size
    # Speculative decoding since the last report (vLLM's spec_decode_* counters): verify rows
    # that carried drafts, the draft tokens in them, how many were accepted, and accepted
    # tokens by draft position (index j: drafts accepted at position j).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = []
    # LoRA: the adapters (by name) of the running and the waiting requests, sorted.
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class EngineCoreOutputs(msgspec.Struct, **_WIRE):
    """OUTPUTS: everything one engine step produced."""

    engine_id: int
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_result: UtilityResult | None = None
    epoch: int = 0  # the DP group epoch the engine ran at; older epochs' outputs are stale


class EngineState(enum.IntEnum):
    STARTING = 0
    HEALTHY = 1
    UNHEALTHY = 2
    RECOVERING = 3
    DEAD = 4


class FailureKind(enum.IntEnum):
    """What went wrong (a field of every fault report; the metrics' ``kind`` is ``label``)."""

    NONE = 0
    EXCEPTION = 1  # an exception in the busy loop or in a worker's step
    INJECTED = 2  # a drill's fault (--enable-fault-injection)
    PROCESS_EXIT = 3  # the engine or one of its workers is gone
    HANG = 4  # no heartbeat, or a step that made no progress within the bound
    COLLECTIVE = 5  # a collective timed out (a peer died inside it)
    UNREACHABLE = 6  # a sentinel did not answer an order in time

    @property
    def label(self) -> str:
        return self.name.lower()


class EngineStatus(msgspec.Struct, **_WIRE):
    """STATUS: an engine's health as its sentinel sees it."""

    engine_id: int
    state: EngineState
    epoch: int = 0
    fault_info: str | None = None
    last_action: str | None = None
    last_action_id: str | None = None
    last_action_error: str | None = None
    fault_kind: FailureKind = FailureKind.NONE
    # The last recovery on this engine: seconds per phase (spawn_or_promote, load, kv_cache,
    # graphs, rejoin, total), as its sentinel measured them.
    last_recovery_phases: dict[str, float] = {}


# ---------------------------------------------------------------------------------------------
# engine core <-> workers: one EXECUTE per step carrying only what changed
# ---------------------------------------------------------------------------------------------


class NewRequestData(msgspec.Struct, **_WIRE):
    """A request the workers have not seen (or must forget and re-learn after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []  # tokens already generated (resumed after preemption/fault)
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None
    # Structured outputs: the id of the request's compiled grammar, which the workers hold
    # (``SchedulerOutput.grammars`` brings each one once).
    grammar_id: str | None = None


class CachedRequestData(msgspec.Struct, **_WIRE):
    """A running request the workers know: only its new blocks and progress."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Speculative decoding: blocks of rejected draft tokens the scheduler gave back, dropped
    # from the tail of the request's block table before ``new_block_ids`` are appended.
    num_freed_blocks: int = 0


class SchedulerOutput(msgspec.Struct, **_WIRE):
    """EXECUTE: what to run this step. ``num_scheduled_tokens`` maps request id to token count."""

    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_request_ids: list[str] = []  # forget these (finished, aborted or preempted)
    step_id: int = 0
    is_dummy: bool = False  # MoE lockstep: an idle DP rank runs padding rows (EP collectives)
    # MoE lockstep (expert parallel over DP): every engine of the group runs this many token
    # rows this step, its own tokens then padding, so the expert collectives have one static
    # shape; 0 outside a coupled group. ``dp_all_decode``: every engine's batch is decode-only,
    # so each pads to the same CUDA-graph bucket and replays it.
    num_padded_tokens: int = 0
    dp_all_decode: bool = False
    # Speculative decoding: per request, the draft tokens fed after its last token this step
    # (counted in ``num_scheduled_tokens``); the step verifies them and samples one more.
    # Under async scheduling they are placeholders (-1): slots the worker fills with as many
    # of its own drafts as it has (it drafted right after the step before, which the scheduler
    # has not seen yet), feeding the row at the position that step's accepted tokens put it.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # LoRA adapters unloaded (once no request of theirs was left): workers free their slots.
    removed_lora_ids: list[int] = []
    # Structured outputs: the rows of this step that sample under a grammar. TP rank 0's worker
    # advances each one's matcher by the tokens it sampled, fills the bitmask of what may come
    # next while the forward runs, and samples under it.
    structured_output_request_ids: list[str] = []
    # Compiled grammars the workers have not been sent yet (xgrammar's serialized form, by
    # ``grammar_id``), the vocabulary they compile against (once, before the first grammar),
    # and ids the workers may forget (the engine's record of what they hold evicted them).
    grammars: dict[str, bytes] = {}
    grammar_vocabulary: bytes | None = None
    dropped_grammar_ids: list[str] = []


class PromptLogprobs(msgspec.Struct, **_WIRE):
    """Logprobs of prompt tokens ``start + 1 .. start + len(rows)`` of one request, from the
    logits at positions ``start ..`` of one prefill chunk (each row: that token first)."""

    request_id: str
    start: int
    logprobs: Logprobs


class ModelRunnerOutput(msgspec.Struct, **_WIRE):
    """Rank 0's reply to EXECUTE: one sampled token per request that finished its prefill."""

    request_ids: list[str] = []
    sampled_token_ids: list[int] = []
    logprobs: list[Logprobs | None] = []
    step_id: int = 0
    # Speculative decoding only (then ``sampled_token_ids`` is empty): per request, the tokens
    # this step emitted (accepted drafts, then the one sampled after them), and the drafts its
    # proposer offers for the next step.
    sampled_token_id_lists: list[list[int]] = []
    draft_token_ids: list[list[int]] = []
    # Prompt logprobs computed this step, one part per prefill chunk that asked for them.
    prompt_logprobs: list[PromptLogprobs] = []
    # Speculative decoding under async scheduling: per request, the drafts the worker verified
    # (at most the row's slots in ``scheduled_spec_decode_tokens``).
    num_draft_tokens: list[int] = []


# ---------------------------------------------------------------------------------------------
# start-up handshake and control
# ---------------------------------------------------------------------------------------------


class Hello(msgspec.Struct, **_WIRE):
    """A child's first word: who it is."""

    role: str  # engine | worker | sentinel
    rank: int
    pid: int


class Ready(msgspec.Struct, **_WIRE):
    """Sent once the model is loaded (and, for engines, the KV cache allocated)."""

    role: str
    rank: int
    pid: int
    info: dict[str, int] = {}
    child_pids: list[int] = []  # an engine's: its workers', by rank


class Failure(msgspec.Struct, **_WIRE):
    """A child's report that it could not start or that a call failed."""

    role: str
    rank: int
    message: str
    is_user_error: bool = False  # a ConfigError: the message alone says what to change
    kind: FailureKind = FailureKind.EXCEPTION  # of a failed step


class WorkerCall(msgspec.Struct, **_WIRE):
    """Engine -> workers: a control call every worker answers (``kv_info``, ``init_kv``, ...)."""

    call_id: int
    method: str
    args: list = []


class WorkerReply(msgspec.Struct, **_WIRE):
    call_id: int
    rank: int
    result: object = None
    failure: str | None = None
