"""Fault-tolerance drill: per fault kind, time to detect, time to recover, the recovery's
phases as the coordinator measured them, the longest pause a stream saw, the latest first chunk
after the fault (with dense data parallelism: a moved stream's resumption), and how many
in-flight streamed requests completed (all their tokens, no error) and how many of those
carry the fault-free greedy text.

    python scripts/ft_drill.py --base-url http://127.0.0.1:8000 --engine 1 \
        --kinds none raise worker_exit hang kill_worker kill_engine [--repeat 50]

The server must run with --enable-fault-injection. Before each fault the drill waits until the
target engine's warm spare is ready (``spare`` in ``/fault_tolerance/status``; ``--no-wait-spare``
fires at once, as faults back to back would), so each row measures a promotion, not a spare's
warm-up. ``kill_worker`` and ``kill_engine`` SIGKILL the serving processes by the pids that
the status reports (never by title: a spare or another server's processes carry the same
titles). ``none`` fires nothing: its identical count is what the numerics alone give (a greedy
rerun in other batches). A stream that differs is shown with where it first differs, counted
from what it had received at the fault: in bf16 a resumed stream's recomputed prefix (one
prefill, not the decode steps that made it) can flip a near-tie later on, most often with
dummy weights; text changed before the fault (< 0) would be a resume bug.
Recovered means: every engine healthy, the faulted one at a new epoch (a dense DP engine
recovers alone; the others keep their epoch). ``--repeat N`` runs the kinds in turn N times
(the stress drill) and prints the slowest recovery last. Prints one table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field

PHASES = ("spare_wait", "spawn_or_promote", "load", "kv_cache", "graphs", "rejoin")
KILLS = ("kill_worker", "kill_engine")


def _request(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass
class Stream:
    """What one streamed completion delivered."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    pieces: list[str] = field(default_factory=list)  # each chunk's text
    times: list[float] = field(default_factory=list)  # and its arrival

    def num_chars_before(self, t: float) -> int:
        return sum(len(p) for p, at in zip(self.pieces, self.times) if at < t)

    def is_complete(self, max_tokens: int) -> bool:
        return (self.error is None and self.finish_reason == "length"
                and self.num_tokens == max_tokens)

    def first_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the first chunk after it (None if none came)."""
        return next((at - t for at in self.times if at >= t), None)

    @property
    def max_gap(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.times)), default=0.0)


def stream(base: str, model: str, prompt: str, max_tokens: int, out: dict, key: object,
           started: threading.Event) -> None:
    req = urllib.request.Request(
        base + "/v1/completions",
        json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}).encode(),
        {"Content-Type": "application/json"})
    result = Stream()
    pieces = result.pieces
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error")
                if event.get("usage"):
                    result.num_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        pieces.append(choice["text"])
                        result.times.append(time.monotonic())
                        started.set()
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except Exception as exc:  # noqa: BLE001 - counted as not completed
        result.error = f"{type(exc).__name__}: {exc}"
    result.text = "".join(pieces)
    out[key] = result


def run_streams(base: str, model: str, prompts: list[str], max_tokens: int, out: dict,
                started: threading.Event) -> list[threading.Thread]:
    threads = [threading.Thread(target=stream, args=(base, model, p, max_tokens, out, p,
                                                     started)) for p in prompts]
    for t in threads:
        t.start()
    return threads


def statuses(base: str) -> list[dict]:
    return _request(base + "/fault_tolerance/status")["engines"]


def engine_status(base: str, engine: int) -> dict:
    return next(s for s in statuses(base) if s["engine_id"] == engine)


def wait_spare_ready(base: str, engine: int, timeout_s: float) -> float:
    """Seconds until the engine's warm spare is ready (at once without spares)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        target = engine_status(base, engine)
        if target["state"] == "healthy" and target.get("spare") in ("ready", "off"):
            break
        time.sleep(0.1)
    else:
        print(f"(engine {engine}'s spare not ready within {timeout_s:.0f} s; firing anyway)")
    return time.monotonic() - t0


def fire(base: str, kind: str, engine: int) -> None:
    if kind in KILLS:
        target = engine_status(base, engine)
        if "pid" not in target:
            raise SystemExit("this server's /fault_tolerance/status reports no pids; "
                             "kill_* kinds need them")
        pid = target["worker_pids"][0] if kind == "kill_worker" else target["pid"]
        os.kill(pid, signal.SIGKILL)
    elif kind != "none":
        _request(base + "/fault_tolerance/inject", {"kind": kind, "engine": engine})


def drill(base: str, model: str, kind: str, engine: int, prompts: list[str],
          max_tokens: int, reference: dict, spare_timeout_s: float | None) -> dict:
    spare_s = 0.0 if spare_timeout_s is None else wait_spare_ready(base, engine,
                                                                   spare_timeout_s)
    epoch = engine_status(base, engine)["epoch"]
    out: dict = {}
    started = threading.Event()
    threads = run_streams(base, model, prompts, max_tokens, out, started)
    started.wait(120)
    t0 = time.monotonic()
    fire(base, kind, engine)
    detect = recover = None
    phases: dict = {}
    while kind != "none" and time.monotonic() - t0 < 120:
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
    results = [out.get(p, Stream(error="no result")) for p in prompts]
    complete = [(r, reference[p]) for p, r in zip(prompts, results)
                if r.is_complete(max_tokens)]
    # Where each completed stream that differs first differs, in characters after the text it
    # had received when the fault fired: < 0 would mean text before the fault changed.
    after = [len(os.path.commonprefix([r.text, ref.text])) - r.num_chars_before(t0)
             for r, ref in complete if r.text != ref.text]
    return {"kind": kind, "spare_s": spare_s, "detect_s": detect, "recover_s": recover,
            "phases": phases, "in_flight": len(prompts), "completed": len(complete),
            "identical": len(complete) - len(after), "differ_after": after,
            "max_gap_s": max(r.max_gap for r in results),
            # A moved stream's (dense DP) or a paused one's first chunk after the fault.
            "resume_s": max((x for r in results if (x := r.first_after(t0)) is not None),
                            default=None),
            "errors": sorted({r.error for r in results if r.error})}


def _cell(value: float | None, width: int) -> str:
    return f"{'-' if value is None else f'{value:.2f}':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--engine", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=["none", "raise", "worker_exit", "hang",
                                                       *KILLS])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="run the kinds in turn N times")
    parser.add_argument("--spare-timeout-s", type=float, default=120.0,
                        help="wait at most this long for the spare before each fault")
    parser.add_argument("--no-wait-spare", action="store_true",
                        help="fire each fault at once (back to back), spare ready or not")
    args = parser.parse_args()
    base = args.base_url
    model = _request(base + "/v1/models")["data"][0]["id"]
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(args.num_requests)]
    reference: dict = {}
    for t in run_streams(base, model, prompts, args.max_tokens, reference, threading.Event()):
        t.join(300)
    bad = [p for p in prompts if not reference[p].is_complete(args.max_tokens)]
    if bad:
        raise SystemExit(f"the fault-free reference run did not complete: {reference[bad[0]]}")
    names = " ".join(f"{p[:8]:>8}" for p in PHASES)
    print(f"{'fault':<12} {'spare s':>8} {'detect s':>9} {'recover s':>10} {names} "
          f"{'max gap s':>9} {'resume s':>9} {'in flight':>9} {'completed':>9} "
          f"{'identical':>9}", flush=True)
    slowest = 0.0
    spare_timeout = None if args.no_wait_spare else args.spare_timeout_s
    for _ in range(args.repeat):
        for kind in args.kinds:  # one row as each drill ends, so a stuck drill leaves the others
            r = drill(base, model, kind, args.engine, prompts, args.max_tokens, reference,
                      spare_timeout)
            if kind != "none":
                slowest = max(slowest, r["recover_s"] or float("inf"))
            phases = " ".join(f"{r['phases'].get(p, 0.0):>8.2f}" for p in PHASES)
            print(f"{r['kind']:<12} {r['spare_s']:>8.2f} {_cell(r['detect_s'], 9)} "
                  f"{_cell(r['recover_s'], 10)} {phases} {r['max_gap_s']:>9.2f} "
                  f"{_cell(r['resume_s'], 9)} "
                  f"{r['in_flight']:>9} {r['completed']:>9} {r['identical']:>9}", flush=True)
            for error in r["errors"]:
                print(f"    {kind}: a stream ended with: {error}", flush=True)
            if r["differ_after"]:
                print(f"    {kind}: {len(r['differ_after'])} completed stream(s) differ from the "
                      f"reference, first at {sorted(r['differ_after'])} characters after what "
                      "they had at the fault", flush=True)
    if args.repeat > 1:
        print(f"slowest recovery of {args.repeat * len(args.kinds)}: {slowest:.2f} s")


if __name__ == "__main__":
    main()
