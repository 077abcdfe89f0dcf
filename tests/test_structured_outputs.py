"""Structured outputs in the engine (issue #21), through ``LLM`` and ``EngineCore`` on the
embedded model: every output under a grammar is valid and complete, rows without a grammar keep
exactly their tokens, and the grammar survives preemption, a fault-tolerance resume and
speculative decoding (where grammar rows do not draft)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import msgspec
import numpy as np
import pytest
import torch
from structured_schemas import SCHEMAS

from bastion.core.config import CacheConfig, SchedulerConfig
from bastion.procs.llm import LLM
from bastion.core.request import Request
from bastion.core.scheduler import Scheduler
from bastion.core.structured_output.bitmask import (
    apply_grammar_bitmask,
    apply_token_bitmask_reference,
)
from bastion.core.structured_output.manager import GrammarShipments
from bastion.core.structured_output.spec import GrammarSpecError, check_spec, choice_grammar
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.messages import (
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    StructuredOutputsParams,
)

PROMPT = [{"role": "user", "content": "Answer with a JSON object."}]
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def greedy(max_tokens: int, **spec: object) -> SamplingParams:
    so = StructuredOutputsParams(**spec) if spec else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)


def json_spec(schema: dict) -> dict:
    return {"json": json.dumps(schema)}


@pytest.fixture(scope="module")
def llm():
    with LLM(dtype="float32", max_model_len=512) as engine:
        yield engine


@pytest.fixture(scope="module")
def chat_ids(llm) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        PROMPT, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


@pytest.fixture(scope="module")
def free_reference(llm) -> list[list[int]]:
    """The unconstrained requests' tokens in a batch of their own."""
    outs = llm.generate(FREE_PROMPTS, greedy(24), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_ten_schemas_valid_in_a_batch_mixed_with_unconstrained_rows(llm, chat_ids,
                                                                    free_reference):
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(**json_spec(SCHEMAS[7])))
    prompts = ([{"prompt_token_ids": chat_ids}] * (len(SCHEMAS) + 1)) + FREE_PROMPTS
    params = ([greedy(80, **json_spec(s)) for s in SCHEMAS] + [sampled]
              + [greedy(24)] * len(FREE_PROMPTS))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        assert_valid(choice.text, schema)
    assert len(outs[len(SCHEMAS)].outputs) == 2
    for choice in outs[len(SCHEMAS)].outputs:
        assert choice.finish_reason == "stop", choice.text
        assert_valid(choice.text, SCHEMAS[7])
    free = [o.outputs[0].token_ids for o in outs[len(SCHEMAS) + 1:]]
    assert free == free_reference


