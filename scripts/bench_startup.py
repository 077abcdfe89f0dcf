"""How long ``bastion serve`` takes to start, to stop, and to exit once its engine group is dead,
beside the floor: one bare interpreter importing torch, measured in the same run (a server's
process tree, API -> sentinel -> engine -> worker, cannot come up faster than one such import).

    python scripts/bench_startup.py [--repeats 3] [-- extra serve flags]

Each repeat starts the embedded model on the CPU (no warm spares: a cold start), waits for
``/health``, stops it with SIGTERM and times each process's exit; then starts one more with
``--ft-max-attempts 1 --ft-recovery-timeout-s 0.5``, SIGKILLs its engine, and times the exit.
Prints medians.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

SERVE = ("--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
         "--kv-cache-memory-bytes", "268435456", "--ft-warm-spares", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> dict[int, str]:
    """Descendants of ``pid`` by process title (their /proc cmdline)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        found[child] = f.read().split(b"\0")[0].decode() or str(child)
                except OSError:
                    continue
                frontier.append(child)
    return found


def is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class Server:
    def __init__(self, extra: list[str], log_dir: str) -> None:
        self.port = free_port()
        self.log = open(os.path.join(log_dir, f"serve-{self.port}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bastion.procs.cli", "serve", "--port", str(self.port),
             *SERVE, *extra], stdout=self.log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    def wait_healthy(self, timeout_s: float = 300) -> float:
        while time.monotonic() - self.started < timeout_s:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return time.monotonic() - self.started
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"no /health within {timeout_s} s (log {self.log.name})")

    def exits(self, action) -> dict[str, float]:
        """Run ``action`` and time until each process of the tree is gone."""
        tree = {**children(self.proc.pid), self.proc.pid: "api"}
        titles = {pid: title.removeprefix("bastion::").split("-")[0] for pid, title in tree.items()}
        t0 = time.monotonic()
        action()
        gone: dict[str, float] = {}
        while len(gone) < len(tree) and time.monotonic() - t0 < 60:
            for pid in tree:
                if titles[pid] not in gone and pid != self.proc.pid and is_gone(pid):
                    gone[titles[pid]] = time.monotonic() - t0
            if self.proc.poll() is not None:
                gone.setdefault("api", time.monotonic() - t0)
            time.sleep(0.005)
        self.proc.wait(60)
        return gone


def torch_import_s() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more `bastion serve` flags (after --)")
    args = parser.parse_args()
    log_dir = tempfile.mkdtemp(prefix="bench-startup-")
    floor = statistics.median(torch_import_s() for _ in range(3))
    starts, stops = [], []
    for _ in range(args.repeats):
        server = Server(args.extra, log_dir)
        starts.append(server.wait_healthy())
        stops.append(server.exits(lambda s=server: s.proc.send_signal(signal.SIGTERM)))
    server = Server(["--ft-max-attempts", "1", "--ft-recovery-timeout-s", "0.5", *args.extra],
                    log_dir)
    server.wait_healthy()
    engine = next(pid for pid, title in children(server.proc.pid).items()
                  if title.startswith("bastion::engine"))
    dead = server.exits(lambda: os.kill(engine, signal.SIGKILL))
    print(f"logs: {log_dir}")
    print(f"{'what':<40} {'seconds':>8}")
    floor_name = 'floor: python -c "import torch"'
    print(f"{floor_name:<40} {floor:>8.2f}")
    print(f"{'start -> /health (median)':<40} {statistics.median(starts):>8.2f}")
    for name in ("worker", "engine", "sentinel", "api"):
        values = [s[name] for s in stops if name in s]
        if values:
            print(f"{'SIGTERM -> ' + name + ' gone (median)':<40} {statistics.median(values):>8.2f}")
    print(f"{'engine SIGKILL, group dead -> api exit':<40} {dead.get('api', float('nan')):>8.2f}")


if __name__ == "__main__":
    main()
