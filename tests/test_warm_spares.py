"""Warm spares (DP=1, the embedded model in float32 on CPU, real processes): the spare engine and
its worker spare warm up side by side; ``kill -9`` of the engine and, as soon as it recovered,
of the promoted worker, with the same streams in flight, promote the spare set (the second time
one still warming up, which the promotion waits for) instead of starting processes from
nothing; every stream ends with the fault-free tokens; a new spare starts right after each
promotion; a worker spare killed while idle costs its set a replacement and never pauses
serving."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import datetime

import pytest
from serve_fixture import ServerProcess, descendants, process_title
from test_dense_dp_faults import stream
from test_fault_tolerance import status, stream_all, wait_for

PROMPTS = ("Once upon a time", "The capital of France is")
# Rounds of (kill -9 the engine, kill -9 its worker at once); issue #24's stress drill is 50
# rounds (BASTION_FT_STRESS_ROUNDS=50, by hand: docs/FAULTS.md). A lost order used to cost 120 s.
NUM_ROUNDS = int(os.environ.get("BASTION_FT_STRESS_ROUNDS", "1"))
MAX_RECOVERY_S = 40.0
# The second kill of a round finds the new spare warming up (~10 s of CPU on a quiet 2-core
# host, several times that on a loaded one): the recovery waits for it.
MAX_RECOVERY_WARMING_S = 90.0
_READY = re.compile(r"^(\S+ \S+) INFO \S+: bastion::spare-(engine-0|worker-0-0): warm spare "
                    r"ready ([\d.]+) s after its spawn \(([\d.]+) s of its own", re.MULTILINE)


def pids_by_title(server: ServerProcess) -> dict[str, int]:
    return {process_title(pid): pid for pid in descendants(server.pid)}


def spare_pids(server: ServerProcess) -> tuple[int, int] | None:
    """The spare engine's and its worker spare's pids, once both run."""
    titles = pids_by_title(server)
    engine, worker = titles.get("bastion::spare-engine-0"), titles.get("bastion::spare-worker-0-0")
    return (engine, worker) if engine and worker else None


def spare_state(server: ServerProcess) -> str:
    return status(server)[0]["spare"]


def wait_spare_ready(server: ServerProcess) -> tuple[int, int]:
    wait_for(lambda: spare_state(server) == "ready", 180, "the spare to be warm", server)
    return spare_pids(server)


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(("--served-model-name", "m", "--dtype", "float32", "--device", "cpu",
                            "--max-model-len", "256", "--kv-cache-memory-bytes", "33554432",
                            "--enable-fault-injection", "--ft-hang-timeout-s", "10"))
    try:
        server.wait_healthy(300)
        yield server
        assert server.stop() == 0, server.log_tail()
    finally:
        server.kill_tree()


def serving(server: ServerProcess) -> dict:
    """The engine's status, checked against the process titles: its pids are the serving
    ones (a promoted spare takes its role's title)."""
    # NOTE: read again for a moment: once (1 run in 9 on a loaded host) no process showed
    # the worker's title right after a recovery, with the status already right.
    deadline = time.monotonic() + 5.0
    while True:
        engine, titles = status(server)[0], pids_by_title(server)
        expected = (titles.get("bastion::engine-0"), [titles.get("bastion::worker-0-0")])
        if (engine["pid"], engine["worker_pids"]) == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (engine["pid"], engine["worker_pids"]) == expected, (engine, titles)
    return engine


def kill_twice_with_streams_in_flight(server: ServerProcess, reference: dict
                                      ) -> list[tuple[float, dict, dict]]:
    """With streams under way, SIGKILL the serving engine, and once it recovered, at once its
    worker (by the pids the status reports). Per kill: the recovery's time and the engine's
    status before and after it."""
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(server, p, out, p)) for p in PROMPTS]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(out.get(p + ":times", [])) >= 2 for p in PROMPTS), 60, "streams")
    kills = []
    for role in ("engine", "worker"):
        before = serving(server)
        assert before["state"] == "healthy"
        t0 = time.monotonic()
        os.kill(before["pid"] if role == "engine" else before["worker_pids"][0], signal.SIGKILL)
        wait_for(lambda e=before["epoch"]: status(server)[0]["state"] == "healthy"
                 and status(server)[0]["epoch"] > e, 180, "recovery", server)
        recovered_s = time.monotonic() - t0
        after = serving(server)
        assert {"spawn_or_promote", "load", "kv_cache", "graphs", "rejoin", "total"} <= set(
            after["last_recovery_phases"])
        print(f"\nkill -9 the {role} (spare {before['spare']}, streams in flight: "
              f"{sum(t.is_alive() for t in threads)}): healthy again after {recovered_s:.2f} s; "
              f"phases {after['last_recovery_phases']}")
        kills.append((recovered_s, before, after))
    for t in threads:
        t.join(300)
    assert {p: out[p] for p in PROMPTS} == {p: reference[p] for p in PROMPTS}
    return kills


def spawn_and_ready_times(log: str) -> list[dict[str, float]]:
    """Per spare set, in start order: each spare's spawn and ready times (epoch seconds) and
    the engine spare's own warm-up."""
    sets: list[dict[str, float]] = []
    pending: dict[str, float] = {}
    for stamp, who, age, own in _READY.findall(log):
        ready = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        pending[f"{who}_ready"], pending[f"{who}_spawn"] = ready, ready - float(age)
        if who == "engine-0":  # says ready after its worker spare
            sets.append({**pending, "engine_own": float(own)})
            pending = {}
    return sets


