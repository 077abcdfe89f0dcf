"""Data parallel serving: internal load balancing and external (one server per rank) mode,
with a tiny Qwen3-MoE whose experts are spread over both engines' workers."""

from __future__ import annotations

import json
import threading

import pytest
from serve_fixture import ServerProcess, dp_base_port
from test_fault_tolerance import PROMPTS, moe_folder, post  # noqa: F401 (fixture)

from bastion import LLM, SamplingParams

MAX_TOKENS = 12


def dp_args(folder: str, port: int, *extra: str) -> tuple[str, ...]:
    # No warm spares (serve_fixture.SMALL_SERVER_ARGS says why): no process is restarted here.
    return ("--model", folder, "--served-model-name", "m", "--dtype", "float32", "--device",
            "cpu", "--max-model-len", "256", "--kv-cache-memory-bytes", "16777216",
            "--data-parallel-size", "2", "--enable-expert-parallel",
            "--data-parallel-rpc-port", str(port), "--distributed-timeout-s", "8",
            "--ft-warm-spares", "0", *extra)


def complete(server: ServerProcess, prompt: str) -> str:
    code, body = post(server, "/v1/completions", {"model": "m", "prompt": prompt,
                                                  "max_tokens": MAX_TOKENS, "temperature": 0,
                                                  "ignore_eos": True})
    assert code == 200, body
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def offline_greedy(moe_folder) -> dict[str, str]:  # noqa: F811
    """One process, no parallelism: the reference."""
    llm = LLM(moe_folder, dtype="float32", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def test_internal_dp_spreads_load_and_matches_one_process(moe_folder, offline_greedy):  # noqa: F811
    server = ServerProcess(dp_args(moe_folder, dp_base_port()))
    try:
        server.wait_healthy(240)
        results: dict[int, str] = {}

        def run(i: int) -> None:
            results[i] = complete(server, PROMPTS[i % len(PROMPTS)])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(results) == 8  # each request answered exactly once
        for i, text in results.items():
            assert text == offline_greedy[PROMPTS[i % len(PROMPTS)]]
        code, body = server.get("/fault_tolerance/status")
        counts = [e["num_requests"] for e in json.loads(body)["engines"]]
        assert sum(counts) == 8 and min(counts) >= 2, counts
        assert server.stop() == 0
    finally:
        server.kill_tree()


@pytest.fixture(scope="module")
def external_ranks(moe_folder):  # noqa: F811
    """External DP: one server per rank, one group for the two tests below (starting a pair
    takes ~7 s of this 2-core box). Manual recovery and fault injection, which the second test
    needs; neither changes anything until a fault, and the first test faults nothing (it runs
    first, on the fresh group). At the end, after the second test's fault and recovery, both
    ranks must still stop cleanly."""
    port = dp_base_port()
    manual = ("--no-ft-auto-recovery", "--enable-fault-injection")
    rank0 = ServerProcess(dp_args(moe_folder, port, "--data-parallel-rank", "0", *manual))
    rank1 = ServerProcess(dp_args(moe_folder, port, "--data-parallel-rank", "1", *manual))
    try:
        rank0.wait_healthy(240)
        rank1.wait_healthy(240)
        yield rank0, rank1
        # Rank 0 hosts the coordinator; stopping it first leaves rank 1 to drain on its own.
        assert rank0.stop() == 0
        assert rank1.stop() == 0
    finally:
        rank1.kill_tree()
        rank0.kill_tree()


def test_external_dp_each_rank_serves_and_idle_rank_runs_dummy_batches(external_ranks,
                                                                       offline_greedy):
    rank0, rank1 = external_ranks
    # Only rank 0 gets work: rank 1 must step dummy batches for the expert collectives.
    assert complete(rank0, PROMPTS[0]) == offline_greedy[PROMPTS[0]]
    assert complete(rank1, PROMPTS[1]) == offline_greedy[PROMPTS[1]]
    for server in (rank0, rank1):
        code, body = server.get("/fault_tolerance/status")
        engines = json.loads(body)["engines"]
        assert [e["state"] for e in engines] == ["healthy", "healthy"]


def test_external_dp_one_apply_on_any_rank_recovers_the_whole_group(external_ranks,
                                                                   offline_greedy):
    from test_fault_tolerance import status, wait_for

    rank0, rank1 = external_ranks
    code, _ = post(rank1, "/fault_tolerance/inject", {"kind": "raise", "engine": 1})
    assert code == 200
    code, body = post(rank1, "/fault_tolerance/inject", {"kind": "raise", "engine": 0})
    assert code == 400  # rank 1's server does not own engine 0
    for server in (rank0, rank1):
        wait_for(lambda s=server: status(s)[1]["state"] == "unhealthy", 30, "the fault")
    # Requests sent while the group is down wait for it instead of failing.
    results: dict[str, str] = {}
    threads = [threading.Thread(target=lambda s=s, p=p: results.__setitem__(p, complete(s, p)))
               for s, p in ((rank0, PROMPTS[0]), (rank1, PROMPTS[1]))]
    for t in threads:
        t.start()
    code, body = post(rank1, "/fault_tolerance/apply", {"instruction": "retry"})
    assert code == 202
    for t in threads:
        t.join(120)
    assert results == {p: offline_greedy[p] for p in PROMPTS[:2]}
    for server in (rank0, rank1):
        engines = status(server)
        assert [e["state"] for e in engines] == ["healthy", "healthy"]
        assert engines[0]["last_action_id"] == body["request_id"]


async def test_shutdown_stops_engine_0_after_the_others() -> None:
    # With expert parallelism engine 0's rank-0 worker hosts the store of the groups that span
    # engines, which the other engines' NCCL monitors poll: engine 0 is told to stop only once
    # engines 1 and 2 have exited; a sentinel that never exits is killed at the end.
    import time

    from bastion.procs.client.supervisor import EngineSupervisor

    told: dict[int, float] = {}
    killed: list[int] = []

    class Sentinel:
        def __init__(self, rank: int, exits_after: float | None) -> None:
            self.rank, self.exits_after = rank, exits_after

        def exit_time(self) -> float:
            return told[self.rank] + self.exits_after

        def is_alive(self) -> bool:
            return (self.rank not in told or self.exits_after is None
                    or time.monotonic() < self.exit_time())

        def kill(self, timeout: float) -> None:
            if self.is_alive():
                killed.append(self.rank)

    class CmdSocket:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        async def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
            told[self.rank] = time.monotonic()

    supervisor = EngineSupervisor.__new__(EngineSupervisor)
    supervisor.sentinels = {0: Sentinel(0, 0.05), 1: Sentinel(1, 0.3), 2: Sentinel(2, 0.1)}
    supervisor.cmd_sockets = {i: CmdSocket(i) for i in supervisor.sentinels}
    await supervisor.shutdown(timeout_s=4.0)
    assert sorted(told, key=told.get) == [1, 2, 0] and not killed
    sentinels = supervisor.sentinels
    assert told[0] >= max(sentinels[1].exit_time(), sentinels[2].exit_time())

    told.clear()
    supervisor.sentinels = {0: Sentinel(0, 0.05), 1: Sentinel(1, None)}  # engine 1 hangs
    supervisor.cmd_sockets = {i: CmdSocket(i) for i in supervisor.sentinels}
    start = time.monotonic()
    await supervisor.shutdown(timeout_s=1.0)
    assert 0.5 <= told[0] - start < 0.6  # half the time for the others, then engine 0
    assert time.monotonic() - start < 0.7 and killed == [1]
