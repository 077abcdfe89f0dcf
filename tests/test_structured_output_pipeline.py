"""The order of a grammar step's work under async scheduling (issue #21's GPU target): the
bitmask of step N is filled from the moment step N-1 is folded in, step N+1 reaches the
executor before step N's bitmask, and the runner launches step N+1's forward only after step N
samples (its inputs read step N's tokens). A regression here costs a GPU a whole fill and a
schedule per step while the device waits; on the CPU only the order shows it.
"""

from __future__ import annotations

import time

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
    GrammarBitmask,
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
    def __init__(self, executor: _RecordingExecutor, sched) -> None:
        self.executor, self.sched, self.mask = executor, sched, None
        self.needs_mask = bool(sched.structured_output_request_ids)

    def output(self) -> ModelRunnerOutput:
        """Each grammar row's lowest allowed token, every other row token 0 ("a")."""
        if self.needs_mask and self.mask is None:
            raise AssertionError(f"step {self.sched.step_id}'s tokens asked before its bitmask")
        self.executor.calls.append(("output", self.sched.step_id))
        allowed = {}
        if self.mask is not None:
            words = np.frombuffer(self.mask.bitmask, dtype=np.int32).reshape(
                len(self.mask.request_ids), self.mask.num_words)
            for rid, row in zip(self.mask.request_ids, words):
                bits = np.unpackbits(row.view(np.uint8), bitorder="little")
                allowed[rid] = int(np.flatnonzero(bits)[0])
        ids = list(self.sched.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [allowed.get(rid, 0) for rid in ids],
                                 step_id=self.sched.step_id)


class _RecordingExecutor:
    """Steps that complete at once, with the worker's rules: one step may wait for its
    bitmask and one more may arrive behind it, no more."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.waiting: list[_Step] = []  # launched, not sampled yet (oldest first)

    def kv_cache_bytes_per_block(self) -> int:
        return 1

    def available_kv_cache_bytes(self) -> int:
        return 1 << 16

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model_async(self, sched) -> _Step:
        self.calls.append(("execute", sched.step_id))
        step = _Step(self, sched)
        if self.waiting and len(self.waiting) == 2:
            raise AssertionError(f"step {sched.step_id} arrived behind two unsampled steps")
        if step.needs_mask or self.waiting:
            self.waiting.append(step)
        return step

    def sample_tokens(self, bitmask: GrammarBitmask) -> None:
        self.calls.append(("sample", bitmask.step_id))
        step = self.waiting.pop(0)
        assert step.sched.step_id == bitmask.step_id
        step.mask = bitmask
        if self.waiting and not self.waiting[0].needs_mask:  # held behind it, samples now
            self.waiting.pop(0)

    def reset(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _engine(vocabulary, async_scheduling: bool = True,
            fill_in_background: bool = True) -> tuple[EngineCore, _RecordingExecutor]:
    config = build_engine_config(device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                                 async_scheduling=async_scheduling)
    executor = _RecordingExecutor()
    engine = EngineCore(config, executor, 128, tokenizer=vocabulary)
    engine.structured_output.fill_in_background = fill_in_background
    fill, fold = engine.scheduler.grammar_bitmask, engine.scheduler.update_from_output

    def recorded_fill(sched):
        executor.calls.append(("fill", sched.step_id))
        return fill(sched)

    def recorded_fold(sched, result):
        executor.calls.append(("fold", sched.step_id))
        return fold(sched, result)

    engine.scheduler.grammar_bitmask = recorded_fill
    engine.scheduler.update_from_output = recorded_fold
    return engine, executor


def _run(engine: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    for request in requests:
        # Compiled before the first schedule, so every request runs from step 1 (a schedule
        # while the compile runs is empty, and shifts the steps by a timing).
        engine.structured_output.compile(request.sampling_params.structured_outputs).result()
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests:
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def _requests(max_tokens: int = 5) -> list[EngineCoreRequest]:
    grammar = StructuredOutputsParams(regex="a(ba)*c")
    return [EngineCoreRequest(f"g{i}", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=grammar), eos_token_id=STOP)
        for i in range(2)]


class _SlowBatchMatcher:
    """xgrammar's batch matcher, 20 ms late: a fill that outlasts the engine's schedule."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def batch_fill_next_token_bitmask(self, *args) -> None:
        time.sleep(0.02)
        self.matcher.batch_fill_next_token_bitmask(*args)


