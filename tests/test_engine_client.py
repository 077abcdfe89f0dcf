"""The API process's engine client without processes or sockets (issue #24): routing, hold/
resume bookkeeping, output demultiplexing, and the facade's reaction to a fault of a dense
engine, of a coupled (expert-parallel) group, and to a dead group. Sends are recorded as
``(engine id, message)``."""

from __future__ import annotations

import asyncio

import pytest

from bastion.core.config import EngineConfig, FaultToleranceConfig, ParallelConfig
from bastion.ipc.control import GroupStatus
from bastion.ipc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineState,
    EngineStatus,
    FinishReason,
    SamplingParams,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from bastion.procs.client.holds import HoldResume, Seq
from bastion.procs.client.router import Router
from bastion.procs.client.streams import OutputDemux
from bastion.procs.client.utility_calls import UtilityCalls
from bastion.procs.engine_client import AsyncEngineClient

HEALTHY, UNHEALTHY, RECOVERING, STARTING = (EngineState.HEALTHY, EngineState.UNHEALTHY,
                                            EngineState.RECOVERING, EngineState.STARTING)


def statuses(*states: EngineState, epoch: int = 0) -> list[EngineStatus]:
    return [EngineStatus(i, s, epoch) for i, s in enumerate(states)]


def seq(child_id: str, deadline: float | None = None) -> Seq:
    request = EngineCoreRequest(child_id, [1, 2, 3], SamplingParams(), deadline=deadline)
    return Seq(child_id, request, stream=None)


# ------------------------------------------------------------------------------------ routing


def test_dense_engines_serve_each_on_its_own() -> None:
    router = Router([0, 1, 2], dp_size=3, is_coupled=False)
    assert router.serving() == [] and not router.is_ready()
    router.update(statuses(HEALTHY, STARTING, HEALTHY))
    assert router.serving() == [0, 2]
    assert not router.is_ready()  # one still starting
    router.update(statuses(HEALTHY, UNHEALTHY, HEALTHY))
    assert router.serving() == [0, 2] and router.is_ready()  # degraded, still serving
    router.fatal = "recovery failed"
    assert router.serving() == [] and not router.is_ready()


def test_a_coupled_group_serves_only_when_every_engine_is_healthy() -> None:
    router = Router([0, 1], dp_size=2, is_coupled=True)
    router.update(statuses(HEALTHY, HEALTHY))
    assert router.serving() == [0, 1]
    router.update(statuses(HEALTHY, UNHEALTHY))
    assert router.serving() == [] and not router.is_ready()
    assert not router.is_progressing()  # sits faulted
    router.update(statuses(RECOVERING, RECOVERING))
    assert router.is_progressing()


def test_a_coupled_engine_of_another_server_stops_this_one() -> None:
    # External load-balancer mode: this server routes to engine 1 only, but the group's health
    # is both engines'.
    router = Router([1], dp_size=2, is_coupled=True)
    router.update(statuses(HEALTHY, HEALTHY))
    assert router.serving() == [1]
    assert [s.engine_id for s in router.statuses.values()] == [0, 1]
    assert router.update(statuses(UNHEALTHY, HEALTHY)) == [1]
    assert router.serving() == []
    dense = Router([1], dp_size=2, is_coupled=False)
    dense.update(statuses(UNHEALTHY, HEALTHY))
    assert dense.serving() == [1] and list(dense.statuses) == [1]


def test_pick_is_the_least_loaded_engine_the_lowest_on_a_tie() -> None:
    router = Router([0, 1, 2], dp_size=3, is_coupled=False)
    assert router.pick([0, 1, 2], {0: 0, 1: 0, 2: 0}) == 0
    assert router.pick([0, 1, 2], {0: 1, 1: 0, 2: 0}) == 1
    # A sequence sent since counts as 4 waiting ones of the engine's last report.
    assert router.observe_stats(1, SchedulerStats(num_waiting_reqs=5))
    assert router.pick([0, 1, 2], {0: 1, 1: 0, 2: 2}) == 0
    assert router.pick([1, 2], {0: 0, 1: 0, 2: 1}) == 2
    assert router.pick([1, 2], {0: 0, 1: 0, 2: 2}) == 1
    assert not router.observe_stats(7, SchedulerStats(num_waiting_reqs=5))  # not ours


