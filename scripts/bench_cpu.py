"""The embedded SmolLM2-135M on the CPU: bastion against transformers and llama.cpp (issue #26).

The issue's measurement, bastion's default CPU path only (about 3 minutes on a quiet 2-core
machine), one command:

    .venv/bin/python scripts/bench_cpu.py

Every engine gets the same GGUF file and the same token ids, greedy, ``--new-tokens`` (128) new
tokens with EOS ignored, at 1 and 2 threads, batch 1 (one 64-token prompt) and batch 16 (16
prompts of 64-256 random token ids, seed 0); the figure is output tokens over the wall time of
one whole generate call, prefill included (bastion runs without prefix caching, so a repeat
prefills again), the median of ``--repeats`` (3) after one short warm-up. Each (engine, threads)
pair runs in its own process, so thread pools never mix. The last rows are the issue's llama.cpp
figures, and each bastion cell says how far it is from the one of its thread count.

Engines (``--engines``; the default is ``bastion`` alone): bastion's ``LLM`` with its CPU default
(GGUF weights kept quantized, float32 activations, the C kernels of ops/cpu), ``bastion-served``
(the same default behind ``bastion serve``, ``--cpu-threads`` threads in its worker, each batch
as concurrent ``/v1/completions`` requests), ``bastion-ref``
(the offline default with ``BASTION_CPU_KERNELS=0``: the torch references, for an A/B of the kernels),
``bastion-f32`` (``--dtype float32``, the dequantized path); transformers ``generate`` in float32
(batch 16 with left padding); llama.cpp through ``llama-cpp-python`` when it is installed (batch
1 only: its Python API decodes one sequence; a printed note otherwise). Each extra engine adds
1-5 minutes.

Beside each row: which CPU path ran (bastion's start-up line), the bytes of weights the engine
reads per decode step (``MB/step``), and the floor, the batch-1 speed that reading them at the
measured memory bandwidth would allow (``--threads`` threads copying a 256 MB buffer; KV-cache
reads and compute are left out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ENGINES = ("bastion", "bastion-served", "bastion-ref", "bastion-f32", "transformers",
           "llama.cpp")
# The issue's llama.cpp figures (tok/s), by threads: batch 1 (llama-cli), batch 16 (llama-server,
# 16 slots).
LLAMA_CPP_ISSUE = {1: {1: 63.9, 16: 66.2}, 2: {1: 95.9, 16: 119.8}}


def workload(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if batch == 1:
        return [[rng.randint(1000, 40000) for _ in range(64)]]
    return [[rng.randint(1000, 40000) for _ in range(rng.randint(64, 256))] for _ in range(batch)]


def memory_bandwidth_gbs(threads: int) -> float:
    """Read + write bytes per second of a 256 MB ``copy_`` (best of 5)."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def _timed(run, repeats: int, warmup=None) -> float:
    (warmup or run)()  # first-use conversions, allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_bastion(
    dtype: str, threads: int, batches: list[int], new_tokens: int, repeats: int
) -> list[dict]:
    from bastion.core.loader import weight_bytes_per_step
    from bastion.ipc.messages import SamplingParams
    from bastion.ops.cpu import describe_cpu_path
    from bastion.procs.llm import LLM

    llm = LLM(dtype=dtype, max_model_len=512, cpu_threads=threads, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cpu_path = describe_cpu_path(runner.dtype).split(" (")[0]
    rows = []
    for batch in batches:
        prompts = [{"prompt_token_ids": p} for p in workload(batch)]
        seconds = _timed(lambda p=prompts: llm.generate(p, sp, use_tqdm=False), repeats,
                         lambda p=prompts: llm.generate(p, short, use_tqdm=False))
        rows.append(
            {
                "batch": batch,
                "tok_s": batch * new_tokens / seconds,
                "bytes_per_step": weight_bytes_per_step(runner.model),
                "cpu_path": cpu_path,
            }
        )
    return rows


def run_bastion_served(threads: int, batches: list[int], new_tokens: int,
                       repeats: int) -> list[dict]:
    """``bastion serve`` with its CPU default (``--cpu-threads`` threads in the worker), each
    batch as that many concurrent ``/v1/completions`` requests of token ids; the time is from
    the first request sent to the last response read."""
    import re
    import socket
    import tempfile
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as sock:  # a free port, held by nobody once the server binds it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    server = subprocess.Popen(
        [sys.executable, "-m", "bastion.procs.cli", "serve", "--served-model-name", "m",
         "--port", str(port), "--max-model-len", "512", "--no-enable-prefix-caching",
         "--cpu-threads", str(threads)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bastion serve did not start; log {log.name}") from None
                time.sleep(0.5)

        def complete(prompt: list[int], max_tokens: int) -> None:
            body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(base + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                usage = json.loads(resp.read())["usage"]
            if usage["completion_tokens"] != max_tokens:
                raise RuntimeError(f"asked {max_tokens} tokens, got {usage}")

        rows = []
        with ThreadPoolExecutor(max(batches)) as pool:
            for batch in batches:
                prompts = workload(batch)

                def run(prompts=prompts, n=new_tokens) -> None:
                    list(pool.map(lambda p: complete(p, n), prompts))

                seconds = _timed(run, repeats, lambda p=prompts: run(p, 8))
                rows.append({"batch": batch, "tok_s": batch * new_tokens / seconds})
        log.seek(0)
        text = log.read()
        mb = re.search(r"([\d.]+) MB read per decode step", text)
        path = re.search(r"CPU kernels: ([^(\n]+)", text)
        for row in rows:
            row["bytes_per_step"] = float(mb.group(1)) * 1e6 if mb else float("nan")
            row["cpu_path"] = path.group(1).strip() if path else "-"
        return rows
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        os.unlink(log.name)


def run_transformers(threads: int, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from bastion.core.loader.embedded import embedded_gguf_path

    torch.set_num_threads(threads)
    folder, name = os.path.split(embedded_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    # Tied: the LM head reads the embedding table, counted once.
    nbytes = sum(p.nbytes for p in model.parameters())
    rows = []
    for batch in batches:
        prompts = workload(batch)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def run(ids=ids, mask=mask) -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=0,
                )

        seconds = _timed(run, repeats)
        rows.append(
            {"batch": batch, "tok_s": batch * new_tokens / seconds, "bytes_per_step": nbytes}
        )
    return rows


def run_llama_cpp(threads: int, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """Batch 1 through llama-cpp-python's ``generate`` (one ``llama_decode`` a token)."""
    from llama_cpp import Llama

    from bastion.core.loader.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    llm = Llama(
        model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False
    )

    def run() -> None:
        llm.reset()
        for i, _ in enumerate(llm.generate(workload(1)[0], temp=0.0, reset=True)):
            if i + 1 == new_tokens:
                break

    seconds = _timed(run, repeats)
    from gguf import GGUFReader

    nbytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    return [{"batch": 1, "tok_s": new_tokens / seconds, "bytes_per_step": nbytes}] + [
        {"batch": b, "tok_s": None, "bytes_per_step": nbytes} for b in batches if b != 1
    ]


def worker(engine: str, threads: int, batches: list[int], new_tokens: int, repeats: int) -> None:
    if engine == "bastion-served":
        rows = run_bastion_served(threads, batches, new_tokens, repeats)
    elif engine.startswith("bastion"):
        dtype = "float32" if engine == "bastion-f32" else "auto"
        rows = run_bastion(dtype, threads, batches, new_tokens, repeats)
    elif engine == "transformers":
        rows = run_transformers(threads, batches, new_tokens, repeats)
    else:
        rows = run_llama_cpp(threads, batches, new_tokens, repeats)
    print("RESULT " + json.dumps({"bandwidth_gbs": memory_bandwidth_gbs(threads), "rows": rows}))


def _available(engine: str) -> bool:
    if engine != "llama.cpp":
        return True
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", default=["bastion"], choices=ENGINES)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", nargs=2, metavar=("ENGINE", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.batches, args.new_tokens, args.repeats)
        return
    started = time.perf_counter()
    print(
        f"# greedy, {args.new_tokens} new tokens, median of {args.repeats}; "
        f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    header = [
        "engine",
        "threads",
        *[f"batch {b} tok/s" for b in args.batches],
        "CPU path",
        "MB/step",
        "floor b1 tok/s",
    ]
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |")
    for engine in args.engines:
        if not _available(engine):
            print(
                f"| {engine} | - | skipped: llama-cpp-python is not installed (pip install "
                "llama-cpp-python builds llama.cpp from source) |"
            )
            continue
        for threads in args.threads:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                engine,
                str(threads),
                "--batches",
                *map(str, args.batches),
                "--new-tokens",
                str(args.new_tokens),
                "--repeats",
                str(args.repeats),
            ]
            env = dict(os.environ)
            if engine == "bastion-ref":
                env["BASTION_CPU_KERNELS"] = "0"
            out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
            line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT ")), None)
            if line is None:
                print(f"| {engine} | {threads} | failed: {out.stderr.strip().splitlines()[-1:]} |")
                continue
            result = json.loads(line.removeprefix("RESULT "))
            rows = result["rows"]
            nbytes = rows[0]["bytes_per_step"]
            cells = [_cell(r["tok_s"], LLAMA_CPP_ISSUE.get(threads, {}).get(r["batch"])
                           if engine.startswith("bastion") else None) for r in rows]
            floor = result["bandwidth_gbs"] * 1e9 / nbytes
            print(
                f"| {engine} | {threads} | "
                + " | ".join(cells)
                + f" | {rows[0].get('cpu_path', '-')} | {nbytes / 1e6:.0f} | {floor:.0f} |",
                flush=True,
            )
    for threads in args.threads:
        if threads in LLAMA_CPP_ISSUE:
            cells = [_cell(LLAMA_CPP_ISSUE[threads].get(b), None) for b in args.batches]
            print(f"| llama.cpp (issue #26) | {threads} | " + " | ".join(cells) + " | - | - | - |")
    print(f"# {time.perf_counter() - started:.0f} s")


def _cell(tok_s: float | None, reference: float | None) -> str:
    """``tok/s`` and, beside a reference figure, its share of it (``41.0 (64%)``)."""
    if tok_s is None:
        return "n/a"
    return f"{tok_s:.1f}" + (f" ({tok_s / reference:.0%})" if reference else "")


if __name__ == "__main__":
    main()