def test_regex_choice_ebnf_and_json_object(llm, chat_ids):
    ebnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    specs = [{"regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}, {"choice": ["Paris", "Berlin", "Rome"]},
             {"grammar": ebnf}]
    outs = llm.generate([{"prompt_token_ids": chat_ids}] * len(specs),
                        [greedy(40, **s) for s in specs], use_tqdm=False)
    # Any JSON object: under the whitespace-free JSON grammar this prompt closes its object.
    outs += llm.chat([{"role": "user", "content": 'Return {"a": 1}'}],
                     greedy(40, json_object=True), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", texts[0])
    assert texts[1] in ("Paris", "Berlin", "Rome")
    assert re.fullmatch(r"The answer is [0-9]{2}\.", texts[2])
    assert isinstance(json.loads(texts[3]), dict)


def test_a_spec_that_cannot_compile_fails_only_its_request(llm):
    outs = llm.generate(["Hello", "Hello"], [greedy(8, regex="a(b"), greedy(8)],
                        use_tqdm=False)
    bad, good = outs[0].outputs[0], outs[1].outputs[0]
    assert bad.finish_reason == "rejected" and "parenthesis is not closed" in bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 8


def test_check_spec_names_the_problem_without_a_tokenizer():
    with pytest.raises(GrammarSpecError, match="JSON schema cannot be compiled: Unsupported"):
        check_spec(StructuredOutputsParams(json='{"type": "objekt"}'))
    with pytest.raises(GrammarSpecError, match="not valid JSON"):
        check_spec(StructuredOutputsParams(json='{"type": '))
    with pytest.raises(GrammarSpecError, match='Rule "digit" is not defined'):
        check_spec(StructuredOutputsParams(grammar="root ::= digit"))
    check_spec(StructuredOutputsParams(choice=['say "hi"', "a\\b"]))
    assert choice_grammar(['say "hi"']) == 'root ::= "say \\"hi\\""'


def run_engine(engine, requests: list[EngineCoreRequest]) -> tuple[dict, int]:
    """Every request to completion: per id (tokens, finish reason), and the preemptions."""
    for req in requests:
        engine.add_request(req)
    results = {r.request_id: [[], None] for r in requests}
    num_preemptions = 0
    while engine.has_unfinished_requests:
        step = engine.step()
        num_preemptions += step.stats.num_preemptions
        for out in step.outputs:
            results[out.request_id][0].extend(out.new_token_ids)
            if out.finish_reason is not None:
                results[out.request_id][1] = out.finish_reason
    return results, num_preemptions


def test_preempted_and_resumed_requests_stay_valid(chat_ids):
    """A pool of 8 blocks for four requests of ~60 tokens: the newest are preempted and
    recomputed, their matchers untouched; then a request resumes after 5 streamed tokens (as
    after a fault) and continues exactly where the uninterrupted run went."""
    schemas = [SCHEMAS[i] for i in (1, 2, 6, 9)]
    with LLM(dtype="float32", max_model_len=128, num_gpu_blocks_override=8) as tiny:
        engine, eos = tiny.engine, tiny.eos_token_id
        reqs = [EngineCoreRequest(f"r{i}", chat_ids, greedy(80, **json_spec(s)), eos_token_id=eos)
                for i, s in enumerate(schemas)]
        results, num_preemptions = run_engine(engine, reqs)
        assert num_preemptions > 0
        for (token_ids, reason), schema in zip(results.values(), schemas):
            assert reason == FinishReason.STOP
            assert_valid(tiny.tokenizer.decode(token_ids, skip_special_tokens=True), schema)
        full = results["r3"][0]
        resumed = msgspec.structs.replace(reqs[3], request_id="resumed",
                                          resumed_output_token_ids=full[:5])
        (rest, reason), = run_engine(engine, [resumed])[0].values()
        assert reason == FinishReason.STOP and full[:5] + rest == full


def test_grammar_starts_after_its_token(llm, free_reference):
    """``start_after_token_id``: unconstrained up to that token, then the grammar."""
    marker = free_reference[0][2]
    params = greedy(24, choice=["yes", "no"], start_after_token_id=marker)
    out = llm.generate(FREE_PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:3] == free_reference[0][:3]
    assert out.finish_reason == "stop"
    assert llm.tokenizer.decode(out.token_ids[3:], skip_special_tokens=True) in ("yes", "no")


def test_speculative_decoding_leaves_grammar_rows_undrafted(chat_ids, llm):
    """ngram drafting on: grammar rows decode one token a step, others draft; every row's
    greedy tokens equal the non-speculative engine's."""
    params = [greedy(40, **json_spec(SCHEMAS[7])), greedy(24)]
    prompts = [{"prompt_token_ids": chat_ids}, "1, 2, 3, 4, 5, 6, 1, 2, 3,"]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    with LLM(dtype="float32", max_model_len=256, speculative_config=spec) as spec_llm:
        drafted = []
        propose = spec_llm.engine.scheduler._take_drafts
        spec_llm.engine.scheduler._take_drafts = lambda r, *a: drafted.append(
            r.request_id) or propose(r, *a)
        outs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_valid(outs[0].outputs[0].text, SCHEMAS[7])
    assert drafted and all(rid.startswith("1") for rid in drafted)  # only the free row drafts


def test_a_grammar_no_token_can_spell_is_rejected_where_it_dead_ends(llm):
    """The embedded vocabulary has no token for the control character 0x1d: a regex that needs
    it is the client's input error (REJECTED, a 400 over HTTP), at its first token or after
    the tokens the grammar could take, and the free request beside it is untouched."""
    outs = llm.generate(["Hello"] * 3, [greedy(8, regex="\x1d"), greedy(8, regex="yes\x1d"),
                                        greedy(8)], use_tqdm=False)
    first, later, free = (o.outputs[0] for o in outs)
    assert (first.finish_reason, later.finish_reason) == ("rejected", "rejected")
    assert first.error.endswith("can continue the request's grammar after 0 output tokens")
    assert later.text.startswith("yes") and later.error.endswith("after 1 output tokens")
    assert free.finish_reason == "length" and len(free.token_ids) == 8


# ------------------------------------------------------------------------ units, no model


class _Grammar:
    """A matcher stand-in that accepts only ``allowed`` tokens."""

    is_active = True
    is_terminated = False

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def accept(self, token_id: int) -> bool:
        return token_id in self.allowed

    def allows_no_token(self) -> bool:
        return not self.allowed


class _SlowCompiles:
    """Compiles that finish when the test says so."""

    def __init__(self) -> None:
        self.futures: list[Future] = []
        self.shipments = GrammarShipments(8)

    def compile(self, spec: StructuredOutputsParams) -> Future:
        self.futures.append(Future())
        return self.futures[-1]

    def wait_any(self, futures: list[Future], timeout_s: float) -> None:
        pass

    @staticmethod
    def attach_grammar(request: Request) -> None:
        request.grammar = request.grammar_future.result()


def test_a_compiling_request_waits_in_its_own_state_while_others_step():
    compiles = _SlowCompiles()
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                  CacheConfig(block_size=4), 16, 64, structured_output=compiles)
    spec = StructuredOutputsParams(regex="[0-9]+")
    s.add_request(Request("g", [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=spec),
                          eos_token_id=0))
    s.add_request(Request("free", [4, 5], SamplingParams(max_tokens=4), eos_token_id=0))
    first = s.schedule()
    assert list(first.num_scheduled_tokens) == ["free"]
    assert first.structured_output_request_ids == []
    assert s.make_stats().num_waiting_reqs == 1 and s.has_unfinished_requests
    s.update_from_output(first, ModelRunnerOutput(["free"], [7]))
    compiles.futures[0].set_result(_Grammar({8}))
    second = s.schedule()
    assert list(second.num_scheduled_tokens) == ["free", "g"]
    assert second.structured_output_request_ids == ["g"]
    request = s.requests["g"]
    outs = s.update_from_output(second, ModelRunnerOutput(["free", "g"], [7, 9]))
    # 9 is outside the grammar: the request ends with an error instead of going on unmatched.
    assert outs[1].finish_reason == FinishReason.ERROR and "does not match" in outs[1].error
    assert request.is_finished
    assert "g" not in s.requests


def test_a_failed_compile_is_an_error_output_and_frees_the_request():
    compiles = _SlowCompiles()
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4), 16, 64,
                  structured_output=compiles)
    spec = StructuredOutputsParams(regex="(")
    s.add_request(Request("g", [1, 2], SamplingParams(structured_outputs=spec), eos_token_id=0))
    compiles.futures[0].set_exception(GrammarSpecError("the regex grammar cannot be compiled"))
    out = s.schedule()
    assert not out.num_scheduled_tokens and not s.has_unfinished_requests
    (rejected,) = s.take_rejected()
    assert rejected.finish_reason == FinishReason.REJECTED and "regex" in rejected.error


