"""A real ``bastion serve`` in a subprocess, for end-to-end tests and the serving benchmark.

``ServerProcess`` launches ``python -m bastion.procs.cli serve`` with the venv's Python, waits
for ``/health``, finds the server's process tree through ``/proc`` and stops it. Each server gets
its own ``XDG_RUNTIME_DIR`` so a test can check that the runtime (ipc socket) dir is removed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

# Small enough to start fast on a 2-core CPU; the KV budget is 256 MiB (364 blocks of 16).
# NOTE: no warm spare: a spare engine and worker spare cost ~10 s of CPU each to warm up, which
# every end-to-end test would pay on a 2-core host; the fault-tolerance tests turn them on.
SMALL_SERVER_ARGS = ("--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                     "--kv-cache-memory-bytes", "268435456", "--ft-warm-spares", "0")


# Port plans of DP servers (base .. base + 134, procs/distributed.py), below Linux's ephemeral
# range (32768-60999): a plan inside it collides now and then with the local port of some
# connection, and a recovery attempt then fails on EADDRINUSE. Handed out in turn from a random
# start, so two servers of one test session (a module's server lives on while later tests of the
# module start their own) never share a plan.
_DP_BASES = list(range(20000, 32000, 150))
_dp_next = random.randrange(len(_DP_BASES))


def _first_bindable(ports: Iterable[int]) -> int | None:
    """The first of ``ports`` that 127.0.0.1 can bind now (released again at once)."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return None


def dp_base_port() -> int:
    """The next base port whose own port is free (another program may hold one)."""
    global _dp_next
    base = _first_bindable(_DP_BASES[(_dp_next + i) % len(_DP_BASES)]
                           for i in range(len(_DP_BASES)))
    if base is None:
        raise RuntimeError("no free DP base port in 20000-32000")
    _dp_next = _DP_BASES.index(base) + 1
    return base


def free_port() -> int:
    """A free port below the ephemeral range (10000-19999): a port the kernel hands out as some
    connection's local port (bind to 0) can be taken again by the next connection before the
    server binds it; this range is taken only by explicit binds."""
    port = _first_bindable(random.randrange(10000, 20000) for _ in range(200))
    if port is None:
        raise RuntimeError("no free port in 10000-19999")
    return port


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # NOTE: the command name (field 2) may hold spaces and parentheses; fields after the last
    # ')' are fixed: state, ppid, ...
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_title(pid: int) -> str | None:
    """What ``ps`` shows (setproctitle rewrites the cmdline); None when the pid is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def is_live(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(root_pid: int) -> list[int]:
    """Every live process whose parent chain leads to ``root_pid`` (not ``root_pid`` itself)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                parents[int(entry)] = ppid
    found = []
    for pid in parents:
        cur = parents.get(pid)
        while cur is not None and cur > 1:
            if cur == root_pid:
                found.append(pid)
                break
            cur = parents.get(cur)
    return sorted(pid for pid in found if is_live(pid))


def bastion_titles(pids: list[int]) -> dict[int, str]:
    """The pids among ``pids`` that are live ``bastion::`` processes, with their titles."""
    titles = {pid: process_title(pid) for pid in pids if is_live(pid)}
    return {pid: t for pid, t in titles.items() if t and t.startswith("bastion::")}


class ServerProcess:
    """One ``bastion serve`` subprocess on a free port, logging to a file."""

    def __init__(self, extra_args: tuple[str, ...] = SMALL_SERVER_ARGS,
                 api_key: str | None = None, workdir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.workdir = Path(workdir or tempfile.mkdtemp(
            prefix="bastion-e2e-", dir=os.environ.get("BASTION_TEST_LOG_DIR")))
        # NOTE: short on purpose: ipc:// socket paths must fit in 107 bytes (sun_path), and
        # pytest's tmp_path plus bastion's socket names can exceed that.
        self.runtime_base = Path(tempfile.mkdtemp(prefix="bx-", dir="/tmp"))
        self.log_path = self.workdir / "server.log"
        cmd = [sys.executable, "-m", "bastion.procs.cli", "serve", "--port", str(self.port),
               *extra_args]
        # NOTE: the DP rendezvous port is fixed by default (29550); two servers on one host
        # (this module's and the SIGKILL test's, or another suite's) would collide on it.
        if "--data-parallel-rpc-port" not in extra_args:
            cmd += ["--data-parallel-rpc-port", str(dp_base_port())]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        # The test's own systemd and key settings must not leak in; the caller's ``env`` may
        # set them (the daemon tests give a NOTIFY_SOCKET).
        inherited = {k: v for k, v in os.environ.items()
                     if k not in ("NOTIFY_SOCKET", "BASTION_API_KEY")}
        env = {**inherited, **(env or {}), "XDG_RUNTIME_DIR": str(self.runtime_base)}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (open for the server's life)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def runtime_dirs(self) -> list[str]:
        return sorted(p.name for p in self.runtime_base.glob("bastion-*"))

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        req = urllib.request.Request(self.base_url + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Poll ``/health`` until 200; raise with the log tail if the server dies or hangs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bastion serve exited with {self.proc.returncode} during "
                                   f"start-up:\n{self.log_tail()}")
            try:
                status, _ = self.get("/health", timeout=2.0)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            # NOTE: 0.1 s, not 0.5: every server start of the suite (~20) waited on average a
            # quarter second past its ready moment; until the server listens a poll is one
            # refused connection (its port is bound, not listening), after that one GET.
            time.sleep(0.1)
        raise TimeoutError(f"/health not 200 within {timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {series name with labels stripped: value}, for unlabelled-enough
        series (the single-model gauges and counters)."""
        status, body = self.get("/metrics")
        assert status == 200, body
        values: dict[str, float] = {}
        for line in body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            values[name_labels.split("{", 1)[0]] = float(value)
        return values

    def request_tables(self) -> dict[str, float]:
        """The API process's per-request tables and their sizes
        (``bastion:api_request_table_entries`` by table)."""
        _, body = self.get("/metrics")
        pattern = r'^bastion:api_request_table_entries\{[^}]*table="(\w+)"[^}]*\} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, body.decode(), re.MULTILINE)}

    def wait_request_tables_empty(self, timeout_s: float = 10.0) -> dict[str, float]:
        """The tables once all are empty, or as they are after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            tables = self.request_tables()
            assert tables, "the request-table gauge is missing from /metrics"
            if not any(tables.values()) or time.monotonic() > deadline:
                return tables
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit code (SIGKILL after ``timeout_s``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill_tree(self) -> None:
        """Last-resort cleanup: SIGKILL the server and anything left of its tree."""
        # NOTE: only while our child is unreaped: after that its pid may belong to a stranger.
        if self.proc.poll() is None:
            for pid in descendants(self.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.kill()
            self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
        self.remove_runtime_base()

    def remove_runtime_base(self) -> None:
        shutil.rmtree(self.runtime_base, ignore_errors=True)


def parse_json(body: bytes) -> dict:
    return json.loads(body.decode())
