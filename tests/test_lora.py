"""Multi-LoRA offline on the CPU: greedy parity with transformers + PEFT (float32), batches
mixing the base model and adapters, the scheduler's adapter limit and deferred unload, the
prefix cache kept apart per adapter, clear errors for adapters that cannot run, and TP=3.
The embedded model's parity (all seven modules, rank 16) runs through the server in
tests/test_lora_serve.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bastion import LLM, LoRARequest, SamplingParams
from bastion.core.config import CacheConfig, ConfigError, SchedulerConfig
from bastion.core.kv_cache_manager import KVCacheManager
from bastion.core.lora.peft import LoRAError, load_peft_adapter
from bastion.core.request import Request
from bastion.core.scheduler import Scheduler
from bastion.ipc.messages import ModelRunnerOutput
from tests.conftest import build_tiny_hf_model, tiny_config
from tests.lora_fixtures import ALL_MODULES, add_random_adapter, greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11], [1, 2, 3], [300, 200, 100, 50, 25, 12, 6]]
TINY = {
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "block_size": 4,
    "kv_cache_memory_bytes": 16 << 20,
}


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> dict:
    """A tiny random Qwen3, two random adapters (rank 8 on q/v/down; rank 16 on all seven
    modules with rsLoRA) and transformers + PEFT's greedy tokens for each."""
    root = tmp_path_factory.mktemp("lora-qwen3")
    hf = build_tiny_hf_model("qwen3")
    hf.save_pretrained(root / "base")
    peft, a1 = add_random_adapter(
        hf, "a1", str(root), 8, 16, ["q_proj", "v_proj", "down_proj"], seed=1
    )
    peft, a2 = add_random_adapter(
        peft, "a2", str(root), 16, 8, ALL_MODULES, seed=2, use_rslora=True
    )
    expected = {}
    for name in ("a1", "a2"):
        peft.set_adapter(name)
        expected[name] = [greedy(peft, p, GREEDY.max_tokens) for p in PROMPTS]
    with peft.disable_adapter():
        expected[None] = [greedy(peft, p, GREEDY.max_tokens) for p in PROMPTS]
    # Each adapter really changes the output, so parity below says something.
    assert expected["a1"] != expected[None] and expected["a2"] != expected[None]
    return {
        "base": str(root / "base"),
        "expected": expected,
        "loras": {"a1": LoRARequest("a1", 1, a1), "a2": LoRARequest("a2", 2, a2), None: None},
    }


def test_tiny_qwen3_peft_parity_alone_and_in_one_mixed_batch(tiny_qwen3) -> None:
    expected, loras = tiny_qwen3["expected"], tiny_qwen3["loras"]
    with LLM(tiny_qwen3["base"], enable_lora=True, max_loras=2, **TINY) as llm:
        for name, lora in loras.items():
            assert (
                tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
                == expected[name]
            ), name
        # One step admits all three: adapter 1, the base model and adapter 2 side by side.
        mixed = llm.generate(
            PROMPTS, GREEDY, lora_request=[loras["a1"], None, loras["a2"]], use_tqdm=False
        )
        assert tokens(mixed) == [expected["a1"][0], expected[None][1], expected["a2"][2]]


def test_base_only_decode_steps_replay_the_graphs_without_lora(tiny_qwen3) -> None:
    """With LoRA enabled, decode steps where no row has an adapter go through the graphs
    captured without the adapter kernels, steps with one through those with them. Here both
    graph runners run their padded batches eagerly on the CPU (as in test_llm); exact tokens."""
    expected, loras = tiny_qwen3["expected"], tiny_qwen3["loras"]
    with LLM(tiny_qwen3["base"], enable_lora=True, max_loras=2, **TINY) as llm:
        runner = llm.engine.executor.runner
        runner.graph_runner = runner.build_graph_runner()
        runner.base_graph_runner = runner.build_graph_runner(with_lora=False)
        calls: dict[str, list[bool]] = {"graph_runner": [], "base_graph_runner": []}
        for name, seen in calls.items():
            graph_runner = getattr(runner, name)
            run = graph_runner.run

            def counting_run(inputs, *args, _run=run, _calls=seen, **kwargs):
                _calls.append(runner.lora_manager.state.is_active)
                return _run(inputs, *args, **kwargs)

            graph_runner.run = counting_run
        base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert tokens(base) == expected[None]
        assert calls["base_graph_runner"] and not calls["graph_runner"]
        assert not any(calls["base_graph_runner"])
        calls["base_graph_runner"].clear()
        mixed = llm.generate(
            PROMPTS, GREEDY, lora_request=[loras["a1"], None, loras["a2"]], use_tqdm=False
        )
        assert tokens(mixed) == [expected["a1"][0], expected[None][1], expected["a2"][2]]
        assert calls["graph_runner"] and all(calls["graph_runner"])
        assert not calls["base_graph_runner"]  # every step had an adapter row