@pytest.mark.parametrize("fill", ["background", "slow_background", "inline"])
def test_next_step_is_sent_before_the_bitmask_and_its_fill_starts_at_the_fold(
        toy_vocabulary, fill, monkeypatch):
    if fill == "slow_background":  # the bitmask goes out only once it is filled
        batch_matcher = BitmaskFiller._batch_matcher
        monkeypatch.setattr(BitmaskFiller, "_batch_matcher",
                            lambda self, n: _SlowBatchMatcher(batch_matcher(self, n)))
    engine, executor = _engine(toy_vocabulary, fill_in_background=fill != "inline")
    try:
        tokens = _run(engine, _requests())
    finally:
        engine.shutdown()
    # Greedy under "a(ba)*c" with the lowest allowed token: a b a b a, then max_tokens.
    assert tokens == {"g0": [0, 1, 0, 1, 0], "g1": [0, 1, 0, 1, 0]}
    calls = [c for c in executor.calls if c[0] != "output"]
    assert calls[:10] == [
        ("execute", 1), ("fill", 1),  # nothing before step 1: its fill starts at once
        ("execute", 2), ("sample", 1), ("fold", 1), ("fill", 2),
        ("execute", 3), ("sample", 2), ("fold", 2), ("fill", 3)]
    # Every step N: filled right after step N-1 folds, before step N+1 goes out, and its
    # bitmask sent only after step N+1 went out.
    at = {call: i for i, call in enumerate(calls)}
    last = max(n for kind, n in calls if kind == "execute")
    for n in range(2, last):
        assert at[("fold", n - 1)] < at[("fill", n)] < at[("execute", n + 1)] < at[("sample", n)]


def test_synchronous_engine_sends_each_bitmask_right_after_its_step(toy_vocabulary):
    engine, executor = _engine(toy_vocabulary, async_scheduling=False)
    try:
        tokens = _run(engine, _requests(3))
    finally:
        engine.shutdown()
    assert tokens == {"g0": [0, 1, 0], "g1": [0, 1, 0]}
    assert [c for c in executor.calls if c[0] != "output"] == [
        ("execute", 1), ("fill", 1), ("sample", 1), ("fold", 1),
        ("execute", 2), ("fill", 2), ("sample", 2), ("fold", 2),
        ("execute", 3), ("fill", 3), ("sample", 3), ("fold", 3)]


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
    """An async-scheduling engine whose grammar steps hold the next step (as on a GPU)."""
    with LLM(dtype="float32", max_model_len=256) as llm:
        llm.engine.structured_output.fill_in_background = True  # as on a GPU host's cores
        runner = llm.engine.executor.runner
        runner.graph_runner = runner.build_graph_runner()
        yield llm


def test_runner_launches_a_step_held_behind_a_bitmask_right_after_that_sampling(
        async_llm, chat_ids, mixed_reference, monkeypatch):
    """Through the in-process runner: step N+1 arrives before step N's bitmask and runs no
    forward until step N samples; every row's greedy tokens equal the synchronous engine's."""
    prompts, params = _mixed_batch(chat_ids)
    runner = async_llm.engine.executor.runner
    events: list[tuple[str, int]] = []
    forward, sample, execute = runner.model.forward, runner._sample, runner.execute_model_async
    step_of = {"id": 0}

    def recorded_execute(sched):
        step_of["id"] = sched.step_id
        events.append(("execute", sched.step_id))
        return execute(sched)

    def recorded_forward(*args, **kwargs):
        events.append(("forward", step_of["id"]))
        return forward(*args, **kwargs)

    def recorded_sample(logits, states):
        events.append(("sample", len(states)))
        return sample(logits, states)

    monkeypatch.setattr(runner, "execute_model_async", recorded_execute)
    monkeypatch.setattr(runner.model, "forward", recorded_forward)
    monkeypatch.setattr(runner, "_sample", recorded_sample)
    outs = async_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == mixed_reference
    # Steady decode (every row running, all under grammar but the free one): each step's
    # forward follows the previous step's sampling, and comes after the next execute arrived.
    kinds = [kind for kind, _ in events]
    held = [i for i in range(1, len(events) - 2)
            if events[i][0] == "execute" and kinds[i + 1:i + 3] == ["sample", "forward"]]
    assert len(held) >= 10, events[:40]
    for i in held:
        assert events[i + 2] == ("forward", events[i][1])


