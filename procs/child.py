"""Entry point of every child process:
``python -m bastion.procs.child ROLE RANK TITLE ADDR PPID [SPARE_SETTINGS_JSON]``.

Sets the title, ties its life to the parent, imports its role's modules, performs the
HELLO/HANDSHAKE part of start-up and hands over to the role's main function (which says READY
when it is). A warm spare (``SpareSettings``) does everything up to HELLO at once and then
waits, as long as it takes, for HANDSHAKE. An engine spare starts its own worker spares first
thing, so they warm up beside it, and says HELLO (is ready) only once they are; if one of them
exits, it exits too, and its sentinel starts a new set.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

# NOTE: nothing here imports torch (~3 s on a loaded host; bastion.core.config does not
# either): an engine spawns its workers, or an engine spare its worker spares, before that.
from bastion.core.config import ConfigError, EngineConfig
from bastion.ipc.codec import encode
from bastion.ipc.control import HandshakeInfo
from bastion.ipc.messages import Failure
from bastion.procs.lifecycle import (
    SpareLost,
    Spares,
    SpareSettings,
    child_handshake,
    die_with_parent,
    exit_now,
    ipc_address,
    set_process_title,
)
from bastion.procs.logs import setup_logging

_MAINS = {"worker": ("bastion.procs.worker", "run_worker"),
          "engine": ("bastion.procs.engine", "run_engine"),
          "sentinel": ("bastion.sentinel.sentinel", "run_sentinel")}

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> None:
    role, rank, title, address, parent_pid = argv[0], int(argv[1]), argv[2], argv[3], int(argv[4])
    spare = msgspec.json.decode(argv[5], type=SpareSettings) if len(argv) > 5 else None
    start = time.perf_counter()
    die_with_parent(parent_pid)
    set_process_title(title)
    setup_logging()
    # The parent coordinates shutdown; a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if role not in _MAINS:
        raise ValueError(f"unknown role {role!r}")
    ctx = zmq.Context.instance()
    worker_spares = handshake = info = config = None
    if spare is not None and role == "engine" and spare.num_workers > 0:
        worker_spares = _start_worker_spares(spare, ctx)
    elif spare is None and role == "engine":
        # A cold start: the launch first (its config says how many workers), then the workers
        # start and import beside this process's own imports, as a spare's worker spares do
        # (in series they cost one interpreter start and torch import more).
        handshake, info = child_handshake(ctx, address, role, rank)
        config = msgspec.json.decode(info.config_json, type=EngineConfig)
        worker_spares = _start_worker_spares(_cold_worker_settings(config, info), ctx)
    module, name = _MAINS[role]
    role_main = getattr(importlib.import_module(module), name)
    extra = {} if worker_spares is None else {"worker_spares": worker_spares}
    if spare is not None:
        _warm_up(role, rank, title, spare, worker_spares, start)
    if handshake is None:
        try:
            handshake, info = child_handshake(
                ctx, address, role, rank, timeout_s=None if spare is not None else 60.0,
                check=None if worker_spares is None else worker_spares.check_alive)
        except SpareLost as exc:
            _lost(title, exc)
    if spare is not None:
        title = spare.title
        set_process_title(title)
    try:
        config = config or msgspec.json.decode(info.config_json, type=EngineConfig)
        role_main(config, info, handshake, ctx, **extra)
    except SystemExit:
        raise
    except ConfigError as exc:
        # NOTE: not logged here: the message travels up to `bastion serve`, which prints it as
        # its one line (a start-up that cannot fit max_model_len, for example).
        logging.getLogger(title).debug("%s failed", title, exc_info=True)
        try:
            handshake.send_multipart(encode(Failure(role, rank, str(exc), is_user_error=True)))
        except zmq.ZMQError:
            pass
        sys.exit(1)
    except BaseException as exc:
        logging.getLogger(title).exception("%s failed", title)
        try:
            handshake.send_multipart(encode(Failure(role, rank, f"{type(exc).__name__}: {exc}\n"
                                                    f"{traceback.format_exc(limit=3)}")))
        except zmq.ZMQError:
            pass
        sys.exit(1)


def _start_worker_spares(spare: SpareSettings, ctx: zmq.Context) -> Spares:
    settings = {r: SpareSettings(f"bastion::worker-{spare.engine_id}-{r}", spare.device,
                                 engine_id=spare.engine_id, tp_size=spare.tp_size,
                                 config_json=spare.config_json)
                for r in range(spare.num_workers)}
    address = ipc_address(spare.runtime_dir, f"engine{spare.engine_id}-ws-{os.getpid()}")
    return Spares(ctx, address, "worker", settings)


def _cold_worker_settings(config: EngineConfig, info: HandshakeInfo) -> SpareSettings:
    """An engine's launch as the settings of an engine spare: what its workers need to start."""
    tp = config.parallel.tensor_parallel_size
    return SpareSettings(f"bastion::engine-{info.rank}", config.model.device, tp,
                         info.launch.runtime_dir, info.rank, tp, info.config_json.decode())


def _warm_up(role: str, rank: int, title: str, spare: SpareSettings,
             worker_spares: Spares | None, start: float) -> None:
    """Everything a spare does before its HELLO (an engine spare: until its worker spares
    said theirs)."""
    _prepare_spare(role, rank, spare)
    own_s = time.perf_counter() - start
    if worker_spares is not None:
        try:
            worker_spares.wait_ready()
        except SpareLost as exc:
            _lost(title, exc)
    logger.info("%s: warm spare ready %.1f s after its spawn (%.1f s of its own%s; host RSS "
                "%.0f MiB)", title, time.time() - spare.spawned_at, own_s,
                f", with {spare.num_workers} worker spare(s)" if worker_spares else "",
                _rss_mib())


def _lost(title: str, exc: SpareLost) -> None:
    """A worker spare of this engine spare died: the set is incomplete, so it goes as a whole
    (the sentinel replaces it; serving is not touched)."""
    logger.warning("%s: its worker spare %s; exiting, to be replaced", title,
                   str(exc).removeprefix("bastion::spare-"))
    logging.shutdown()
    os._exit(3)  # at once: its sentinel starts the next set when it sees the exit


def _prepare_spare(role: str, rank: int, spare: SpareSettings) -> None:
    """What a spare does before it waits: the imports that loading a model config pulls in
    and device initialisation (a worker on a GPU)."""
    # NOTE: transformers imports a model type's config module (and with it hundreds of
    # modules) at its first lookup: measured 6-9 s of a promotion on a loaded 2-core host.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        CONFIG_MAPPING[model_type]
    if spare.config_json:
        from bastion.core.loader import resolve_model

        try:  # memoized per process: the promoted spare finds it done
            resolve_model(msgspec.json.decode(spare.config_json, type=EngineConfig).model)
        except Exception:  # the launch resolves again, and reports what fails
            logger.warning("warm spare: resolving the model failed", exc_info=True)
    if role == "worker" and spare.device == "cuda":
        import torch

        index = (spare.engine_id * spare.tp_size + rank) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        torch.empty(1, device=f"cuda:{index}")  # creates the context


def _rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_now(0)
