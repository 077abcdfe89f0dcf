"""The ``bastion`` command line: vLLM's flag conventions, one-line user errors, defaults."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import threading
import time

import pytest

from bastion import SamplingParams
from bastion.core.config import (
    ConfigError,
    build_engine_config,
    default_max_num_batched_tokens,
    gpu_name_and_memory,
)
from bastion.procs.cli import build_parser, engine_kwargs, main, no_effect_notes, parse_args
from serve_fixture import free_port


def test_generate_prints_the_greedy_completion_and_logs_its_load(embedded_llm):
    prompt = "The capital of France is"
    out = subprocess.run([sys.executable, "-m", "bastion.procs.cli", "generate", prompt,
                          "--no-chat", "--max-tokens", "6", "--dtype", "float32"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = embedded_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert out.stdout == expected + "\n"
    # Not silent while it loads: the phases are logged on stderr (a bar on a terminal).
    for line in ("max_num_batched_tokens=4096", "loading weights: done", "KV cache:",
                 "LLM ready in"):
        assert line in out.stderr, out.stderr


def test_every_engine_flag_maps_to_a_config_field():
    args = build_parser().parse_args(["serve", "--max-model-len", "128", "--block-size", "32",
                                      "--no-enable-prefix-caching", "--ft-inflight", "abort"])
    config = build_engine_config(**engine_kwargs(args))
    assert config.model.max_model_len == 128 and config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False
    assert config.fault_tolerance.ft_inflight == "abort"


def test_underscore_spellings_positional_model_and_vllm_names(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    args = parse_args(["serve", str(model), "--max_model_len", "230000", "--max_num_seqs=8",
                       "--served-model-name", "a", "b", "--dtype", "half", "-tp", "2",
                       "--scheduling-policy", "priority", "--enable_prefix_caching"])
    kwargs = engine_kwargs(args)
    assert kwargs["model"] == str(model) and kwargs["max_model_len"] == 230000
    config = build_engine_config("serve", **{**kwargs, "tensor_parallel_size": 1})
    assert config.model.served_model_name == ("a", "b")
    assert (config.model.dtype, config.scheduler.max_num_seqs) == ("half", 8)
    assert config.scheduler.policy == "priority" and args.tensor_parallel_size == 2
    # Values are not touched: only flag names change spelling.
    assert parse_args(["serve", "--chat-template=--x_y"]).chat_template == "--x_y"
    with pytest.raises(ConfigError, match="two models given"):
        engine_kwargs(parse_args(["serve", str(model), "--model", str(tmp_path)]))


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-model-len", "8", "--kv-transfer-config", "{}"],
     ("bastion serve: error: unknown flag --kv-transfer-config (`bastion serve --help` lists "
      "the flags)")),
    (["serve", "--max-model"], "bastion serve: error: unknown flag --max-model "),
    (["serve", "--distributed-executor-backend", "ray"],
     ("bastion serve: error: argument --distributed-executor-backend: invalid choice: "
      "'ray'")),
    (["serve", "--max-model-len", "long"],
     "bastion serve: error: argument --max-model-len: invalid int value: 'long'"),
])
def test_flag_errors_are_one_line_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


def test_flags_without_effect_are_accepted_with_one_note_each():
    args = parse_args(["serve", "--trust-remote-code", "--distributed-executor-backend", "mp",
                       "--disable-log-requests"])
    notes = no_effect_notes(args)
    assert [note.split(":")[0] for note in notes] == [
        "--trust-remote-code has no effect", "--distributed-executor-backend has no effect",
        "--disable-log-requests has no effect"]
    assert notes[1] == ("--distributed-executor-backend has no effect: bastion always runs one "
                        "worker process per GPU (mp)")
    assert no_effect_notes(parse_args(["serve"])) == []


@pytest.fixture
def quiet_serve(monkeypatch):
    """``bastion serve`` in this process up to its start-up checks: no process title change,
    no logging set-up, no event loop (a check that passes would start the server)."""
    monkeypatch.setattr("bastion.procs.serve.setup_logging", lambda level: None)
    monkeypatch.setattr("bastion.procs.serve.set_process_title", lambda title: None)

    def no_server(*args):
        raise AssertionError("the start-up checks passed")

    monkeypatch.setattr("bastion.procs.serve.Server", no_server)


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype 'fp8' is not supported"),
    (["--model", "/nonexistent/model.gguf"], "model path '/nonexistent/model.gguf' does not"),
    (["--chat-template", "/no/template.jinja"], "chat_template '/no/template.jinja' is neither"),
    (["--generation-config", "/nonexistent"], "generation_config must be auto, vllm or a folder"),
    (["--metrics-prefix", "vllm:"], "metrics_prefix must be a Prometheus name"),
    (["--port", "70000"], "port must be in [0, 65535]"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' is not an address"),
])
def test_user_errors_are_one_line_and_exit_2(quiet_serve, capsys, argv, message):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"bastion: error: {message}"), err


def test_a_taken_port_fails_before_the_model_loads(quiet_serve, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (f"bastion: error: port {port} on 127.0.0.1 is already in "
                                       "use (another server?); stop it or pick another --port\n")


def test_the_port_is_held_from_before_the_model_loads(quiet_serve, monkeypatch):
    """Bound before anything loads and held (not listening) until HTTP serves on it: nothing,
    an ephemeral port of the server's own connections included, can take it meanwhile."""
    port = free_port()
    seen = {}

    class HoldsThePort:
        def __init__(self, args, config, api_config, sock):
            seen["bound"] = sock.getsockname()

        async def run(self):
            with socket.socket() as other:
                with pytest.raises(OSError) as taken:
                    other.bind(("127.0.0.1", port))
                seen["errno"] = taken.value.errno
            with socket.socket() as client, pytest.raises(ConnectionRefusedError):
                client.connect(("127.0.0.1", port))
            return 0

    monkeypatch.setattr("bastion.procs.serve.Server", HoldsThePort)
    assert main(["serve", "--port", str(port)]) == 0
    assert seen == {"bound": ("127.0.0.1", port), "errno": errno.EADDRINUSE}


