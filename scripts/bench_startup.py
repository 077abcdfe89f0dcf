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
import statistics
import subprocess
import sys
import time
import urllib.error

# The end-to-end tests' server harness: spawn, /health, the process tree through /proc.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from serve_fixture import (
    SMALL_SERVER_ARGS,
    ServerProcess,
    descendants,
    is_live,
    process_title,
)


def time_to_health(server: ServerProcess, timeout_s: float = 300) -> float:
    """Seconds from the spawn to ``/health`` 200, polled every 20 ms (``wait_healthy`` polls
    every 0.5 s, too coarse to time a start)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if server.get("/health", timeout=1.0)[0] == 200:
                return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.02)
    raise RuntimeError(f"no /health within {timeout_s} s:\n{server.log_tail()}")


def exit_times(server: ServerProcess, action) -> dict[str, float]:
    """Run ``action`` and time until each process of the tree is gone, by role."""
    roles = {pid: (process_title(pid) or "").removeprefix("bastion::").split("-")[0]
             for pid in descendants(server.pid)}
    t0 = time.monotonic()
    action()
    gone: dict[str, float] = {}
    while len(gone) < len(roles) + 1 and time.monotonic() - t0 < 60:
        for pid, role in roles.items():
            if role not in gone and not is_live(pid):
                gone[role] = time.monotonic() - t0
        if "api" not in gone and server.proc.poll() is not None:
            gone["api"] = time.monotonic() - t0
        time.sleep(0.005)
    server.proc.wait(60)
    server.kill_tree()  # reaped by now: closes its log and removes its runtime dir
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
    floor = statistics.median(torch_import_s() for _ in range(3))
    starts, stops, logs = [], [], []
    for _ in range(args.repeats):
        server = ServerProcess((*SMALL_SERVER_ARGS, *args.extra))
        logs.append(server.log_path)
        starts.append(time_to_health(server))
        stops.append(exit_times(server, lambda s=server: s.proc.send_signal(signal.SIGTERM)))
    server = ServerProcess((*SMALL_SERVER_ARGS, "--ft-max-attempts", "1",
                            "--ft-recovery-timeout-s", "0.5", *args.extra))
    logs.append(server.log_path)
    time_to_health(server)
    engine = next(pid for pid in descendants(server.pid)
                  if (process_title(pid) or "").startswith("bastion::engine"))
    dead = exit_times(server, lambda: os.kill(engine, signal.SIGKILL))
    print("logs: " + " ".join(map(str, logs)))
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
