"""Schemathesis over ``/openapi.json``: no request, valid or not, gets a server error, and every
response matches the document (its schema and content type for the status), which is generated
from the request and response types of api/schemas.py.

Bounded for the suite: the generation routes by time (``BASTION_FUZZ_SECONDS``, 15 s by
default), the control routes by a number of fuzzed cases per operation (``CONTROL_EXAMPLES``,
which grows with that time). A time budget alone would not do for the control routes: on a
loaded 2-core machine schemathesis's coverage phase can spend it all before fuzzing begins. A
longer run by hand: ``BASTION_FUZZ_SECONDS=600 pytest -s tests/test_fuzz.py``. The hooks
(tests/fuzz_hooks.py) keep ``max_tokens`` small and count every response, by status and by
operation; the figures are printed, and every operation each run selects must have been sent
cases.

The generation routes run against a real ``bastion serve``. The control routes run against the
API over a fake engine client with the admin key sent: a valid ``/fault_tolerance/apply``
starts a real recovery of the group, which the fuzzer would start every few cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_fixture import SMALL_SERVER_ARGS, ServerProcess, free_port

FUZZ_SECONDS = float(os.environ.get("BASTION_FUZZ_SECONDS", "15"))
CONTROL_EXAMPLES = max(30, int(2 * FUZZ_SECONDS))
ADMIN_KEY = "fuzz-admin"
TESTS_DIR = Path(__file__).parent


def schemathesis_run(base_url: str, stats_path: Path, *args: str, timeout_s: float
                     ) -> tuple[dict[str, int], str, int]:
    """The hooks' counts, the tail of schemathesis's report, and its exit status (0: no check
    failed on any case). ``args`` bound the run (``--max-time`` or ``--max-examples``) and
    select its operations."""
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "FUZZ_STATS_PATH": str(stats_path),
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    main = "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"
    cmd = [sys.executable, "-c", main, "run", base_url + "/openapi.json",
           "--checks", "no_server_bug,response_schema_conformance,content_type_conformance",
           "--workers", "1", "--no-shrink", "--request-timeout", "60",
           "--suppress-health-check", "all", *args]
    # check=False: schemathesis exits non-zero on any failure, which the stats then show.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                          timeout=timeout_s, cwd=stats_path.parent)
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    return stats, proc.stdout[-6000:] + proc.stderr[-3000:], proc.returncode


def operations(base_url: str, path_regex: str, exclude: bool) -> set[str]:
    """``<METHOD> <path>`` of every operation in the served document that a run selects with
    ``--include-path-regex`` (or, ``exclude``, ``--exclude-path-regex``) ``path_regex``; not
    ``/openapi.json`` itself, which schemathesis loads rather than fuzzes."""
    with urllib.request.urlopen(base_url + "/openapi.json", timeout=30) as resp:
        paths = json.loads(resp.read())["paths"]
    return {f"{method.upper()} {path}" for path, item in paths.items()
            if path != "/openapi.json" and bool(re.search(path_regex, path)) != exclude
            for method in item if method in ("get", "post", "put", "delete", "patch")}


def untested(stats: dict[str, int], selected: set[str]) -> set[str]:
    """The selected operations the run sent no case to."""
    return {op for op in selected if not stats.get(f"op {op}")}


def report(name: str, stats: dict[str, int]) -> str:
    by_status = {k[len("status_"):]: v for k, v in sorted(stats.items())
                 if k.startswith("status_")}
    by_operation = {k[len("op "):]: v for k, v in sorted(stats.items()) if k.startswith("op ")}
    return (f"{name}: {stats.get('cases', 0)} cases, {stats.get('5xx', 0)} 5xx "
            f"({stats.get('server_bugs', 0)} server bugs); by status {by_status}; "
            f"by operation {by_operation}")


@pytest.mark.timeout(FUZZ_SECONDS + 600)
def test_fuzz_generation_routes(tmp_path):
    server = ServerProcess((*SMALL_SERVER_ARGS, "--admin-key", ADMIN_KEY),
                           workdir=str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_healthy(timeout_s=180)
        stats, output, status = schemathesis_run(
            server.base_url, tmp_path / "stats.json", "--max-time", str(max(int(FUZZ_SECONDS), 1)),
            "--exclude-path-regex", "^/fault_tolerance", timeout_s=FUZZ_SECONDS + 240)
        assert server.proc.poll() is None, "the server died:\n" + server.log_tail()
        assert server.get("/health")[0] == 200
        selected = operations(server.base_url, "^/fault_tolerance", exclude=True)
        # Every request the fuzzer sent left no trace.
        tables = server.wait_request_tables_empty()
    finally:
        server.kill_tree()
    print(report("generation routes", stats), f"; request tables afterwards {tables}")
    assert not any(tables.values()), tables
    assert stats.get("cases", 0) > 50, output
    assert len(selected) >= 8 and not untested(stats, selected), (untested(stats, selected), output)
    assert stats.get("server_bugs", 0) == 0, output + server.log_tail()
    assert status == 0, output  # no response outside the document
    assert "Traceback" not in server.log_tail(10**7), server.log_tail()


@contextlib.contextmanager
def fake_control_server(tokenizer) -> Iterator[tuple[int, Any]]:
    """The real app over test_api's fake engine (on ``tokenizer``, conftest's) and fault
    handler, served from a thread of its own; yields its port and the handler."""
    from test_api import FakeEngine, FakeFaultHandler

    from bastion.api.server import ApiConfig, build_app, start_server

    port, handler = free_port(), FakeFaultHandler()
    config = ApiConfig(port=port, admin_key=ADMIN_KEY, enable_fault_injection=True)
    app = build_app(FakeEngine(tokenizer), config, handler)
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(start_server(app, config))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port, handler
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.run_until_complete(runner.cleanup())
        loop.close()


@pytest.mark.timeout(CONTROL_EXAMPLES * 2 + 300)
def test_fuzz_control_routes(tmp_path, tokenizer):
    with fake_control_server(tokenizer) as (port, handler):
        stats, output, status = schemathesis_run(
            f"http://127.0.0.1:{port}", tmp_path / "stats.json",
            "--max-examples", str(CONTROL_EXAMPLES), "--include-path-regex", "^/fault_tolerance",
            "-H", f"Authorization: Bearer {ADMIN_KEY}", timeout_s=CONTROL_EXAMPLES * 2 + 240)
        selected = operations(f"http://127.0.0.1:{port}", "^/fault_tolerance", exclude=False)
    print(report("control routes", stats))
    assert stats.get("cases", 0) > 50, output
    assert len(selected) == 3 and not untested(stats, selected), (untested(stats, selected), output)
    assert stats.get("server_bugs", 0) == 0, output
    assert status == 0, output
    # Only bodies the strict types accept reached the handler.
    for call in handler.calls:
        assert call[0] in ("apply", "inject") and call[1] in ("retry", "reinit", "raise",
                                                             "worker_exit", "hang"), call
        if call[0] == "apply":
            assert call[2] == {}, call