def test_update_names_the_engines_to_take_back() -> None:
    router = Router([0, 1], dp_size=2, is_coupled=False)
    assert router.update(statuses(HEALTHY, HEALTHY)) == []  # starting -> serving: nothing yet
    router.observe_stats(1, SchedulerStats(num_waiting_reqs=3))
    assert router.update(statuses(HEALTHY, UNHEALTHY)) == [1]  # stopped serving
    assert router.stats[1] == SchedulerStats()  # its queue went with it
    assert router.update(statuses(HEALTHY, RECOVERING)) == []
    back = [EngineStatus(0, HEALTHY, 0), EngineStatus(1, HEALTHY, 1)]
    assert router.update(back) == [1]  # serves again, at a new epoch
    assert router.update(back) == []  # the same report again
    # A restart the reports never showed as a fault: a new epoch alone takes engine 0 back.
    assert router.update([EngineStatus(0, HEALTHY, 2)]) == [0]


def test_a_coupled_fault_takes_back_every_engine_of_the_group() -> None:
    router = Router([0, 1], dp_size=2, is_coupled=True)
    router.update(statuses(HEALTHY, HEALTHY))
    assert router.update(statuses(UNHEALTHY, HEALTHY)) == [0, 1]
    assert router.update(statuses(HEALTHY, HEALTHY, epoch=1)) == [0, 1]


# ------------------------------------------------------------------------------ hold/resume


def test_a_resubmission_resumes_after_the_streamed_tokens_under_a_fresh_id() -> None:
    holds = HoldResume([0, 1])
    a = seq("a-0")
    holds.add(a)
    assert holds.take_held() == [a] and holds.take_held() == []
    first = holds.submit(a, 0, [])
    assert (first.request_id, first.resumed_output_token_ids) == ("a-0@0", [])
    assert holds.lookup("a-0@0") is a
    assert holds.num_inflight == {0: 1, 1: 0}

    streamed = [7, 8]
    assert holds.take_back(0) == [a]
    assert holds.lookup("a-0@0") is None  # its outputs are stale from now on
    assert holds.num_inflight == {0: 0, 1: 0}
    holds.hold(a)
    second = holds.submit(holds.take_held()[0], 1, streamed)
    streamed.append(9)  # the client's list grows; the request keeps what was sent
    assert (second.request_id, second.resumed_output_token_ids) == ("a-0@1", [7, 8])
    assert second.prompt_token_ids == [1, 2, 3] and a.request.request_id == "a-0"
    assert holds.num_submitted == {0: 1, 1: 1} and holds.num_inflight == {0: 0, 1: 1}


def test_take_back_returns_the_engines_sequences_in_request_order() -> None:
    holds = HoldResume([0, 1])
    a, b, c = seq("a-0"), seq("b-0"), seq("c-0")
    for s in (a, b, c):
        holds.add(s)
    holds.take_held()
    holds.submit(a, 1, [])
    holds.submit(b, 0, [])
    holds.submit(c, 1, [])
    assert holds.take_back(1) == [a, c]
    holds.submit(a, 0, [])  # moved after b was submitted there
    holds.submit(c, 0, [])
    assert holds.take_back(0) == [a, b, c]
    assert holds.take_back(0) == []  # nothing twice


def test_close_says_whether_an_engine_still_has_the_sequence() -> None:
    holds = HoldResume([0])
    a, b = seq("a-0"), seq("b-0")
    holds.add(a)
    holds.add(b)
    assert not holds.close(a)  # held: nothing to abort
    holds.take_held()
    holds.submit(b, 0, [])
    assert holds.close(b) and not holds.close(b)
    assert holds.table_sizes() == {"sequences": 0, "engine_requests": 0, "held": 0,
                                   "inflight": 0}


def test_only_held_sequences_past_their_deadline_expire() -> None:
    holds = HoldResume([0])
    late, early, none, placed = (seq("late-0", 10.0), seq("early-0", 5.0), seq("none-0"),
                                 seq("placed-0", 5.0))
    holds.add(placed)
    holds.submit(holds.take_held()[0], 0, [])  # an engine enforces its deadline itself
    for s in (late, early, none):
        holds.add(s)
    assert holds.expired(7.0) == [early]
    assert holds.expired(11.0) == [late, early]


# ------------------------------------------------------------------------- demultiplexing


async def test_outputs_reach_their_streams_and_leave_no_table_entries() -> None:
    aborts: list[tuple[int, list[str]]] = []
    holds = HoldResume([0])
    demux = OutputDemux(None, holds, lambda e, ids: aborts.append((e, ids)))
    stream = demux.open("r", [1, 2], SamplingParams(n=2, seed=3), None, None, None)
    assert [s.request.sampling_params.seed for s in stream.seqs] == [3, 4]
    first, second = holds.take_held()
    holds.submit(first, 0, [])
    holds.submit(second, 0, [])
    await demux.route(EngineCoreOutputs(0, [EngineCoreOutput("r-0@0", [5], num_cached_tokens=2),
                                            EngineCoreOutput("r-1@1", [6]),
                                            EngineCoreOutput("gone@9", [7])]))
    assert demux.streamed(first) == [5] and stream.num_cached_tokens == 2
    await demux.route(EngineCoreOutputs(0, [EngineCoreOutput("r-0@0", [8], FinishReason.LENGTH),
                                            EngineCoreOutput("r-1@1", [9], FinishReason.STOP)]))
    deltas = [(d.index, d.token_ids, d.finish_reason) async for d in stream]
    assert deltas == [(0, [5], None), (1, [6], None), (0, [8], "length"), (1, [9], "stop")]
    assert aborts == []  # both finished in the engine
    assert demux.table_sizes() == {"streams": 0, "output_states": 0}
    assert holds.table_sizes() == {"sequences": 0, "engine_requests": 0, "held": 0,
                                   "inflight": 0}


