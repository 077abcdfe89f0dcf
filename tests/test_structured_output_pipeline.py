"""Where a grammar step's work happens (issue #21's GPU target): the engine compiles and sends
each compiled grammar to the workers once; TP rank 0's runner fills a grammar step's bitmask
after it has launched the step's forward (the device computes while the host fills) and
samples under it, with no round trip to the engine. A regression here costs a GPU a fill per
step while the device waits; on the CPU only the order shows it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from bastion.core.config import build_engine_config
from bastion.core.engine_core import EngineCore
from bastion.core.structured_output.bitmask import (
    apply_grammar_bitmask,
    apply_token_bitmask_reference,
)
from bastion.core.structured_output.fill import BitmaskFiller
from bastion.ipc.messages import (
    EngineCoreRequest,
    ModelRunnerOutput,
    SamplingParams,
    StructuredOutputsParams,
)
from bastion.procs.llm import LLM

STOP = 3  # "</s>" in the toy vocabulary: "a", "b", "c", "</s>" (the rest is padding)


@pytest.fixture(scope="module")
def toy_vocabulary():
    import xgrammar as xgr

    from bastion.core.loader import resolve_model

    vocab_size = resolve_model(build_engine_config().model).hf_config.vocab_size
    return xgr.TokenizerInfo(["a", "b", "c", "</s>"], xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[STOP])


class _Step:
    def __init__(self, sched) -> None:
        self.sched = sched

    def output(self) -> ModelRunnerOutput:
        ids = list(self.sched.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [0] * len(ids), step_id=self.sched.step_id)


class _RecordingExecutor:
    """Steps that complete at once (token 0, "a", for every row); keeps what each carried."""

    def __init__(self) -> None:
        self.steps = []

    def kv_cache_bytes_per_block(self) -> int:
        return 1

    def available_kv_cache_bytes(self) -> int:
        return 1 << 16

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model_async(self, sched) -> _Step:
        self.steps.append(sched)
        return _Step(sched)

    def reset(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _request(request_id: str, regex: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex=regex)),
        eos_token_id=STOP)


def _run(engine: EngineCore, requests: list[EngineCoreRequest]) -> None:
    for request in requests:
        # Compiled first, so that each request is scheduled at its first step.
        engine.structured_output.compile(request.sampling_params.structured_outputs).result()
        engine.add_request(request)
    while engine.has_unfinished_requests:
        engine.step()


def test_each_grammar_reaches_the_workers_once_until_they_may_be_new(toy_vocabulary):
    """The first step that brings the workers a request under a grammar carries the compiled
    grammar (and, before the first, the vocabulary); later requests under it carry its id
    only; past the record's size the oldest is dropped; after a fault recovery (the workers
    may be new processes) everything is sent again."""
    import xgrammar as xgr

    config = build_engine_config(device="cpu", max_num_seqs=4, max_num_batched_tokens=64)
    executor = _RecordingExecutor()
    engine = EngineCore(config, executor, 128, tokenizer=toy_vocabulary)
    shipments = engine.structured_output.shipments
    shipments.max_held = 2
    try:
        _run(engine, [_request("r1", "a+"), _request("r2", "a+")])
        _run(engine, [_request("r3", "a+")])
        _run(engine, [_request("r4", "(ab)+"), _request("r5", "c|a+")])
        engine.drop_all_requests()
        _run(engine, [_request("r6", "a+")])
    finally:
        engine.shutdown()
    shipped = [(s.step_id, [(n.request_id, n.grammar_id) for n in s.new_requests],
                sorted(s.grammars), s.grammar_vocabulary is not None, s.dropped_grammar_ids)
               for s in executor.steps if s.new_requests or s.grammars or s.dropped_grammar_ids]
    ids = {rid: gid for _, news, *_ in shipped for rid, gid in news}
    a, ab, c = ids["r1"], ids["r4"], ids["r5"]
    assert len({a, ab, c}) == 3 and ids["r2"] == ids["r3"] == ids["r6"] == a
    assert [(news, grammars, vocab, dropped) for _, news, grammars, vocab, dropped in shipped] == [
        ([("r1", a), ("r2", a)], [a], True, []),
        ([("r3", a)], [], False, []),
        ([("r4", ab), ("r5", c)], sorted([ab, c]), False, [a]),
        ([("r6", a)], [a], True, []),  # after recovery: the vocabulary and grammar again
    ]
    first = next(s for s in executor.steps if s.grammars)
    # What a worker builds from them: the vocabulary and a grammar that matches like ours.
    vocabulary = xgr.TokenizerInfo.deserialize_json(bytes(first.grammar_vocabulary).decode())
    compiled = xgr.CompiledGrammar.deserialize_json(bytes(first.grammars[a]).decode(),
                                                    vocabulary)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_token(0) and not matcher.accept_token(1)


# --------------------------------------------------------------- the runner, on the model


@pytest.fixture(scope="module")
def chat_ids() -> list[int]:
    from bastion.core.config import ModelConfig
    from bastion.core.loader import load_tokenizer, resolve_model

    model = ModelConfig()
    tokenizer = load_tokenizer(model, resolve_model(model))
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a user as JSON."}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False)


def _mixed_batch(chat_ids: list[int]) -> tuple[list[dict], list[SamplingParams]]:
    schema = ('{"type": "object", "properties": {"name": {"type": "string"}, "age": '
              '{"type": "integer"}}, "required": ["name", "age"]}')
    json_rows = SamplingParams(temperature=0.0, max_tokens=24,
                               structured_outputs=StructuredOutputsParams(json=schema))
    # A penalty reads every token so far, the one of a step still waiting for its bitmask too.
    penalised = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3,
                               structured_outputs=StructuredOutputsParams(json=schema))
    free = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = [{"prompt_token_ids": chat_ids}] * 3 + ["The capital of France is"]
    return prompts, [json_rows, penalised, json_rows, free]


@pytest.fixture(scope="module")
def mixed_reference(chat_ids) -> list[list[int]]:
    """The mixed batch's greedy tokens from the synchronous engine."""
    prompts, params = _mixed_batch(chat_ids)
    with LLM(dtype="float32", max_model_len=256, async_scheduling=False) as sync:
        # Decode steps through the graph runner's staging (run eagerly on the CPU), as on a
        # GPU: the held step's inputs are prepared before the tokens they read exist.
        sync_runner = sync.engine.executor.runner
        sync_runner.graph_runner = sync_runner.build_graph_runner()
        return [o.outputs[0].token_ids for o in sync.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def async_llm():
    """An async-scheduling engine whose decode steps replay the graph runner's path."""
    with LLM(dtype="float32", max_model_len=256) as llm:
        runner = llm.engine.executor.runner
        runner.graph_runner = runner.build_graph_runner()
        yield llm


def test_runner_fills_a_grammar_steps_bitmask_after_launching_its_forward(
        async_llm, chat_ids, mixed_reference, monkeypatch):
    """Through the in-process runner: each grammar step's bitmask is filled after that step's
    forward was launched and before it samples, from matchers that have taken every token but
    the one it samples; every row's greedy tokens equal the synchronous engine's."""
    prompts, params = _mixed_batch(chat_ids)
    runner = async_llm.engine.executor.runner
    events: list[tuple] = []
    forward, sample, mask = runner.model.forward, runner._sample, runner.grammars.mask
    execute = runner.execute_model_async
    step_of = {"id": 0}

    def recorded_execute(sched):
        step_of["id"] = sched.step_id
        return execute(sched)

    def recorded_forward(*args, **kwargs):
        events.append(("forward", step_of["id"]))
        return forward(*args, **kwargs)

    def recorded_mask(logits, rows):
        lengths = sorted(g.num_accepted for _, g in rows)
        events.append(("fill", step_of["id"], lengths))
        return mask(logits, rows)

    def recorded_sample(logits, states, mask=None):
        events.append(("sample", step_of["id"]))
        return sample(logits, states, mask)

    monkeypatch.setattr(runner, "execute_model_async", recorded_execute)
    monkeypatch.setattr(runner.model, "forward", recorded_forward)
    monkeypatch.setattr(runner.grammars, "mask", recorded_mask)
    monkeypatch.setattr(runner, "_sample", recorded_sample)
    outs = async_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == mixed_reference
    fills = [i for i, e in enumerate(events) if e[0] == "fill"]
    assert len(fills) >= 10, events[:40]
    for i in fills:
        step = events[i][1]
        assert events[i - 1] == ("forward", step) and events[i + 1] == ("sample", step)
    # The three grammar rows decode side by side: at each fill after the first their matchers
    # hold one token more than at the one before (none is left behind by a step in flight).
    lengths = [events[i][2] for i in fills]
    steady = [ls for ls in lengths if len(ls) == 3]
    assert steady[0] == [0, 0, 0]
    assert all(b == [n + 1 for n in a] for a, b in itertools.pairwise(steady) if b[0] > 0)


class _Interrupt(Exception):
    pass


def test_a_step_interrupted_in_its_fill_leaves_the_llm_usable(
        async_llm, chat_ids, mixed_reference, monkeypatch):
    """A generate stopped inside a grammar step's fill (after its forward, before it samples)
    raises; the next generate on the same LLM gets the reference tokens."""
    prompts, params = _mixed_batch(chat_ids)
    runner = async_llm.engine.executor.runner
    mask, calls = runner.grammars.mask, []

    def mask_or_interrupt(logits, rows):
        calls.append(1)
        if len(calls) == 8:
            raise _Interrupt
        return mask(logits, rows)

    monkeypatch.setattr(runner.grammars, "mask", mask_or_interrupt)
    with pytest.raises(_Interrupt):
        async_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    outs = async_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == mixed_reference


def test_parallel_fill_equals_each_matchers_own(chat_ids):
    """A fill split over the filler's shares (its own threads) writes exactly what each
    matcher fills alone, and learns the cost of a row from it."""
    import xgrammar as xgr

    from bastion.core.config import ModelConfig
    from bastion.core.loader import load_tokenizer, resolve_model
    from bastion.core.structured_output.manager import RequestGrammar

    model = ModelConfig()
    resolved = resolve_model(model)
    vocab_size = resolved.hf_config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(model, resolved),
                                              vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_builtin_json_grammar()
    grammars = [RequestGrammar(compiled, None) for _ in range(20)]
    for i, g in enumerate(grammars):  # rows in different states, 0 to 3 characters in
        assert g.matcher.accept_string('{"a'[:i % 4])
    grammars[3].is_active = False  # a reasoning row before its start token: everything
    words = xgr.get_bitmask_shape(1, vocab_size)[1]
    got = np.zeros((20, words), dtype=np.int32)
    filler = BitmaskFiller(num_threads=2)
    filler.row_us = 1000.0  # as if rows had been slow: the 20 rows are split in two
    filler.fill(grammars, got)
    assert filler.last_shares == 2 and filler.row_us > 0
    filler.close()
    expected = np.empty_like(got)
    for i, g in enumerate(grammars):
        if g.is_active:
            g.matcher.fill_next_token_bitmask(expected, i)
        else:
            expected[i] = -1
    assert np.array_equal(got, expected)
    assert not np.array_equal(got[0], got[2])  # the states differ, so do the rows


def test_fill_shares_follow_the_expected_cost():
    """A fill is split only when it has 8 rows or more and is expected to take 0.2 ms or more
    on one thread, into shares of at least 0.1 ms, at most one per thread and per two rows;
    a filler of one thread never splits."""
    filler = BitmaskFiller(num_threads=4)
    filler.row_us = 5.0  # cheap rows (greedy JSON): 32 rows are 0.16 ms, one thread
    assert filler.shares(32) == 1
    filler.row_us = 50.0  # rows at a temperature
    assert [filler.shares(n) for n in (4, 7, 8, 32, 64)] == [1, 1, 4, 4, 4]
    filler.row_us = 26.0  # 8 rows: 0.208 ms, two shares of 0.1 ms
    assert filler.shares(8) == 2
    single = BitmaskFiller(num_threads=1)
    single.row_us = 1000.0
    assert single.shares(64) == 1


def test_fill_threads_default_two_from_four_cores(monkeypatch: pytest.MonkeyPatch):
    """Two shares by default (the H200 host's measurement), one on fewer than four cores;
    ``BASTION_GRAMMAR_FILL_THREADS`` overrides."""
    from bastion.core.structured_output import fill

    for cores, threads in ((16, 2), (4, 2), (3, 1), (2, 1)):
        monkeypatch.setattr(fill.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert BitmaskFiller().num_threads == threads
    monkeypatch.setenv("BASTION_GRAMMAR_FILL_THREADS", "4")
    assert BitmaskFiller().num_threads == 4


@pytest.fixture(scope="module")
def yes_or_no():
    """The embedded model's tokenizer and a grammar compiled for it that takes "yes" or "no"."""
    import xgrammar as xgr

    from bastion.core.config import ModelConfig
    from bastion.core.loader import load_tokenizer, resolve_model

    model = ModelConfig()
    resolved = resolve_model(model)
    tokenizer = load_tokenizer(model, resolved)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                              vocab_size=resolved.hf_config.vocab_size)
    return tokenizer, xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        'root ::= "yes" | "no"')


