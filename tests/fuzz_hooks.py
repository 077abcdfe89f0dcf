"""Schemathesis hooks for tests/test_fuzz.py (loaded through ``SCHEMATHESIS_HOOKS``).

- ``map_body`` keeps generation cheap on a CPU server: ``max_tokens`` at most 4 and ``n`` at
  most 2 where the fuzzer chose a valid value (invalid ones pass untouched, they must get 400).
- ``no_server_bug``: a 5xx is a failure unless it is one the API documents for a client's own
  choice or the server's state: 504 ``deadline_exceeded`` (the request's own ``timeout``) and
  503 while draining or recovering. Every response is also counted into ``FUZZ_STATS_PATH``,
  by status and by operation (``op <METHOD> <path template>``).
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import schemathesis

_MAX_TOKENS = 4
_MAX_N = 2
_ALLOWED_5XX = {(504, "deadline_exceeded"), (503, "engine_unavailable"),
                (503, "server_draining")}
_lock = threading.Lock()
_counts: Counter[str] = Counter()


def _clamp(body: dict, name: str, limit: int) -> None:
    value = body.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value:
        body[name] = min(value, limit)


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict) and ("prompt" in body or "messages" in body):
        for name in ("max_tokens", "max_completion_tokens"):
            _clamp(body, name, _MAX_TOKENS)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = _MAX_TOKENS  # chat's default would fill the context
        _clamp(body, "n", _MAX_N)
    return body


def _error_code(response) -> str | None:
    try:
        return json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@schemathesis.check
def no_server_bug(ctx, response, case):
    status = response.status_code
    with _lock:
        _counts["cases"] += 1
        _counts[f"status_{status}"] += 1
        _counts[f"op {case.method.upper()} {case.path}"] += 1
        if status >= 500:
            _counts["5xx"] += 1
            if (status, _error_code(response)) not in _ALLOWED_5XX:
                _counts["server_bugs"] += 1
        path = os.environ.get("FUZZ_STATS_PATH")
        if path:
            with open(path, "w") as f:
                json.dump(dict(_counts), f)
    if status >= 500 and (status, _error_code(response)) not in _ALLOWED_5XX:
        raise AssertionError(f"{status} from {case.method} {case.path}: "
                             f"{response.content[:300]!r}")
