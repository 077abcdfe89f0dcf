"""Tensor and expert parallelism in real worker processes (gloo on the CPU).

Every test compares exact greedy tokens of the parallel run with a single-process run of the
same weights: TP over the embedded SmolLM2 (9 query / 3 KV heads, so TP=3) and a tiny Qwen3,
EP inside one engine (TP=2 + enable_expert_parallel) and EP across two engines (DP=2) where one
engine idles on dummy steps. Process groups are stateless: re-created at a new epoch in the
same processes, and a collective with a dead or hung peer raises within its timeout.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from bastion import LLM, SamplingParams
from bastion.core.config import ConfigError, build_engine_config
from bastion.core.engine_core import EngineCore
from bastion.ipc.messages import EngineCoreRequest
from bastion.procs.distributed import (
    PORT_EPOCHS,
    DistributedTimeout,
    StatelessGroup,
    engine_group_port,
    pick_free_port,
    worker_group_port,
)
from bastion.procs.executor import MultiprocExecutor, WorkerFailure
from bastion.procs.lifecycle import make_runtime_dir, remove_runtime_dir

from tests.conftest import build_tiny_hf_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,"]
TINY_PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11], [1, 2, 3], [300, 200, 100, 50, 25, 12],
                [77] * 19]
SMALL_KV = {"dtype": "float32", "kv_cache_memory_bytes": 16 << 20}


def greedy_tokens(llm: LLM, prompts: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def as_id_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def embedded_reference(embedded_llm: LLM) -> list[list[int]]:
    return greedy_tokens(embedded_llm, TEXT_PROMPTS)


def save_tiny(kind: str, path) -> str:
    build_tiny_hf_model(kind).save_pretrained(path)
    return str(path)


# --------------------------------------------------------------------- tensor parallel


def test_embedded_tp3_matches_single_process_and_survives_reinit(embedded_reference) -> None:
    """TP=3 through MultiprocExecutor gives TP=1's greedy tokens; after the groups are
    destroyed (a step then fails) and re-created at epoch 1 in the same processes, the tokens
    are unchanged."""
    assert len({tuple(t) for t in embedded_reference}) == len(TEXT_PROMPTS)
    with LLM(max_model_len=256, tensor_parallel_size=3, **SMALL_KV) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, MultiprocExecutor)
        pids = [w.proc.pid for w in executor.workers]
        assert greedy_tokens(llm, TEXT_PROMPTS) == embedded_reference
        before = executor.call("distributed_info")
        assert [i["tp_rank"] for i in before] == [0, 1, 2]
        assert {(i["tp_size"], i["epoch"]) for i in before} == {(3, 0)}

        executor.destroy_distributed()  # without groups a step fails loudly, never silently
        with pytest.raises(WorkerFailure, match="process group was destroyed"):
            greedy_tokens(llm, TEXT_PROMPTS[:1])
        llm.engine.drop_all_requests()
        executor.reset()

        executor.reinit_distributed(1)
        after = executor.call("distributed_info")
        assert {(i["tp_size"], i["epoch"]) for i in after} == {(3, 1)}
        assert after[0]["port"] != before[0]["port"]
        assert [w.proc.pid for w in executor.workers] == pids  # same processes, weights kept
        assert greedy_tokens(llm, TEXT_PROMPTS) == embedded_reference
    assert all(w.proc.poll() is not None for w in executor.workers)  # workers exited


def test_head_count_that_does_not_divide_fails_at_startup() -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"num_attention_heads \(9\) is not divisible by "
                                          r"tensor_parallel_size \(2\)"):
        LLM(max_model_len=256, tensor_parallel_size=2, **SMALL_KV)
    assert time.monotonic() - start < 30  # before any worker loads a model


def test_mp_backend_runs_one_worker_process_with_the_in_process_tokens(tmp_path) -> None:
    path = save_tiny("qwen3", tmp_path)
    with LLM(path, skip_tokenizer_init=True, **SMALL_KV) as llm:
        assert not isinstance(llm.engine.executor, MultiprocExecutor)
        expected = greedy_tokens(llm, as_id_prompts(TINY_PROMPTS))
    with LLM(path, skip_tokenizer_init=True, distributed_executor_backend="mp",
             **SMALL_KV) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, MultiprocExecutor) and len(executor.workers) == 1
        assert executor.workers[0].proc.poll() is None  # its own process, running
        executor.call("start_profile")  # the worker's loop under cProfile (benchmarks)
        assert greedy_tokens(llm, as_id_prompts(TINY_PROMPTS)) == expected
        [profile] = executor.call("stop_profile")
        assert "execute_model_async" in profile and "tottime" in profile


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"distributed_executor_backend": "ray"}, "must be 'uni' or 'mp'; got 'ray'"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
     "'uni' runs one worker; tensor_parallel_size is 2"),
])
def test_executor_backends_that_cannot_run_are_refused(kwargs, error) -> None:
    with pytest.raises(ConfigError, match=error):
        build_engine_config("llm", **kwargs)


# A grammar over a vocabulary of the tiny model's size: "x", "y" and "z" are tokens 10-12.
TOY_VOCAB = [f"<{i}>" for i in range(10)] + ["x", "y", "z"] + [f"<{i}>" for i in range(13, 320)]


def grammar_tokens(llm: LLM, prompts: list) -> list[list[int]]:
    """Greedy tokens under the regex ``[xyz]+`` (on TP rank 0's mask, which every rank takes)."""
    import xgrammar as xgr

    from bastion.ipc.messages import StructuredOutputsParams

    llm.engine.structured_output.use_tokenizer(
        xgr.TokenizerInfo(TOY_VOCAB, xgr.VocabType.RAW, vocab_size=320))
    params = SamplingParams(temperature=0.0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(regex="[xyz]+"))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_tiny_qwen3_tp2_matches_single_process(tmp_path, monkeypatch) -> None:
    path = save_tiny("qwen3", tmp_path)
    with LLM(path, skip_tokenizer_init=True, **SMALL_KV) as llm:
        expected = greedy_tokens(llm, as_id_prompts(TINY_PROMPTS))
        expected_grammar = grammar_tokens(llm, as_id_prompts(TINY_PROMPTS))
    assert len({tuple(t) for t in expected}) > 1
    assert {t for ts in expected_grammar for t in ts} <= {10, 11, 12}
    assert len({tuple(t) for t in expected_grammar}) > 1
    with LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2, **SMALL_KV) as llm:
        assert greedy_tokens(llm, as_id_prompts(TINY_PROMPTS)) == expected
        assert grammar_tokens(llm, as_id_prompts(TINY_PROMPTS)) == expected_grammar
        executor, exits = llm.engine.executor, []
        for rank, worker in enumerate(executor.workers):
            wait = worker.proc.wait

            def recording(timeout=None, rank=rank, wait=wait):  # type: ignore[no-untyped-def]
                code = wait(timeout)
                exits.append((rank, [w.proc.poll() for w in executor.workers]))
                return code

            monkeypatch.setattr(worker.proc, "wait", recording)
    # Rank 0 hosts the store that NCCL's monitors on the other ranks poll: it still runs when
    # rank 1 has exited, then exits too, both cleanly.
    assert exits == [(1, [None, 0]), (0, [0, 0])]


