"""The systemd units in scripts/: the settings DESIGN.md §8 relies on, the command line systemd
will build from them and the example env file, and (where systemd-analyze exists) a clean
``systemd-analyze verify``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SINGLE = SCRIPTS / "bastion.service"
TEMPLATE = SCRIPTS / "bastion@.service"
ENV_EXAMPLE = SCRIPTS / "bastion.env.example"
BINARY = "/usr/local/bin/bastion"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A tiny systemd unit parser: sections of keys, every assignment kept in order (keys such
    as Environment= may repeat), backslash continuations joined with a space."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def parse_env_file(text: str) -> dict[str, str]:
    """systemd EnvironmentFile= syntax: KEY=value, optional quotes, # comments."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"bad line {line!r}"
        words = shlex.split(value)
        assert len(words) <= 1, f"unquoted spaces in {line!r}"
        env[key] = words[0] if words else ""
    return env


def expand_exec(command: str, env: dict[str, str], instance: str | None = None) -> list[str]:
    """ExecStart= as systemd runs it: a lone ``$VAR`` word splits into several arguments,
    ``${VAR}`` is one argument, ``%i`` is the instance name."""
    argv = []
    for word in shlex.split(command):
        if instance is not None:
            word = word.replace("%i", instance)
        if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", word):
            argv.extend(env[word[1:]].split())
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m[1]], word))
    return argv


def single(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"{section}.{key}: expected one value, got {values}"
    return values[0]


@pytest.fixture(scope="module")
def units() -> dict[str, dict[str, dict[str, list[str]]]]:
    return {path.name: parse_unit(path.read_text()) for path in (SINGLE, TEMPLATE)}


@pytest.mark.parametrize("name", [SINGLE.name, TEMPLATE.name])
def test_daemon_settings(units, name):
    unit = units[name]
    expected = {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30",
        "Restart": "on-failure", "RestartSec": "5", "KillMode": "mixed", "KillSignal": "SIGTERM",
        "DynamicUser": "yes", "User": "bastion",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "NoNewPrivileges": "yes", "RuntimeDirectoryMode": "0700",
        "StateDirectory": "bastion", "CacheDirectory": "bastion",
        "SupplementaryGroups": "video",
    }
    for key, value in expected.items():
        assert single(unit, "Service", key) == value, key
    # The drain needs time; systemd's default 90 s stop timeout is too short for long requests.
    assert int(single(unit, "Service", "TimeoutStopSec")) >= 120
    assert "/etc/bastion/bastion.env" in [v.lstrip("-") for v in
                                          unit["Service"]["EnvironmentFile"]]
    environment = dict(v.split("=", 1) for v in unit["Service"]["Environment"])
    # The weight cache lives in the unit's CacheDirectory=, writable under ProtectSystem=strict.
    assert environment["BASTION_CACHE_DIR"] == "/var/cache/bastion"
    assert environment["TRITON_CACHE_DIR"].startswith("/var/cache/bastion/")
    assert "PrivateDevices" not in unit["Service"]  # would hide the GPUs
    assert "MemoryDenyWriteExecute" not in unit["Service"]  # CUDA/Triton JIT
    assert single(unit, "Install", "WantedBy") == "multi-user.target"


def test_single_server_unit(units):
    unit = units[SINGLE.name]
    assert single(unit, "Service", "ExecStart") == f"{BINARY} serve $BASTION_ARGS"
    assert single(unit, "Service", "RuntimeDirectory") == "bastion"
    assert unit["Service"]["EnvironmentFile"] == ["-/etc/bastion/bastion.env"]


def test_template_unit_is_per_rank(units):
    unit = units[TEMPLATE.name]
    assert "%i" in single(unit, "Unit", "Description")
    # NOTE: a shared runtime directory would be deleted when any one rank stops.
    assert single(unit, "Service", "RuntimeDirectory") == "bastion-%i"
    assert unit["Service"]["EnvironmentFile"] == ["-/etc/bastion/bastion.env",
                                                  "/etc/bastion/bastion-%i.env"]


def test_exec_start_with_example_env():
    env = parse_env_file(ENV_EXAMPLE.read_text())
    unit = parse_unit(SINGLE.read_text())
    argv = expand_exec(single(unit, "Service", "ExecStart"), env)
    assert argv == [BINARY, "serve", "--model", "/var/lib/bastion/models/model.gguf",
                    "--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "1",
                    "--gpu-memory-utilization", "0.9"]
    assert env["BASTION_CACHE_DIR"] == "/var/cache/bastion"


def test_template_exec_start_for_rank_one():
    env = parse_env_file(ENV_EXAMPLE.read_text())
    # The per-rank file the example documents (commented out there).
    per_rank = parse_env_file("\n".join(
        line.lstrip("# ") for line in ENV_EXAMPLE.read_text().splitlines()
        if re.match(r"# (BASTION_PORT|CUDA_VISIBLE_DEVICES)=", line)))
    assert set(per_rank) == {"BASTION_PORT", "CUDA_VISIBLE_DEVICES"}
    env.update(per_rank, BASTION_PORT="8001", CUDA_VISIBLE_DEVICES="1")
    unit = parse_unit(TEMPLATE.read_text())
    argv = expand_exec(single(unit, "Service", "ExecStart"), env, instance="1")
    base = expand_exec(f"{BINARY} serve $BASTION_ARGS", env)
    assert argv[:len(base)] == base
    # Rank flags come last so that they override the same flags inside BASTION_ARGS.
    assert argv[len(base):] == ["--data-parallel-rank", "1", "--data-parallel-size", "2",
                                "--data-parallel-address", "10.0.0.1",
                                "--data-parallel-rpc-port", "29550", "--port", "8001"]


def test_units_only_use_documented_variables():
    text = ENV_EXAMPLE.read_text()
    for path in (SINGLE, TEMPLATE):
        exec_start = single(parse_unit(path.read_text()), "Service", "ExecStart")
        for name in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", exec_start):
            assert re.search(rf"^#? ?{name}=", text, re.MULTILINE), f"{path.name} uses ${name}"


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def verify(folder: Path, unit_name: str) -> tuple[int, list[str]]:
    """Run ``systemd-analyze verify``; return its exit code and the lines about our unit."""
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", str(folder / unit_name)],
                            check=False, capture_output=True, text=True, timeout=30)
    stem = unit_name.split("@")[0]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if stem in line]
    return result.returncode, lines