async def test_an_aborted_stream_aborts_only_what_an_engine_has() -> None:
    aborts: list[tuple[int, list[str]]] = []
    holds = HoldResume([0, 1])
    demux = OutputDemux(None, holds, lambda e, ids: aborts.append((e, ids)))
    stream = demux.open("r", [1], SamplingParams(n=3), None, None, None)
    s0, s1, s2 = holds.take_held()
    holds.submit(s0, 1, [])
    holds.submit(s1, 0, [])
    holds.hold(s2)  # waiting for an engine
    await stream.abort()
    await stream.abort()  # twice is harmless
    assert aborts == [(1, ["r-0@0"]), (0, ["r-1@1"])]
    assert demux.table_sizes() == {"streams": 0, "output_states": 0}
    assert holds.table_sizes()["sequences"] == holds.table_sizes()["held"] == 0


async def test_utility_calls_answer_in_engine_order_and_forget_what_timed_out() -> None:
    sent: list[tuple[int, UtilityCall]] = []
    calls = UtilityCalls(lambda e, call: sent.append((e, call)))
    task = asyncio.create_task(calls.call([2, 5], "add_lora", ["x", 1], timeout_s=5.0))
    await asyncio.sleep(0)
    assert [(e, c.call_id, c.method, c.args) for e, c in sent] == [(2, 1, "add_lora", ["x", 1]),
                                                                  (5, 2, "add_lora", ["x", 1])]
    calls.resolve(UtilityResult(2, "five"))  # engine 5 answers first
    calls.resolve(UtilityResult(1, "two"))
    assert await task == ["two", "five"] and len(calls) == 0

    task = asyncio.create_task(calls.call([2, 5], "remove_lora", [1], timeout_s=5.0))
    await asyncio.sleep(0)
    calls.resolve(UtilityResult(3, failure="ValueError: no adapter 1"))
    calls.resolve(UtilityResult(4))
    with pytest.raises(ValueError, match="^no adapter 1$"):
        await task

    with pytest.raises(TimeoutError):
        await calls.call([2], "add_lora", [], timeout_s=0.01)
    assert len(calls) == 0
    calls.resolve(UtilityResult(5, "late"))  # dropped
    assert len(calls) == 0


# -------------------------------------------------------------------------------- facade


class Client:
    """An ``AsyncEngineClient`` whose supervisor records what it would send."""

    def __init__(self, dp_size: int, coupled: bool = False, ft_inflight: str = "resume"
                 ) -> None:
        config = EngineConfig(
            parallel=ParallelConfig(data_parallel_size=dp_size, enable_expert_parallel=coupled),
            fault_tolerance=FaultToleranceConfig(ft_inflight=ft_inflight))
        self.client = AsyncEngineClient(config, None, "m", 64, None, "/nonexistent")
        self.sent: list[tuple[int, object]] = []
        self.client.supervisor.send_input = lambda e, msg: self.sent.append((e, msg))

    def take_sent(self) -> list[tuple[int, str, list[int]] | tuple[int, list[str]]]:
        """ADDs as (engine, engine request id, resumed tokens); ABORTs as (engine, ids)."""
        sent, self.sent = self.sent, []
        return [(e, m.request_id, m.resumed_output_token_ids) if isinstance(m, EngineCoreRequest)
                else (e, m.request_ids) for e, m in sent]

    def report(self, *states: EngineState, epoch: int = 0) -> None:
        self.client._on_status(GroupStatus(epoch, statuses(*states, epoch=epoch)))

    async def output(self, engine_id: int, *outputs: EngineCoreOutput) -> None:
        await self.client.demux.route(EngineCoreOutputs(engine_id, list(outputs)))


async def read(stream) -> list[tuple[list[int], str | None, str | None]]:
    """Every delta until the stream ends (each test queues all of them first)."""
    return [(d.token_ids, d.finish_reason, d.error) async for d in stream]


def queued(stream) -> int:
    return stream.queue.qsize()