# --------------------------------------------------------------------- expert parallel


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[str, list[list[int]]]:
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("moe"))
    with LLM(path, skip_tokenizer_init=True, **SMALL_KV) as llm:
        return path, greedy_tokens(llm, as_id_prompts(TINY_PROMPTS))


def test_moe_expert_parallel_inside_one_engine(tiny_moe) -> None:
    """TP=2 with enable_expert_parallel: each worker holds 4 of the 8 experts."""
    path, expected = tiny_moe
    with LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2,
             enable_expert_parallel=True, **SMALL_KV) as llm:
        executor = llm.engine.executor
        assert [i["ep_size"] for i in executor.call("distributed_info")] == [2, 2]
        executor.execute_dummy()  # a dummy step between real ones changes nothing
        assert greedy_tokens(llm, as_id_prompts(TINY_PROMPTS)) == expected


def _start_dp_engines(path: str, dp_size: int, runtime_dir: str,
                      pool: ThreadPoolExecutor, tp_size: int = 1) -> list[EngineCore]:
    base = pick_free_port() - 7  # the workers' EP rendezvous is base + 7 + 2 * epoch
    config = build_engine_config(model=path, skip_tokenizer_init=True, data_parallel_size=dp_size,
                                 tensor_parallel_size=tp_size, enable_expert_parallel=True,
                                 data_parallel_rpc_port=base, **SMALL_KV)

    def start(engine_id: int) -> EngineCore:
        return EngineCore(config, MultiprocExecutor(config, runtime_dir, engine_id), 256,
                          engine_id)

    # NOTE: concurrently, since each engine's workers wait for the others' in the rendezvous;
    # on threads that outlive the workers (PR_SET_PDEATHSIG fires when the spawning thread
    # exits, not the process).
    futures = [pool.submit(start, i) for i in range(dp_size)]
    return [f.result(timeout=240) for f in futures]


