"""Fault-tolerance drill: per fault kind, time to detect, time to recover, the recovery's
phases as the coordinator measured them, and how many in-flight streamed requests completed
with the fault-free greedy tokens.

    python scripts/ft_drill.py --base-url http://127.0.0.1:8000 --engine 1 \
        --kinds raise worker_exit hang kill_worker kill_engine [--repeat 50]

The server must run with --enable-fault-injection (kill_* kinds need it on this host).
Recovered means: every engine healthy, the faulted one at a new epoch (a dense DP engine
recovers alone; the others keep their epoch). ``--repeat N`` runs the kinds in turn N times
(the stress drill) and prints the slowest recovery last. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request


def _request(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def stream(base: str, model: str, prompt: str, max_tokens: int, out: dict, key: object,
           started: threading.Event) -> None:
    req = urllib.request.Request(
        base + "/v1/completions",
        json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    pieces = []
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        pieces.append("<error>")
                    elif event["choices"]:
                        pieces.append(event["choices"][0]["text"])
                        started.set()
    except Exception as exc:  # counted as not completed
        pieces.append(f"<{exc}>")
    out[key] = "".join(pieces)


def statuses(base: str) -> list[dict]:
    return _request(base + "/fault_tolerance/status")["engines"]


def pid_with_title(title: str) -> int:
    out = subprocess.check_output(["pgrep", "-f", f"^{title}$"]).split()
    return int(out[0])


def fire(base: str, kind: str, engine: int) -> None:
    if kind == "kill_worker":
        os.kill(pid_with_title(f"bastion::worker-{engine}-0"), signal.SIGKILL)
    elif kind == "kill_engine":
        os.kill(pid_with_title(f"bastion::engine-{engine}"), signal.SIGKILL)
    else:
        _request(base + "/fault_tolerance/inject", {"kind": kind, "engine": engine})


def drill(base: str, model: str, kind: str, engine: int, prompts: list[str],
          max_tokens: int, reference: dict) -> dict:
    epoch = next(s["epoch"] for s in statuses(base) if s["engine_id"] == engine)
    out: dict = {}
    started = threading.Event()
    threads = [threading.Thread(target=stream, args=(base, model, p, max_tokens, out, p,
                                                     started)) for p in prompts]
    for t in threads:
        t.start()
    started.wait(120)
    t0 = time.monotonic()
    fire(base, kind, engine)
    detect = recover = None
    phases: dict = {}
    while time.monotonic() - t0 < 120:
        engines = statuses(base)
        now = time.monotonic() - t0
        if detect is None and any(s["state"] != "healthy" for s in engines):
            detect = now
        target = next(s for s in engines if s["engine_id"] == engine)
        if all(s["state"] == "healthy" for s in engines) and target["epoch"] > epoch:
            recover = now
            phases = target.get("last_recovery_phases") or {}
            break
        time.sleep(0.02)
    for t in threads:
        t.join(max(1.0, 180 - (time.monotonic() - t0)))
    ok = sum(out.get(p) == reference[p] for p in prompts)
    return {"kind": kind, "detect_s": detect, "recover_s": recover, "in_flight": len(prompts),
            "completed_same": ok, "phases": phases}


PHASES = ("spawn_or_promote", "load", "kv_cache", "graphs", "rejoin")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--engine", type=int, default=0)
    parser.add_argument("--kinds", nargs="+",
                        default=["raise", "worker_exit", "hang", "kill_worker", "kill_engine"])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="run the kinds in turn N times")
    args = parser.parse_args()
    base = args.base_url
    model = _request(base + "/v1/models")["data"][0]["id"]
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(args.num_requests)]
    reference: dict = {}
    never = threading.Event()
    threads = [threading.Thread(target=stream, args=(base, model, p, args.max_tokens,
                                                     reference, p, never)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    names = " ".join(f"{p[:8]:>8}" for p in PHASES)
    print(f"{'fault':<12} {'detect s':>9} {'recover s':>10} {names} {'in flight':>10} "
          f"{'completed':>10}", flush=True)
    slowest = 0.0
    for _ in range(args.repeat):
        for kind in args.kinds:  # one row as each drill ends, so a stuck drill leaves the others
            r = drill(base, model, kind, args.engine, prompts, args.max_tokens, reference)
            d = "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}"
            rc = "-" if r["recover_s"] is None else f"{r['recover_s']:.2f}"
            slowest = max(slowest, r["recover_s"] or float("inf"))
            phases = " ".join(f"{r['phases'].get(p, 0.0):>8.2f}" for p in PHASES)
            print(f"{r['kind']:<12} {d:>9} {rc:>10} {phases} {r['in_flight']:>10} "
                  f"{r['completed_same']:>10}", flush=True)
    if args.repeat > 1:
        print(f"slowest recovery of {args.repeat * len(args.kinds)}: {slowest:.2f} s")


if __name__ == "__main__":
    main()
