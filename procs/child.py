"""Entry point of every child process: ``python -m bastion.procs.child ROLE RANK TITLE ADDR PPID``.

Sets the title, ties its life to the parent, performs the HELLO/HANDSHAKE part of start-up
and hands over to the role's main function (which says READY when it is).
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback

import msgspec
import zmq

from bastion.core.config import ConfigError, EngineConfig
from bastion.ipc.codec import encode
from bastion.ipc.messages import Failure
from bastion.procs.lifecycle import child_handshake, die_with_parent, set_process_title
from bastion.procs.logs import setup_logging


def main(argv: list[str]) -> None:
    role, rank, title, address, parent_pid = argv[0], int(argv[1]), argv[2], argv[3], int(argv[4])
    die_with_parent(parent_pid)
    set_process_title(title)
    setup_logging()
    # The parent coordinates shutdown; a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context.instance()
    handshake, info = child_handshake(ctx, address, role, rank)
    try:
        config = msgspec.json.decode(info.config_json, type=EngineConfig)
        if role == "worker":
            from bastion.procs.worker import run_worker

            run_worker(config, info, handshake, ctx)
        elif role == "engine":
            from bastion.procs.engine import run_engine

            run_engine(config, info, handshake, ctx)
        elif role == "sentinel":
            from bastion.sentinel.sentinel import run_sentinel

            run_sentinel(config, info, handshake, ctx)
        else:
            raise ValueError(f"unknown role {role!r}")
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


if __name__ == "__main__":
    main(sys.argv[1:])