@pytest.fixture
def make_client():
    made: list[Client] = []

    def make(*args, **kwargs) -> Client:
        made.append(Client(*args, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.client.supervisor.close()


async def test_a_dense_engines_fault_moves_its_sequences_to_the_others_at_once(
        make_client) -> None:
    c = make_client(2)
    c.report(HEALTHY, HEALTHY)
    a = c.client.generate("a", [1, 2], SamplingParams())
    b = c.client.generate("b", [3], SamplingParams())
    assert c.take_sent() == [(0, "a-0@0", []), (1, "b-0@1", [])]
    await c.output(1, EngineCoreOutput("b-0@1", [5, 6]))

    c.report(HEALTHY, UNHEALTHY)
    assert c.take_sent() == [(0, "b-0@2", [5, 6])]  # resumed after what b streamed
    assert c.client.is_ready()
    await c.output(1, EngineCoreOutput("b-0@1", [99]))  # stale: engine 1's earlier request
    await c.output(0, EngineCoreOutput("b-0@2", [7], FinishReason.LENGTH))
    assert await read(b) == [([5, 6], None, None), ([7], "length", None)]
    assert [e["num_requests"] for e in c.client.status()] == [2, 1]

    # Engine 1 serves again (its own group, at its epoch 1): new requests reach it; a stays.
    c.client._on_status(GroupStatus(1, [EngineStatus(1, HEALTHY, 1)]))
    assert c.take_sent() == []
    c.client.generate("d", [4], SamplingParams())
    assert c.take_sent() == [(1, "d-0@3", [])]
    await a.abort()
    assert c.take_sent() == [(0, ["a-0@0"])]
    assert queued(a) == 0
    assert c.client.table_sizes() == {"streams": 1, "sequences": 1, "engine_requests": 1,
                                      "held": 0, "output_states": 1, "inflight": 1}  # d's


async def test_a_coupled_groups_sequences_wait_for_its_recovery(make_client) -> None:
    c = make_client(2, coupled=True)
    c.report(HEALTHY, HEALTHY)
    a = c.client.generate("a", [1], SamplingParams())
    assert c.take_sent() == [(0, "a-0@0", [])]
    await c.output(0, EngineCoreOutput("a-0@0", [5]))

    c.report(HEALTHY, UNHEALTHY)
    e = c.client.generate("e", [2], SamplingParams())  # accepted, held
    assert c.take_sent() == [] and not c.client.is_ready()
    assert c.client.table_sizes() == {"streams": 2, "sequences": 2, "engine_requests": 0,
                                      "held": 2, "output_states": 2, "inflight": 0}
    c.report(HEALTHY, HEALTHY, epoch=1)
    assert c.take_sent() == [(0, "a-0@1", [5]), (1, "e-0@2", [])]
    await c.output(0, EngineCoreOutput("a-0@0", [98]))  # stale: before the recovery
    await c.output(0, EngineCoreOutput("a-0@1", [6], FinishReason.STOP))
    await c.output(1, EngineCoreOutput("e-0@2", [7], FinishReason.STOP))
    assert await read(a) == [([5], None, None), ([6], "stop", None)]
    assert await read(e) == [([7], "stop", None)]
    assert set(c.client.table_sizes().values()) == {0}


async def test_ft_inflight_abort_ends_the_faulted_engines_sequences(make_client) -> None:
    c = make_client(2, ft_inflight="abort")
    c.report(HEALTHY, HEALTHY)
    a = c.client.generate("a", [1], SamplingParams())
    b = c.client.generate("b", [1], SamplingParams())
    c.take_sent()
    c.report(UNHEALTHY, HEALTHY)
    assert c.take_sent() == []  # nothing resubmitted, and nothing left to abort
    assert await read(a) == [([], "abort", "aborted: an engine faulted (--ft-inflight abort)")]
    assert queued(b) == 0
    assert c.client.table_sizes()["sequences"] == 1  # b's


async def test_a_dead_group_ends_every_request_and_refuses_new_ones(make_client) -> None:
    c = make_client(2, coupled=True)
    c.report(HEALTHY, HEALTHY)
    a = c.client.generate("a", [1], SamplingParams())
    c.report(UNHEALTHY, HEALTHY)
    held = c.client.generate("h", [1], SamplingParams())
    c.client._on_fatal("recovery failed")
    assert c.client.fatal == "recovery failed" and not c.client.is_ready()
    for stream in (a, held):
        assert await read(stream) == [([], "error", "the engines are dead: recovery failed")]
    with pytest.raises(RuntimeError, match="the engines are dead: recovery failed"):
        c.client.generate("late", [1], SamplingParams())
    assert set(c.client.table_sizes().values()) == {0}