def install_copy(folder: Path, source: Path, replace: dict[str, str] | None = None) -> None:
    # ExecStart must name an existing executable for verify to pass.
    text = source.read_text().replace(BINARY, sys.executable)
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    (folder / source.name).write_text(text)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    install_copy(tmp_path, SINGLE)
    install_copy(tmp_path, TEMPLATE)
    assert verify(tmp_path, "bastion.service") == (0, [])
    assert verify(tmp_path, "bastion@0.service") == (0, [])
    # The check has teeth: a misspelt setting in the same copy is reported.
    broken = tmp_path / "broken"
    broken.mkdir()
    install_copy(broken, TEMPLATE, {"KillMode=mixed": "KillMode=mixd"})
    _, lines = verify(broken, "bastion@0.service")
    assert any("kill mode" in line.lower() for line in lines), lines


def test_unit_command_lines_parse_with_the_bastion_cli():
    """The flags the units pass are the ones ``bastion serve`` accepts, with rank flags winning."""
    from bastion.procs.cli import build_parser

    env = parse_env_file(ENV_EXAMPLE.read_text())
    argv = expand_exec(single(parse_unit(SINGLE.read_text()), "Service", "ExecStart"), env)
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.model, args.host, args.port) == (
        "serve", "/var/lib/bastion/models/model.gguf", "0.0.0.0", 8000)
    assert (args.tensor_parallel_size, args.gpu_memory_utilization) == (1, 0.9)
    assert args.data_parallel_rank is None

    env.update(BASTION_PORT="8003")
    exec_start = single(parse_unit(TEMPLATE.read_text()), "Service", "ExecStart")
    args = build_parser().parse_args(expand_exec(exec_start, env, instance="1")[1:])
    assert (args.data_parallel_rank, args.data_parallel_size) == (1, 2)
    assert (args.data_parallel_address, args.data_parallel_rpc_port) == ("10.0.0.1", 29550)
    assert args.port == 8003  # the rank's port, not the --port 8000 inside BASTION_ARGS


def run_install_units(tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    """``bastion install-units`` into ``tmp_path`` (units in units/, the env file in etc/)."""
    from bastion.procs.cli import parse_args

    units, etc = tmp_path / "units", tmp_path / "etc"
    args = parse_args(["install-units", "--dest", str(units), "--env-dir", str(etc), *extra])
    args.func(args)
    return units, etc


def test_install_units_runs_this_environments_bastion(tmp_path, capsys):
    from bastion.procs.units import default_binary

    units, etc = run_install_units(tmp_path)
    binary = default_binary()
    assert binary.parent == Path(sys.executable).parent and os.access(binary, os.X_OK)
    single_unit = parse_unit((units / "bastion.service").read_text())
    assert single(single_unit, "Service", "ExecStart") == f"{binary} serve $BASTION_ARGS"
    assert single_unit["Service"]["EnvironmentFile"] == [f"-{etc}/bastion.env"]
    template = parse_unit((units / "bastion@.service").read_text())
    assert single(template, "Service", "ExecStart").startswith(f"{binary} serve $BASTION_ARGS")
    assert template["Service"]["EnvironmentFile"] == [f"-{etc}/bastion.env",
                                                      f"{etc}/bastion-%i.env"]
    assert (etc / "bastion.env").read_text() == ENV_EXAMPLE.read_text()
    assert (etc / "bastion.env").stat().st_mode & 0o777 == 0o640
    assert "systemctl daemon-reload && systemctl enable --now bastion" in capsys.readouterr().out
    # A second run rewrites the units but keeps the operator's edited environment file.
    (etc / "bastion.env").write_text('BASTION_ARGS="--port 9000"\n')
    run_install_units(tmp_path)
    assert (etc / "bastion.env").read_text() == 'BASTION_ARGS="--port 9000"\n'


def test_install_units_refuses_a_missing_binary(tmp_path, capsys):
    from bastion.procs.cli import main

    assert main(["install-units", "--dest", str(tmp_path), "--bin",
                 str(tmp_path / "bastion")]) == 2
    assert capsys.readouterr().err == (f"bastion: error: {tmp_path / 'bastion'} is not an "
                                       "executable bastion; install the project "
                                       "(scripts/setup.sh) or pass --bin\n")


def test_a_binary_under_a_home_folder_is_left_readable():
    from bastion.procs.units import render_unit

    text = render_unit(SINGLE.read_text(), "/home/ops/bastion/.venv/bin/bastion", "/etc/bastion")
    unit = parse_unit(text)
    assert single(unit, "Service", "ProtectHome") == "read-only"
    text = render_unit(SINGLE.read_text(), "/opt/bastion/.venv/bin/bastion", "/etc/bastion")
    assert single(parse_unit(text), "Service", "ProtectHome") == "yes"


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
def test_installed_units_pass_systemd_analyze_verify(tmp_path):
    units, _ = run_install_units(tmp_path)
    assert verify(units, "bastion.service") == (0, [])
    assert verify(units, "bastion@0.service") == (0, [])