def test_a_grammar_is_terminated_exactly_when_its_matcher_is(yes_or_no):
    """``RequestGrammar.is_terminated`` (kept by ``accept``) against xgrammar's own answer,
    token by token through a choice that ends, with EOS as its stop token."""
    from bastion.core.structured_output.manager import RequestGrammar

    tokenizer, compiled = yes_or_no
    eos = tokenizer.eos_token_id
    grammar = RequestGrammar(compiled, eos)
    states = []
    for token_id in tokenizer.encode("yes", add_special_tokens=False) + [eos]:
        assert grammar.accept(token_id)
        states.append((grammar.is_terminated, grammar.matcher.is_terminated()))
    assert states[-1] == (True, True)
    assert all(ours == theirs for ours, theirs in states)
    assert not grammar.accept(eos)  # nothing after the end


def test_accepting_each_rows_token_in_one_call_equals_one_call_per_row(yes_or_no):
    """``RequestGrammar.accept_each`` (the worker's catch-up of rows one token behind, in one
    xgrammar call) against ``accept`` per grammar, step by step: the same answers, counts and
    termination, with a grammar that waits for its start token, one that refuses a token and
    one that ends."""
    from bastion.core.structured_output.manager import RequestGrammar

    tokenizer, compiled = yes_or_no
    eos = tokenizer.eos_token_id
    start = tokenizer.encode(":", add_special_tokens=False)[0]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    streams = [encode("yes") + [eos],  # ends
               encode("no") + [eos],
               encode("maybe") + [eos],  # refused at once
               encode("x") + [start] + encode("no")]  # waits for its start token
    length = max(map(len, streams))
    streams = [t + [eos] * (length - len(t)) for t in streams]

    def grammars() -> list[RequestGrammar]:
        return [RequestGrammar(compiled, eos, start if i == 3 else None) for i in range(4)]

    one, each = grammars(), grammars()
    for step in range(length):
        live = [i for i in range(4) if not one[i].is_terminated]
        expected = [one[i].accept(streams[i][step]) for i in live]
        got = RequestGrammar.accept_each([each[i] for i in live],
                                         [streams[i][step] for i in live])
        assert got == expected, step
        assert [(g.num_accepted, g.is_terminated, g.is_active) for g in each] == \
            [(g.num_accepted, g.is_terminated, g.is_active) for g in one]
    assert [g.is_terminated for g in each] == [True, True, False, False]
    assert each[2].num_accepted == 0 and each[3].is_active


def test_bitmask_rows_follow_the_logits_order_when_every_row_has_a_grammar():
    logits = torch.randn(3, 64)
    bitmask = torch.tensor([[1, 0], [2, 0], [0, 1 << 4]], dtype=torch.int32)
    out = logits.clone()
    apply_grammar_bitmask(out, bitmask.numpy(), [2, 0, 1])
    reference = logits.clone()
    apply_token_bitmask_reference(reference, bitmask, [2, 0, 1])
    assert torch.equal(out, reference)
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in out] == [[1], [36], [0]]
    # Every logits row masked, in order: one mask over the whole tensor.
    out = logits.clone()
    apply_grammar_bitmask(out, bitmask.numpy(), [0, 1, 2])
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in out] == [[0], [1], [36]]