def test_kill_9_promotes_the_spare_even_warming_and_a_killed_idle_spare_is_replaced(server):
    reference: dict = {}
    stream_all(server, PROMPTS, reference, stream)

    for _ in range(NUM_ROUNDS):
        spare = wait_spare_ready(server)
        (engine_s, _, promoted), (worker_s, warming, after) = kill_twice_with_streams_in_flight(
            server, reference)
        # The spare became the engine and its worker spare the worker (same processes, new
        # titles), and the next spare set started right after the promotion...
        assert engine_s < MAX_RECOVERY_S
        assert (promoted["pid"], promoted["worker_pids"]) == (spare[0], [spare[1]])
        assert "spare_wait" not in promoted["last_recovery_phases"]
        # ... so the worker's kill found it warming up: the promotion waited for it, being
        # ahead of a cold start, and the fault names the promoted worker by its serving title.
        assert warming["spare"] == "warming"
        assert worker_s < MAX_RECOVERY_WARMING_S
        assert after["pid"] not in (spare[0], promoted["pid"])
        assert after["last_recovery_phases"]["spare_wait"] > 0
        log = server.log_tail(10_000_000)
        assert "promoting the warm spare while it is still warming up" in log
        # (The busy loop's WorkerFailure or the control thread's check: either names it.)
        assert re.findall(r"fault detected: .*?(bastion::\S+) exited with code -9", log)[-1] == (
            "bastion::worker-0-0")

    # Every set's worker spare started with the engine spare, not after its imports.
    idle = wait_spare_ready(server)
    sets = spawn_and_ready_times(server.log_tail(10_000_000))
    assert len(sets) == 1 + 2 * NUM_ROUNDS, sets
    for s in sets:
        offset = s["worker-0-0_spawn"] - s["engine-0_spawn"]
        print(f"\nspare set: worker spare spawned {offset:.2f} s after the engine spare; "
              f"ready after {s['worker-0-0_ready'] - s['worker-0-0_spawn']:.1f} s and "
              f"{s['engine-0_ready'] - s['engine-0_spawn']:.1f} s")
        assert offset < s["engine_own"] / 2, s
        assert s["worker-0-0_spawn"] < s["engine-0_ready"] and s["worker-0-0_ready"] > (
            s["engine-0_spawn"])

    # A worker spare that dies while idle takes its set with it, and the set is replaced;
    # the engine serves on at the same epoch, never paused.
    before = status(server)[0]
    num_faults = server.log_tail(10_000_000).count("fault detected")
    os.kill(idle[1], signal.SIGKILL)
    out: dict = {}
    during = threading.Thread(target=stream, args=(server, PROMPTS[0], out, "during"))
    during.start()
    states, deadline = set(), time.monotonic() + 180
    while during.is_alive() or spare_pids(server) in (None, idle):
        engine = status(server)[0]
        states.add((engine["state"], engine["epoch"], engine["pid"]))
        assert time.monotonic() < deadline, "no replacement spare within 180 s"
        time.sleep(0.1)
    assert states == {("healthy", before["epoch"], before["pid"])}
    assert out["during"] == reference[PROMPTS[0]]
    assert server.log_tail(10_000_000).count("fault detected") == num_faults
    assert "its worker spare worker-0-0 exited with code -9; exiting, to be replaced" in (
        server.log_tail(10_000_000))


def test_a_hello_read_early_marks_the_spare_ready_and_is_answered_at_promotion(tmp_path):
    """The sentinel reads a spare's HELLO as it comes (the spare is ready) without answering;
    the promotion answers it then, and counts no wait. A HELLO that comes only during the
    promotion (a spare still warming up) is waited for, and the wait is measured."""
    import zmq

    from bastion.ipc.codec import encode
    from bastion.ipc.control import HandshakeInfo
    from bastion.ipc.messages import Ready
    from bastion.procs.lifecycle import Child, HandshakeServer, child_handshake

    class Alive:
        returncode = None

        def poll(self) -> None:
            return None

    ctx = zmq.Context()
    sockets = []

    def child(rank: int, delay_s: float) -> None:
        time.sleep(delay_s)
        sock, info = child_handshake(ctx, server.address, "worker", rank)
        sockets.append(sock)
        sock.send_multipart(encode(Ready("worker", rank, os.getpid(), {"rank": info.rank})))

    server = HandshakeServer(ctx, f"ipc://{tmp_path}/hs")
    try:
        early = threading.Thread(target=child, args=(0, 0.0))
        early.start()
        wait_for(lambda: (server.poll_hellos(), 0 in server.hello_at)[1], 10, "the HELLO")
        assert not sockets  # read, not answered: the spare still waits for its launch
        late = threading.Thread(target=child, args=(1, 0.5))
        late.start()
        t0 = time.monotonic()
        children = [Child("worker", r, f"bastion::spare-worker-0-{r}", Alive()) for r in (0, 1)]
        ready = server.run(children, {r: HandshakeInfo(b"{}", rank=r) for r in (0, 1)}, 10)
        assert {r: m.info["rank"] for r, m in ready.items()} == {0: 0, 1: 1}
        assert server.hello_at[0] < t0 < server.hello_at[1]
        early.join()
        late.join()
    finally:
        for sock in sockets:
            sock.close(linger=0)
        server.close()
        ctx.term()