def test_lru_slots_serve_more_adapters_than_slots(tiny_qwen3) -> None:
    """One device slot and one host entry: every switch evicts and reloads, still exact."""
    expected, loras = tiny_qwen3["expected"], tiny_qwen3["loras"]
    with LLM(tiny_qwen3["base"], enable_lora=True, max_loras=1, max_cpu_loras=1, **TINY) as llm:
        got = llm.generate(
            PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=[loras["a1"], loras["a2"], None] * 2
        )
        manager = llm.engine.executor.runner.lora_manager
        assert len(manager.host) == 1 and manager.slot_ids in ([1], [2])
    want = [expected["a1"][0], expected["a2"][1], expected[None][2]]
    assert tokens(got) == want * 2


def test_prefix_cache_keeps_adapters_apart(tiny_qwen3) -> None:
    loras = tiny_qwen3["loras"]
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks of 4 can be served from the cache
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(tiny_qwen3["base"], enable_lora=True, max_loras=2, **TINY) as llm:
        cached = [
            llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0].num_cached_tokens
            for lora in (loras["a1"], None, loras["a2"], loras["a1"], None)
        ]
    assert cached == [0, 0, 0, 12, 12]


def test_block_hash_includes_the_adapter() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens_ = list(range(9))
    first = Request("a", tokens_, GREEDY, lora_request=LoRARequest("x", 1, "/x"))
    assert kv.allocate_slots(first, 9, kv.get_computed_blocks(first)) == [0, 1, 2]
    kv.free(first)
    other = Request("b", tokens_, GREEDY, lora_request=LoRARequest("y", 2, "/y"))
    base = Request("c", tokens_, GREEDY)
    assert kv.get_computed_blocks(other).num_tokens == 0
    assert kv.get_computed_blocks(base).num_tokens == 0
    again = Request("d", tokens_, GREEDY, lora_request=LoRARequest("x", 1, "/x"))
    hit = kv.get_computed_blocks(again)
    assert [b.block_id for b in hit.blocks] == [0, 1]


def _scheduler(max_loras: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        CacheConfig(block_size=4),
        32,
        64,
        max_loras=max_loras,
    )


def _request(request_id: str, lora_id: int | None, max_tokens: int = 4) -> Request:
    lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, f"/l{lora_id}")
    return Request(
        request_id,
        [1, 2, 3],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        lora_request=lora,
    )


def _finish_step(s: Scheduler, out) -> list:
    sampled = list(out.num_scheduled_tokens)
    return s.update_from_output(out, ModelRunnerOutput(sampled, [7] * len(sampled), []))


def test_scheduler_mixes_at_most_max_loras_adapters() -> None:
    s = _scheduler(max_loras=2)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3), ("d", None), ("e", 1)]:
        s.add_request(_request(rid, lora, max_tokens=1))
    out = s.schedule()
    # Adapter 3 waits (two adapters already in the batch); the base model and adapter 1 do not.
    assert list(out.num_scheduled_tokens) == ["a", "b", "d", "e"]
    assert [r.request_id for r in s.waiting] == ["c"]
    stats = s.make_stats()  # what /metrics' lora_requests_info shows
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (["l1", "l2"], ["l3"])
    _finish_step(s, out)
    assert list(s.schedule().num_scheduled_tokens) == ["c"]


def test_unloading_waits_for_the_adapters_requests() -> None:
    s = _scheduler(max_loras=2)
    s.add_request(_request("a", 1, max_tokens=2))
    out = s.schedule()
    s.remove_lora(1)
    _finish_step(s, out)
    out = s.schedule()  # "a" still decoding: its adapter stays on the workers
    assert out.removed_lora_ids == [] and list(out.num_scheduled_tokens) == ["a"]
    assert _finish_step(s, out)[-1].finish_reason is not None
    assert s.schedule().removed_lora_ids == [1]
    assert s.schedule().removed_lora_ids == []


def test_request_with_adapter_needs_lora_enabled() -> None:
    s = _scheduler(max_loras=0)
    s.add_request(_request("a", 1))
    (rejected,) = s.take_rejected()
    assert "LoRA is not enabled (--enable-lora)" in rejected.error


# ----------------------------------------------------------------------------- bad adapters


