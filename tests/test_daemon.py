"""Running as a systemd daemon: sd_notify order, watchdog, graceful drain and exit codes, and
no child process outliving a killed main process."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request

from serve_fixture import (
    SMALL_SERVER_ARGS,
    ServerProcess,
    bastion_titles,
    descendants,
    is_live,
    process_title,
)

STREAM_BODY = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "Once upon a time",
               "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}


def start_server(notify_path: str, *extra: str, watchdog_usec: int) -> ServerProcess:
    """``bastion serve`` as systemd starts it: a notify socket and a watchdog interval."""
    return ServerProcess((*SMALL_SERVER_ARGS, *extra),
                         env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": str(watchdog_usec)})


def receive(sock: socket.socket, until: str, timeout_s: float) -> list[str]:
    """Datagrams (split into assignments) until one contains ``until``."""
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = sock.recv(4096).decode()
        except TimeoutError:
            break
        got.extend(data.splitlines())
        if any(until in line for line in data.splitlines()):
            return got
    raise AssertionError(f"never received {until!r}; got {got}")


def stream(port: int, out: list, key: int, started: threading.Semaphore) -> None:
    """Stream ``STREAM_BODY``; release ``started`` at the first token."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(STREAM_BODY).encode(),
                                 {"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("choices"):
                    text.append(event["choices"][0]["text"])
                    if len(text) == 1:
                        started.release()
            elif line == "data: [DONE]":
                text.append("[DONE]")
    out[key] = "".join(text)


def test_notify_order_drain_on_sigterm_and_exit_zero(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    server = start_server(path, "--drain-timeout", "120", watchdog_usec=2_000_000)
    try:
        before_ready = receive(sock, "READY=1", 180)
        assert "STATUS=loading" in before_ready
        after = receive(sock, "WATCHDOG=1", 10)  # pings every WATCHDOG_USEC / 2
        assert "STATUS=serving" in before_ready + after
        results: list = [None] * 3
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=stream, args=(server.port, results, i, started))
                   for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:  # every stream has its first token and 47 to go
            assert started.acquire(timeout=120)
        server.proc.send_signal(signal.SIGTERM)
        draining = receive(sock, "STATUS=draining", 10)
        assert draining
        # New requests are refused while the old ones finish.
        req = urllib.request.Request(f"{server.base_url}/v1/completions",
                                     json.dumps({**STREAM_BODY, "stream": False}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("a new request was admitted while draining")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
            assert exc.headers.get("Retry-After")
            assert json.loads(exc.read())["error"]["code"] == "server_draining"
        for t in threads:
            t.join(300)
        assert all(r is not None and r.endswith("[DONE]") and len(r) > 20 for r in results)
        stopping = receive(sock, "STOPPING=1", 60)
        assert stopping
        assert server.proc.wait(60) == 0, server.log_tail(3000)
    finally:
        server.kill_tree()
        sock.close()


def test_watchdog_stops_while_an_engine_is_hung_and_sigkill_takes_the_children(tmp_path):
    """The watchdog pings stop while the engine is hung; systemd then kills the main process
    (``WatchdogSignal``, SIGKILL in the end), and no ``bastion::`` child may outlive it: each
    dies of its parent-death signal, the hung engine too."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    server = start_server(path, "--enable-fault-injection", "--no-ft-auto-recovery",
                          "--ft-hang-timeout-s", "3", watchdog_usec=1_000_000)
    try:
        receive(sock, "READY=1", 180)
        receive(sock, "WATCHDOG=1", 5)
        req = urllib.request.Request(f"{server.base_url}/fault_tolerance/inject",
                                     json.dumps({"kind": "hang", "engine": 0}).encode(),
                                     {"Content-Type": "application/json"})
        assert urllib.request.urlopen(req, timeout=10).status == 200
        receive(sock, "STATUS=unhealthy", 30)
        sock.settimeout(0.2)
        while True:  # drain what was sent before the hang was seen
            try:
                sock.recv(4096)
            except TimeoutError:
                break
        quiet_until = time.monotonic() + 3.0
        pings = []
        while time.monotonic() < quiet_until:
            try:
                pings.append(sock.recv(4096).decode())
            except TimeoutError:
                pass
        assert not any("WATCHDOG=1" in p for p in pings), pings

        children = bastion_titles(descendants(server.pid))
        assert {"bastion::sentinel-0", "bastion::engine-0", "bastion::worker-0-0"} <= set(
            children.values()), children
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(is_live(pid) for pid in children):
            time.sleep(0.1)
        assert not bastion_titles(list(children)), "children outlived a SIGKILLed API process"
    finally:
        server.kill_tree()
        sock.close()


def test_unrecoverable_engine_death_exits_non_zero():
    server = ServerProcess((*SMALL_SERVER_ARGS, "--ft-max-attempts", "1",
                            "--ft-recovery-timeout-s", "0.5"))
    try:
        server.wait_healthy(180)
        engine = next(p for p in descendants(server.pid)
                      if (process_title(p) or "").startswith("bastion::engine"))
        os.kill(engine, signal.SIGKILL)
        assert server.proc.wait(120) != 0
        assert server.runtime_dirs() == []
    finally:
        server.kill_tree()