def test_debug_level_adds_the_traceback(quiet_serve, capsys):
    assert main(["serve", "--kv-cache-dtype", "fp8", "--log_level", "DEBUG"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "ConfigError" in err
    assert err.endswith("bastion: error: kv_cache_dtype 'fp8' is not supported (the KV cache is "
                        "kept in the model's dtype); use auto\n")


def test_max_model_len_above_the_model_limit_fails_in_seconds():
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "bastion.procs.cli", "serve",
                          "--max_model_len", "230000", "--port", "0"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        "bastion: error: max_model_len=230000 exceeds the model's limit of 8192 "
        "(max_position_embeddings); use a value <= that")
    assert "Traceback" not in out.stderr
    assert time.monotonic() - start < 30  # no engine starts, nothing loads


@pytest.mark.parametrize("name, gib, offline, server", [
    ("NVIDIA H200", 141, 16384, 8192),
    ("NVIDIA H100 80GB HBM3", 80, 16384, 8192),
    ("NVIDIA A100-SXM4-80GB", 80, 8192, 2048),
    ("NVIDIA L4", 23, 8192, 2048),
])
def test_default_token_budget_follows_vllm_by_device_and_entry_point(monkeypatch, name, gib,
                                                                     offline, server):
    monkeypatch.setattr("bastion.core.config.gpu_name_and_memory", lambda: (name, gib * 2**30))
    assert default_max_num_batched_tokens("cuda", "llm") == (offline, f"{name} ({gib} GiB)")
    assert default_max_num_batched_tokens("cuda", "serve")[0] == server


def test_gpu_properties_come_from_nvidia_smi_without_cuda(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$3" = "-i" ] && [ "$4" = "3" ] && echo "NVIDIA H200, 143771"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")

    def no_cuda(index):
        raise AssertionError("CUDA was initialised")

    monkeypatch.setattr("torch.cuda.get_device_properties", no_cuda)
    assert gpu_name_and_memory() == ("NVIDIA H200", 143771 * 2**20)


def test_default_token_budget_on_the_cpu_is_logged(caplog):
    caplog.set_level("INFO", "bastion.core.config")
    assert build_engine_config("serve", device="cpu").scheduler.max_num_batched_tokens == 2048
    assert build_engine_config("llm", device="cpu").scheduler.max_num_batched_tokens == 4096
    assert build_engine_config("llm", device="cpu", tensor_parallel_size=2
                               ).scheduler.max_num_batched_tokens == 8192
    assert "max_num_batched_tokens=2048: vLLM's default for the API server on the CPU" \
        in caplog.text
    caplog.clear()
    config = build_engine_config("serve", device="cpu", max_num_batched_tokens=512)
    assert config.scheduler.max_num_batched_tokens == 512 and caplog.text == ""


def test_llm_shows_its_load_phases_unless_the_program_set_up_logging(monkeypatch):
    import logging

    from bastion.procs.logs import console_logging

    bastion_logger = logging.getLogger("bastion")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(bastion_logger, "handlers", [])
    monkeypatch.setattr(bastion_logger, "level", logging.NOTSET)
    console_logging()
    assert len(bastion_logger.handlers) == 1 and bastion_logger.level == logging.INFO
    console_logging()  # idempotent
    assert len(bastion_logger.handlers) == 1
    monkeypatch.setattr(bastion_logger, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    console_logging()  # the program's own logging wins
    assert bastion_logger.handlers == []


@pytest.mark.parametrize("is_user_error", [True, False])
def test_a_childs_config_error_reaches_the_parent_as_a_user_error(tmp_path, is_user_error):
    """A child that cannot start for a reason the user can fix (max_model_len that the KV cache
    cannot hold) makes its parent raise ConfigError, which ``bastion`` prints as one line; other
    failures stay StartupErrors naming the child."""
    import zmq

    from bastion.ipc.codec import encode
    from bastion.ipc.control import HandshakeInfo
    from bastion.ipc.messages import Failure
    from bastion.procs.lifecycle import Child, HandshakeServer, StartupError, child_handshake

    ctx = zmq.Context()
    server = HandshakeServer(ctx, f"ipc://{tmp_path}/handshake")
    sock = None
    try:
        class FakeProc:  # alive until it has sent its FAILURE, as a real child
            returncode = 1

            def poll(self) -> int | None:
                return None if thread.is_alive() else 1

        child = Child("engine", 0, "bastion::engine-0", FakeProc())

        def fail() -> None:
            nonlocal sock
            sock, _ = child_handshake(ctx, server.address, "engine", 0)
            sock.send_multipart(encode(Failure("engine", 0, "max_model_len 8192 needs more",
                                               is_user_error=is_user_error)))

        thread = threading.Thread(target=fail)
        thread.start()
        expected = ConfigError if is_user_error else StartupError
        message = ("max_model_len 8192 needs more" if is_user_error
                   else "bastion::engine-0 failed to start: max_model_len 8192 needs more")
        with pytest.raises(expected) as info:
            server.run([child], {0: HandshakeInfo(b"{}")}, timeout_s=10)
        assert str(info.value) == message
        thread.join()
    finally:
        if sock is not None:
            sock.close(linger=0)
        server.close()
        ctx.term()