@pytest.fixture(scope="module")
def bad_adapters(tmp_path_factory, tiny_qwen3) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-bad")
    llama = build_tiny_hf_model("llama")  # head_dim 16: q_proj is [64, 64], not Qwen3's [128, 64]
    _, wrong_base = add_random_adapter(llama, "llama", str(root), 8, 8, ["q_proj"], seed=4)
    _, rank32 = add_random_adapter(
        build_tiny_hf_model("qwen3"), "r32", str(root), 32, 8, ["q_proj"], seed=5
    )
    paths = {"wrong_base": wrong_base, "rank32": rank32}
    for name, change in [
        ("dora", {"use_dora": True}),
        ("head", {"target_modules": ["lm_head"]}),
        ("bias", {"bias": "lora_only"}),
    ]:
        folder = root / name
        folder.mkdir()
        src = Path(tiny_qwen3["loras"]["a1"].lora_path)
        config = json.loads((src / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
        shutil.copy(src / "adapter_model.safetensors", folder)
        paths[name] = str(folder)
    return paths


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "wrong_base",
            (
                r"does not fit this base model: layer 0 q_proj has lora_A \(8, 64\) and "
                r"lora_B \(64, 8\), the model needs \(8, 64\) and \(128, 8\)"
            ),
        ),
        ("rank32", r"has rank 32, above --max-lora-rank 16; restart with --max-lora-rank 32"),
        ("dora", r"use_dora=True is not supported"),
        ("head", r"target module\(s\) lm_head not supported; LoRA applies to q_proj, k_proj"),
        ("bias", r"bias='lora_only' is not supported"),
    ],
)
def test_adapters_that_cannot_run_are_named(bad_adapters, name: str, message: str) -> None:
    with pytest.raises(LoRAError, match=message):
        load_peft_adapter(bad_adapters[name], tiny_config("qwen3", head_dim=32), max_rank=16)


def test_missing_adapter_and_disabled_lora_are_clear(tiny_qwen3, tmp_path) -> None:
    with pytest.raises(LoRAError, match="adapter_config.json is missing"):
        load_peft_adapter(str(tmp_path), tiny_config("qwen3", head_dim=32), max_rank=16)
    with pytest.raises(ConfigError, match="max_lora_rank must be one of"):
        LLM(tiny_qwen3["base"], enable_lora=True, max_lora_rank=12, **TINY)
    with (
        LLM(tiny_qwen3["base"], **TINY) as llm,
        pytest.raises(ValueError, match="LoRA is not enabled; start with --enable-lora"),
    ):
        llm.generate(PROMPTS, GREEDY, lora_request=tiny_qwen3["loras"]["a1"])


# ----------------------------------------------------------------------------- tensor parallel


@pytest.mark.slow
def test_tp3_with_an_adapter_equals_tp1(tmp_path) -> None:
    """6 query heads over 1 KV head: with TP=3 q, gate/up and B's rows split three ways, the
    single KV head (and its B rows) is replicated, and o/down split A's columns."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("qwen3", head_dim=16, num_attention_heads=6, num_key_value_heads=1)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "base")
    _, path = add_random_adapter(hf, "tp", str(tmp_path), 8, 16, ALL_MODULES, seed=6)
    lora = LoRARequest("tp", 1, path)
    runs = []
    for tp in (1, 3):
        with LLM(str(tmp_path / "base"), enable_lora=True, tensor_parallel_size=tp, **TINY) as llm:
            runs.append(
                tokens(
                    llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[lora, None, lora])
                )
            )
    assert runs[0] == runs[1]


def test_lora_flags_parse_as_vllm_spells_them(tiny_qwen3) -> None:
    from bastion.core.config import build_engine_config
    from bastion.procs.cli import engine_kwargs, parse_args
    from bastion.procs.serve import lora_modules_error

    static = tiny_qwen3["loras"]["a1"].lora_path
    args = parse_args(
        [
            "serve",
            "--enable-lora",
            "--max_loras",
            "3",
            "--max-cpu-loras",
            "4",
            "--max-lora-rank",
            "64",
            "--lora-modules",
            f"a={static}",
            json.dumps({"name": "b", "path": static}),
        ]
    )
    lora = build_engine_config("serve", **engine_kwargs(args)).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == (
        True,
        3,
        4,
        64,
    )
    assert lora_modules_error(lora.lora_modules) is None
    assert lora_modules_error(("a=/nowhere",)) == (
        "--lora-modules a=/nowhere: no adapter_config.json in /nowhere"
    )
    assert lora_modules_error(("a",)) == (
        '--lora-modules takes name=path or {"name": ..., "path": ...}; got \'a\''
    )
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        build_engine_config("serve", lora_modules=(f"a={static}",))
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(1\) must be at least max_loras"):
        build_engine_config("serve", enable_lora=True, max_loras=2, max_cpu_loras=1)