class _ThreadAgreement:
    """The coupled engines' per-round agreement between threads of this process (the engine
    process does it with one all-reduce over its DP group): the most tokens, all decode."""

    def __init__(self, num_engines: int) -> None:
        self.barrier = threading.Barrier(num_engines)
        self.votes: list[tuple[int, bool]] = [(0, True)] * num_engines

    def agree(self, engine_id: int, num_tokens: int, is_decode: bool) -> tuple[int, bool]:
        self.votes[engine_id] = (num_tokens, is_decode)
        self.barrier.wait()
        result = max(n for n, _ in self.votes), all(d for _, d in self.votes)
        self.barrier.wait()  # nobody votes again before everyone has read this round
        return result


def _run_lockstep(cores: list[EngineCore], prompts: list[list[list[int]]]
                  ) -> tuple[dict[str, list[int]], list[int]]:
    """Step every engine together, each padding to the round's agreed row count; an engine
    without work runs padding rows (as the engine busy loop must while any DP rank has work)."""
    agreement = _ThreadAgreement(len(cores))
    for core, own in zip(cores, prompts):
        core.dp_sync = functools.partial(agreement.agree, core.engine_id)
        for i, p in enumerate(own):
            core.add_request(EngineCoreRequest(f"{core.engine_id}-{i}", p, GREEDY))
    tokens: dict[str, list[int]] = defaultdict(list)
    num_dummy = [0] * len(cores)

    def one_step(core: EngineCore) -> None:
        if core.has_unfinished_requests:
            for out in core.step().outputs:
                tokens[out.request_id].extend(out.new_token_ids)
        elif core.idle_round():
            num_dummy[core.engine_id] += 1

    with ThreadPoolExecutor(len(cores)) as pool:
        while any(c.has_unfinished_requests for c in cores):
            list(pool.map(one_step, cores))
    return tokens, num_dummy


def test_moe_expert_parallel_across_two_engines_with_dummy_steps(tiny_moe) -> None:
    """DP=2 engines x TP=1, EP over both workers: engine 1 holds one short request and then
    idles on dummy steps while engine 0 still decodes (uneven token counts every step); both
    match the single process."""
    path, expected = tiny_moe
    pool, runtime_dir = ThreadPoolExecutor(2), make_runtime_dir()
    cores: list[EngineCore] = []
    try:
        cores = _start_dp_engines(path, 2, runtime_dir, pool)
        info = [c.executor.call("distributed_info")[0] for c in cores]
        assert [(i["dp_rank"], i["ep_size"]) for i in info] == [(0, 2), (1, 2)]
        short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        cores[1].add_request(EngineCoreRequest("1-short", TINY_PROMPTS[3], short))
        tokens, num_dummy = _run_lockstep(cores, [TINY_PROMPTS, []])
        assert [tokens[f"0-{i}"] for i in range(4)] == expected
        assert tokens["1-short"] == expected[3][:4]
        assert num_dummy[0] == 0 and num_dummy[1] >= 10  # 16 steps of engine 0, 4 of engine 1
    finally:
        for core in cores:
            core.shutdown()
        pool.shutdown()
        remove_runtime_dir(runtime_dir)


def test_moe_expert_parallel_over_tp2_x_dp2(tiny_moe) -> None:
    """TP=2 x DP=2 (the four-GPU drill's layout, here on gloo): experts spread over all four
    workers, each engine's TP pair all-reduces; every request's 16 greedy tokens match one
    process with no parallelism."""
    path, expected = tiny_moe
    pool, runtime_dir = ThreadPoolExecutor(2), make_runtime_dir()
    cores: list[EngineCore] = []
    try:
        cores = _start_dp_engines(path, 2, runtime_dir, pool, tp_size=2)
        info = [i for c in cores for i in c.executor.call("distributed_info")]
        assert [(i["dp_rank"], i["ep_size"]) for i in info] == [(0, 4), (0, 4), (1, 4), (1, 4)]
        tokens, _ = _run_lockstep(cores, [TINY_PROMPTS[:3], TINY_PROMPTS[3:]])
        assert [tokens[f"0-{i}"] for i in range(3)] + [tokens["1-0"]] == expected
    finally:
        for core in cores:
            core.shutdown()
        pool.shutdown()
        remove_runtime_dir(runtime_dir)


