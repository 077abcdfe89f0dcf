"""The environment registry (bastion.envs): parsed where used, errors name the variable, and no
module reads a BASTION_ variable of its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bastion import envs

ROOT = Path(__file__).resolve().parents[1]


def test_values_follow_the_environment_and_fall_back_to_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BASTION_DECODE_SPLIT_MIN_KEYS", raising=False)
    assert envs.get("BASTION_DECODE_SPLIT_MIN_KEYS") == 256
    monkeypatch.setenv("BASTION_DECODE_SPLIT_MIN_KEYS", "512")
    assert envs.get("BASTION_DECODE_SPLIT_MIN_KEYS") == 512
    monkeypatch.setenv("BASTION_GEMV", "0")
    assert envs.get("BASTION_GEMV") is False
    monkeypatch.setenv("BASTION_GEMV", "")
    assert envs.get("BASTION_GEMV") is True


@pytest.mark.parametrize("name,value", [("BASTION_GEMV", "yes"),
                                        ("BASTION_DECODE_SPLIT_TARGET", "many")])
def test_a_malformed_value_is_an_error_naming_the_variable(
        name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        envs.get(name)


def test_every_bastion_variable_is_read_through_the_registry() -> None:
    readers = re.compile(r"(os\.environ(\.get)?\s*[\[(]|os\.getenv\()\s*['\"]BASTION_")
    sources = {str(p.relative_to(ROOT)): p.read_text()
               for folder in ("api", "core", "ipc", "ops", "procs", "sentinel")
               for p in (ROOT / folder).rglob("*.py")}
    assert [name for name, text in sources.items() if readers.search(text)] == []
    used = set(re.findall(r"envs\.get\(\s*['\"](BASTION_\w+)", "".join(sources.values())))
    assert "BASTION_GEMV" in used
    assert used <= set(envs.VARIABLES), used - set(envs.VARIABLES)