def test_bitmask_masks_exactly_its_rows_and_bits():
    """The CPU path, as the runner calls it, against the torch reference: each bitmask row
    masks the logits row it is mapped to, other rows untouched."""
    logits = torch.randn(3, 40)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (the sign bit of an int32)
    bitmask[0, 1] = 1 << 5  # token 37
    bitmask[2, 0] = 1 << 0
    out = logits.clone()
    apply_grammar_bitmask(out, bitmask[[0, 2]].numpy(), [2, 0])
    reference = logits.clone()
    apply_token_bitmask_reference(reference, bitmask[[0, 2]], [2, 0])
    assert torch.equal(out, reference)
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [3, 31, 37]
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0]
    assert torch.equal(out[1], logits[1])


def test_shipped_grammars_travel_through_the_codec():
    sched = SchedulerOutput(step_id=5, grammars={"g1": b'{"a": 1}'},
                            grammar_vocabulary=np.arange(6, dtype=np.int32).tobytes(),
                            dropped_grammar_ids=["g0"])
    kind, back = decode(encode(sched))
    assert kind == MsgKind.EXECUTE
    assert (bytes(back.grammars["g1"]), bytes(back.grammar_vocabulary),
            back.dropped_grammar_ids) == (b'{"a": 1}', sched.grammar_vocabulary, ["g0"])