# --------------------------------------------------------------------- stateless groups

def test_a_client_gives_up_on_a_port_some_other_program_listens_on() -> None:
    """TCPStore's own client timeout does not cover a listener that accepts and never answers
    (a recovery whose port another program held waited 45 s and more); the rendezvous does."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    try:
        start = time.monotonic()
        with pytest.raises(DistributedTimeout, match="rank 1 could not reach the rendezvous at "
                           r"127\.0\.0\.1:\d+ within 1 s: connected, but no answer"):
            StatelessGroup("gloo", "127.0.0.1", blocker.getsockname()[1], 1, 2, 1.0,
                           rendezvous_timeout_s=1.0)
        assert time.monotonic() - start < 10
    finally:
        blocker.close()


def test_epoch_ports_stay_in_a_window() -> None:
    """A daemon that recovers for months keeps its DP ports in base .. base + 134."""
    par = build_engine_config(data_parallel_size=2, data_parallel_rpc_port=29550).parallel
    assert [worker_group_port(par, e) for e in (0, 1, 63, 64, 65)] == [
        29557, 29559, 29683, 29557, 29559]
    assert [engine_group_port(par, e) for e in (0, 63, 64)] == [29558, 29684, 29558]
    assert PORT_EPOCHS == 64


_PEER = textwrap.dedent("""
    import sys, time, torch
    from bastion.procs.distributed import StatelessGroup
    group = StatelessGroup("gloo", "127.0.0.1", int(sys.argv[1]), 1, 2, 2.0)
    group.all_reduce(torch.ones(3))
    print("joined", flush=True)
    time.sleep(60)  # hung: never joins the next collective
""")


def test_collective_with_a_hung_or_dead_peer_raises_within_timeout() -> None:
    port = pick_free_port()
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(port)], stdout=subprocess.PIPE,
                            text=True)
    try:
        group = StatelessGroup("gloo", "127.0.0.1", port, 0, 2, 2.0)
        assert group.is_master
        x = torch.full((3,), 2.0)
        assert group.all_reduce(x).tolist() == [3.0, 3.0, 3.0]
        assert peer.stdout.readline().strip() == "joined"

        start = time.monotonic()
        with pytest.raises(DistributedTimeout, match="all_reduce on group world"):
            group.all_reduce(torch.ones(1))  # the peer is alive but hung
        assert 1.5 < time.monotonic() - start < 10

        peer.kill()
        peer.wait()
        start = time.monotonic()
        with pytest.raises(DistributedTimeout):
            group.barrier()  # the peer is gone
        assert time.monotonic() - start < 10
        group.destroy()
        group.destroy()  # idempotent
        with pytest.raises(RuntimeError, match="destroyed"):
            group.all_reduce(torch.ones(1))
    finally:
        peer.kill()
        peer.wait()
    # the same process can host a fresh group on a fresh port right away
    solo = StatelessGroup("gloo", "127.0.0.1", pick_free_port(), 0, 1, 2.0)
    assert solo.all_gather(torch.tensor([7])).tolist() == [7]
    solo.destroy()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the kernel gives no pidfds")
def test_a_childs_exit_wakes_a_poller_at_once() -> None:
    """The executor's wait for its workers polls their pidfds beside their messages, so a
    worker's death (``kill -9``) is seen as it happens, not at the next 50 ms check."""
    import zmq

    from bastion.procs.lifecycle import Child

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = Child("worker", 0, "sleeper", proc)
    try:
        poller = zmq.Poller()
        fd = child.exit_fd()
        assert fd is not None and child.exit_fd() == fd  # opened once
        poller.register(fd, zmq.POLLIN)
        assert poller.poll(50) == []  # alive: nothing to read
        proc.kill()
        t0 = time.monotonic()
        assert poller.poll(10_000) == [(fd, zmq.POLLIN)]
        assert time.monotonic() - t0 < 2.0  # woken by the exit, not the 10 s timeout
        assert not child.is_alive()
    finally:
        child.kill()
    assert child.exit_fd() is None  # closed by kill, none for a dead process