class _Interrupt(Exception):
    pass


def test_a_step_interrupted_behind_a_bitmask_leaves_the_llm_usable(
        async_llm, chat_ids, mixed_reference, monkeypatch):
    """A generate stopped between a grammar step's sampling and the launch of the step held
    behind it (where a test's timeout once struck, in that step's forward) raises; the next
    generate on the same LLM gets the reference tokens (it failed: 'step N was asked for its
    tokens before it sampled')."""
    prompts, params = _mixed_batch(chat_ids)
    runner = async_llm.engine.executor.runner
    sample_tokens, launch = runner.sample_tokens, runner._launch
    interrupted: list[int] = []  # the held step whose launch is interrupted

    def sample_then_interrupt(msg):
        if msg.step_id >= 8 and runner._held is not None and not interrupted:
            interrupted.append(runner._held.sched.step_id)
        return sample_tokens(msg)

    def launch_or_interrupt(step):
        if interrupted and step.sched.step_id == interrupted[0]:
            raise _Interrupt
        return launch(step)

    monkeypatch.setattr(runner, "sample_tokens", sample_then_interrupt)
    monkeypatch.setattr(runner, "_launch", launch_or_interrupt)
    with pytest.raises(_Interrupt):
        async_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert interrupted
    outs = async_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == mixed_reference


def test_parallel_fill_equals_each_matchers_own(chat_ids):
    """A fill split over xgrammar's threads, on the fill thread or not, writes exactly what
    each matcher fills alone."""
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
    msgs = []
    for background in (True, False):
        filler = BitmaskFiller(num_threads=2, background=background)
        msgs.append(filler.fill(7, [f"r{i}" for i in range(20)], grammars, words).result())
        filler.shutdown()
    msg = msgs[0]
    assert msgs[1] == msg
    got = np.frombuffer(msg.bitmask, dtype=np.int32).reshape(20, words)
    expected = np.empty_like(got)
    for i, g in enumerate(grammars):
        if g.is_active:
            g.matcher.fill_next_token_bitmask(expected, i)
        else:
            expected[i] = -1
    assert msg.step_id == 7 and msg.num_words == words
    assert np.array_equal(got, expected)
    assert not np.array_equal(got[0], got[2])  # the states differ, so do the rows


def test_a_grammar_is_terminated_exactly_when_its_matcher_is(chat_ids):
    """``RequestGrammar.is_terminated`` (kept by ``accept``) against xgrammar's own answer,
    token by token through a choice that ends, with EOS as its stop token."""
    import xgrammar as xgr

    from bastion.core.config import ModelConfig
    from bastion.core.loader import load_tokenizer, resolve_model
    from bastion.core.structured_output.manager import RequestGrammar

    model = ModelConfig()
    resolved = resolve_model(model)
    tokenizer = load_tokenizer(model, resolved)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                              vocab_size=resolved.hf_config.vocab_size)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar('root ::= "yes" | "no"')
    eos = tokenizer.eos_token_id
    grammar = RequestGrammar(compiled, eos)
    states = []
    for token_id in tokenizer.encode("yes", add_special_tokens=False) + [eos]:
        assert grammar.accept(token_id)
        states.append((grammar.is_terminated, grammar.matcher.is_terminated()))
    assert states[-1] == (True, True)
    assert all(ours == theirs for ours, theirs in states)
    assert not grammar.accept(eos)  # nothing after the end


def test_bitmask_rows_follow_the_logits_order_when_every_row_has_a_grammar():
    logits = torch.randn(3, 64)
    bitmask = torch.tensor([[1, 0], [2, 0], [0, 1 << 4]], dtype=torch.int32)
    msg = GrammarBitmask(1, ["a", "b", "c"], memoryview(bitmask.numpy().reshape(-1).view(
        np.uint8)), 2)
    out = logits.clone()
    apply_grammar_bitmask(out, msg, {"a": 2, "b": 0, "c": 1})
    reference = logits.clone()
    apply_token_bitmask_reference(reference, bitmask, [2, 0, 1])
    assert torch.equal(out, reference)
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in out] == [[1], [36], [0]]
    # Every logits row the message's, in its order: one mask over the whole tensor.
    out = logits.clone()
    apply_grammar_bitmask(out, msg, {"a": 0, "b": 1, "c": 2})
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in out] == [[0], [1], [36]]
