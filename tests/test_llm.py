"""The offline API end to end on the embedded model: parity with Hugging Face transformers,
and outputs unchanged by batching, prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import EMBEDDED_RAW_PROMPTS as RAW_PROMPTS
from conftest import hf_generate

from bastion import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(embedded_llm: LLM) -> LLM:
    return embedded_llm


@pytest.fixture(scope="module")
def prompt_ids(embedded_prompt_ids: list[list[int]]) -> list[list[int]]:
    return embedded_prompt_ids


@pytest.fixture(scope="module")
def hf_greedy(embedded_hf_greedy: list[list[int]]) -> list[list[int]]:
    return embedded_hf_greedy


def greedy_ids(llm: LLM, prompt_ids: list[list[int]],
               params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_parity_with_transformers_as_one_mixed_batch(llm, prompt_ids, hf_greedy):
    assert len(prompt_ids) == 8
    assert greedy_ids(llm, prompt_ids) == hf_greedy


def _count_c_kernel_calls(monkeypatch) -> dict[str, int]:
    """Calls of each CPU C kernel (ops/cpu) from now to the test's end: the ctypes function
    itself, so a fallback to the torch reference counts nothing."""
    from bastion.ops.cpu import activation, argmax, paged_attention, rms_norm, rotary

    counts = {}
    for module in (paged_attention, rotary, argmax, rms_norm, activation):
        name = module.__name__.rsplit(".", 1)[-1]
        counts[name] = 0

        def counting(real=module._kernel, name=name):
            kernel = real()
            if kernel is None:
                return None
            return lambda *args: counts.__setitem__(name, counts[name] + 1) or kernel(*args)

        monkeypatch.setattr(module, "_kernel", counting)
    return counts


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the CPU path has only its torch references")
def test_greedy_parity_through_the_cpu_c_kernels(llm, prompt_ids, hf_greedy, monkeypatch):
    """The default CPU path: decode attention, rotary + KV store, RMSNorm, SiLU-and-mul and
    greedy argmax in C."""
    monkeypatch.delenv("BASTION_CPU_KERNELS", raising=False)
    calls = _count_c_kernel_calls(monkeypatch)
    assert greedy_ids(llm, prompt_ids) == hf_greedy
    # 30 layers: attention and rotary once a layer a step, argmax once a step.
    assert calls["argmax"] >= 31 and calls["rotary"] >= 30 * 32, calls
    assert calls["paged_attention"] >= 30 * 31, calls
    # Two norms a layer and the final one; one activation a layer.
    assert calls["rms_norm"] >= 61 * 32 and calls["activation"] >= 30 * 32, calls


def test_greedy_parity_through_the_torch_references(llm, prompt_ids, hf_greedy, monkeypatch):
    """BASTION_CPU_KERNELS=0 (a machine without a compiler takes the same path)."""
    monkeypatch.setenv("BASTION_CPU_KERNELS", "0")
    calls = _count_c_kernel_calls(monkeypatch)
    assert greedy_ids(llm, prompt_ids) == hf_greedy
    assert calls == {"paged_attention": 0, "rotary": 0, "argmax": 0, "rms_norm": 0,
                     "activation": 0}


def test_batching_does_not_change_outputs(llm, prompt_ids, hf_greedy):
    alone = [greedy_ids(llm, [ids])[0] for ids in prompt_ids[:3]]
    assert alone == hf_greedy[:3]


def test_prefix_cache_hit_is_reported_and_changes_nothing(llm, prompt_ids, hf_greedy):
    first = llm.generate({"prompt_token_ids": prompt_ids[6]}, GREEDY)[0]
    again = llm.generate({"prompt_token_ids": prompt_ids[6]}, GREEDY)[0]
    block = llm.config.cache.block_size
    expected_cached = (len(prompt_ids[6]) - 1) // block * block
    assert expected_cached > 0
    assert again.num_cached_tokens == expected_cached
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy[6]


def test_chunked_prefill_with_tiny_budget(prompt_ids, hf_greedy):
    small = LLM(dtype="float32", max_model_len=128, max_num_batched_tokens=8, max_num_seqs=4)
    assert greedy_ids(small, prompt_ids) == hf_greedy


def test_preemption_by_tiny_kv_pool(prompt_ids, hf_greedy):
    # 8 blocks of 16 tokens: each request needs 3-5 blocks, so they preempt one another.
    tiny = LLM(dtype="float32", max_model_len=128, num_gpu_blocks_override=8)
    assert greedy_ids(tiny, prompt_ids) == hf_greedy
    assert tiny.engine.scheduler.kv.num_free_blocks == 8


def test_synchronous_scheduling_gives_the_same_tokens(prompt_ids, hf_greedy):
    sync = LLM(dtype="float32", max_model_len=128, async_scheduling=False)
    assert not sync.engine.async_scheduling
    assert greedy_ids(sync, prompt_ids) == hf_greedy


def test_async_decode_through_the_graph_runner(prompt_ids, hf_greedy):
    """The CUDA-graph decode path run eagerly on the CPU: padded buckets, alternating host
    staging buffers, and each step's input token read from the previous step's tokens."""
    eager = LLM(dtype="float32", max_model_len=128)
    runner = eager.engine.executor.runner
    runner.graph_runner = runner.build_graph_runner()
    calls = []
    run = runner.graph_runner.run

    def counting_run(inputs, *args, **kwargs):
        calls.append(int((inputs.pending_rows >= 0).sum()))
        return run(inputs, *args, **kwargs)

    runner.graph_runner.run = counting_run
    assert greedy_ids(eager, prompt_ids) == hf_greedy
    # Every decode step after the first takes all 8 of its input tokens from the device.
    assert len(calls) >= 30 and max(calls) == 8


def test_penalties_see_the_token_still_in_flight(llm, prompt_ids, hf_gguf_model, hf_greedy):
    """A repetition penalty reads every token so far: an async step must not sample without
    the one the previous step produced (the runner waits for it). Reference: transformers'
    repetition penalty, which has the same definition (prompt + output, divide positive
    logits, multiply negative ones)."""
    penalised = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                               repetition_penalty=1.5)
    params = [penalised if i % 2 else GREEDY for i in range(len(prompt_ids))]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    want = hf_generate(hf_gguf_model, prompt_ids[1::2], 24, repetition_penalty=1.5)
    assert got[1::2] == want
    assert [g[:24] for g in hf_greedy[1::2]] != want  # the penalty bites


def test_seeded_sampling_is_reproducible_and_n_choices_differ(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, n=3)
    a = llm.generate("Tell me a story about a robot", params)[0]
    b = llm.generate(["Another prompt", "Tell me a story about a robot"], params)[1]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3


def test_stop_string_max_tokens_and_text(llm):
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0.0, max_tokens=40,
                                                        stop=[" 9"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 9"
    assert out.text.endswith("8,") and " 9" not in out.text
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5,
                                              ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_logprobs_are_returned_for_the_sampled_token(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=4,
                                                    logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry[token_id].rank == 1  # greedy: the chosen token is the most likely
        assert len(entry) == 3


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced float32 log-softmax at every prompt position: row p scores token p+1."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)


def assert_prompt_logprobs(entries, ids: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        token, ref = ids[p + 1], reference[p]
        top = ref.topk(k)
        assert set(entry) == {token, *top.indices.tolist()}, p
        assert entry[token].logprob == pytest.approx(ref[token].item(), abs=1e-4)
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        for rank, (tok, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[tok].logprob == pytest.approx(value, abs=1e-4)
            if tok != token:
                assert entry[tok].rank == rank


def test_prompt_logprobs_match_teacher_forced_transformers(prompt_ids, hf_gguf_model):
    # A 16-token budget: the long prompt's logprobs come from several prefill chunks.
    chunked = LLM(dtype="float32", max_model_len=128, max_num_batched_tokens=16)
    long_ids = prompt_ids[5] + prompt_ids[0]
    assert len(long_ids) > 2 * 16
    reference = hf_prompt_logprobs(hf_gguf_model, long_ids)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    first, short = chunked.generate(
        [{"prompt_token_ids": ids} for ids in (long_ids, prompt_ids[0])], [params, plain])
    assert short.prompt_logprobs is None
    assert_prompt_logprobs(first.prompt_logprobs, long_ids, reference, 2)
    # Its blocks are cached now: a request with prompt_logprobs skips the cache (a hit would
    # skip the positions that need logits), one without still hits it.
    again, cached = chunked.generate([{"prompt_token_ids": long_ids}] * 2, [params, plain])
    assert (again.num_cached_tokens, cached.prompt_logprobs) == (0, None)
    assert cached.num_cached_tokens > 0
    assert_prompt_logprobs(again.prompt_logprobs, long_ids, reference, 2)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == cached.outputs[0].token_ids


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert "<|im_start|>assistant" in out.prompt
    assert out.outputs[0].text


def test_all_blocks_return_after_requests_finish(llm):
    llm.generate(RAW_PROMPTS, SamplingParams(temperature=0.8, max_tokens=8, seed=3))
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_max_model_len_that_cannot_fit_fails_at_start_up():
    from bastion.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"max_model_len 2048 needs .* the largest "
                                          r"max_model_len that fits is 256"):
        LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=46080 * 16 * 16)


def test_use_tqdm_shows_a_bar_of_finished_prompts(llm, capsys):
    llm.generate(RAW_PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=2, n=2))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    llm.generate(RAW_PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_generate_without_params_uses_the_generation_config(llm, monkeypatch):
    assert llm.generation_defaults == {}  # the embedded GGUF has no generation_config.json
    monkeypatch.setattr(llm, "generation_defaults", {"temperature": 0.0, "max_tokens": 3})
    out = llm.generate(RAW_PROMPTS[0], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
    greedy = llm.generate(RAW_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids
