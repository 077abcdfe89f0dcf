"""Serving benchmark in the manner of ``vllm bench serve``: random prompts streamed through
``/v1/completions`` with ``ignore_eos``; TTFT, TPOT, ITL and E2E latency, request and token
throughput, printed as one table.

Against a running server:

    .venv/bin/python scripts/bench_serve.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 64 --random-input-len 128 --random-output-len 64 --request-rate inf

Launching the server itself and comparing with the in-process ``LLM`` on the same workload
(the served-path overhead; the target is a loss below 10 %):

    .venv/bin/python scripts/bench_serve.py --launch --compare-offline \\
        --server-args "--dtype float32 --max-model-len 1024"

Prompts are random token ids (sent as token ids, so the input length is exact); ``--seed``
fixes them. ``--request-rate inf`` sends everything at once; a finite rate draws Poisson
arrivals; ``--max-concurrency`` caps requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str = ""


# ----------------------------------------------------------------------------------- workload


def random_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int, vocab_size: int = 10000) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) pairs; lengths uniform in ``len * [1 - r, 1 + r]`` as in
    vLLM's random dataset."""
    rng = random.Random(seed)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))

    work = []
    for _ in range(num_prompts):
        num_in, num_out = length(input_len), length(output_len)
        work.append(([rng.randint(100, vocab_size - 1) for _ in range(num_in)], num_out))
    return work


# ------------------------------------------------------------------------------------ client


async def send_one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                   max_tokens: int, headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(num_prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    return result
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.num_output_tokens > 0
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(args: argparse.Namespace, work: list[tuple[list[int], int]], model: str
                   ) -> tuple[list[RequestResult], float]:
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(work))
    rng = np.random.default_rng(args.seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def limited(prompt: list[int], max_tokens: int) -> RequestResult:
            async with limit:
                return await send_one(session, url, model, prompt, max_tokens, headers)

        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


# ---------------------------------------------------------------------------------- reporting


def _stats_ms(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return 0.0, 0.0, 0.0
    arr = np.asarray(values) * 1000
    return float(arr.mean()), float(np.median(arr)), float(np.percentile(arr, 99))


def print_report(args: argparse.Namespace, results: list[RequestResult], duration: float
                 ) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    num_in = sum(r.num_prompt_tokens for r in ok)
    num_out = sum(r.num_output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    summary = {"duration": duration, "completed": len(ok), "output_throughput": num_out / duration,
               "request_throughput": len(ok) / duration}
    rows = [("Successful requests:", len(ok)),
            ("Failed requests:", len(results) - len(ok)),
            ("Maximum request concurrency:", args.max_concurrency),
            ("Request rate (req/s):", args.request_rate),
            ("Benchmark duration (s):", f"{duration:.2f}"),
            ("Total input tokens:", num_in),
            ("Total generated tokens:", num_out),
            ("Request throughput (req/s):", f"{len(ok) / duration:.2f}"),
            ("Output token throughput (tok/s):", f"{num_out / duration:.2f}"),
            ("Total token throughput (tok/s):", f"{(num_in + num_out) / duration:.2f}")]
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    for name, value in rows:
        print(f"{name:<40}{value!s:>10}")
    sections = [("Time to First Token", "TTFT", [r.ttft for r in ok]),
                ("Time per Output Token (excl. 1st token)", "TPOT", tpots),
                ("Inter-token Latency", "ITL", [x for r in ok for x in r.itls]),
                ("End-to-end Latency", "E2EL", [r.e2e for r in ok])]
    for title, short, values in sections:
        mean, median, p99 = _stats_ms(values)
        print("{s:{c}^50}".format(s=f" {title} ", c="-"))
        for label, value in (("Mean", mean), ("Median", median), ("P99", p99)):
            print(f"{f'{label} {short} (ms):':<40}{value:>10.2f}")
    print("=" * 50)
    errors = sorted({r.error for r in results if not r.ok})
    for error in errors[:5]:
        print(f"error: {error}")
    return summary


# --------------------------------------------------------------------------- server / offline


def launch_server(args: argparse.Namespace) -> subprocess.Popen:
    """``bastion serve`` on ``--base-url``'s port with ``--server-args``; waits for /health."""
    port = args.base_url.rstrip("/").rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "bastion.procs.cli", "serve", "--port", port,
           *shlex.split(args.server_args)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log = open(args.server_log, "wb")  # noqa: SIM115 (the server writes it until stopped)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {args.server_log}")
        try:
            with urllib.request.urlopen(args.base_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not healthy within 600 s; see {args.server_log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def served_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    req = urllib.request.Request(args.base_url + "/v1/models", headers=(
        {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}))
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def run_offline(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> float:
    """The same workload through the in-process ``LLM`` with the server's engine flags;
    returns output tokens per second."""
    from bastion import LLM, SamplingParams
    from bastion.procs.cli import build_parser, engine_kwargs

    parsed = build_parser().parse_args(["serve", *shlex.split(args.server_args)])
    kwargs = engine_kwargs(parsed)
    if parsed.model_tag and not kwargs.get("model"):
        kwargs["model"] = parsed.model_tag
    llm = LLM(**kwargs)
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in work]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params)
    seconds = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"offline LLM: {len(work)} requests, {num_out} output tokens in {seconds:.2f} s = "
          f"{num_out / seconds:.2f} tok/s")
    return num_out / seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first listed)")
    p.add_argument("--api-key", default=os.environ.get("BASTION_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--launch", action="store_true", help="start bastion serve on --base-url")
    p.add_argument("--server-args", default="--dtype float32 --max-model-len 1024",
                   help="engine flags of the launched server (and of --compare-offline)")
    p.add_argument("--server-log", default="/tmp/bastion-bench-serve.log")
    p.add_argument("--compare-offline", action="store_true",
                   help="also run the workload through the in-process LLM")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = random_workload(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.seed)
    proc = launch_server(args) if args.launch else None
    try:
        model = served_model(args)
        # A short warm-up request, as vLLM does, so start-up costs stay out of the numbers.
        asyncio.run(run_load(argparse.Namespace(**{**vars(args), "request_rate": float("inf"),
                                                   "max_concurrency": None}),
                             [(work[0][0], 4)], model))
        results, duration = asyncio.run(run_load(args, work, model))
    finally:
        if proc is not None:
            stop_server(proc)  # before the offline run, so the two never share the CPU
    summary = print_report(args, results, duration)
    if args.compare_offline:
        offline = run_offline(args, work)
        served = summary["output_throughput"]
        print(f"served {served:.2f} tok/s vs offline {offline:.2f} tok/s: served path keeps "
              f"{100 * served / offline:.1f}% (loss {100 * (1 - served / offline):.1f}%)")
    return 0 if summary["completed"] == len(work) else 1


if __name__ == "__main__":
    sys.exit(main())
