"""Logging set-up for a daemon whose stderr is read by journald or a terminal.

Under systemd, stderr is a journald stream (``JOURNAL_STREAM`` names it): journald stamps each
line with the time itself, so lines carry only a ``<N>`` syslog priority prefix that journald
turns into the entry's priority (``journalctl -p warning`` then works). Anywhere else lines read
``time level name: message``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO

_PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JOURNAL_FORMAT = "%(name)s: %(message)s"
# syslog priorities (sd-daemon.h's SD_ERR ... SD_DEBUG)
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
               (logging.INFO, 6), (logging.DEBUG, 7))

logger = logging.getLogger("bastion")


def is_journal_stream(stream: IO[str]) -> bool:
    """True when ``stream`` is the journald stream systemd gave us. ``JOURNAL_STREAM`` is
    inherited by children whose stderr may point elsewhere, so its ``device:inode`` must match
    the stream's own file (as systemd.exec(5) advises)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return (int(device), int(inode)) == (st.st_dev, st.st_ino)
    except (ValueError, OSError, AttributeError):
        return False


class JournalFormatter(logging.Formatter):
    """``<N>name: message``; every line of a multi-line record (a traceback) gets the prefix,
    because journald makes each line its own entry."""

    def __init__(self) -> None:
        super().__init__(_JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def _priority(levelno: int) -> int:
    for threshold, priority in _PRIORITIES:
        if levelno >= threshold:
            return priority
    return 7


def setup_logging(level: str | int = "INFO", stream: IO[str] | None = None) -> logging.Handler:
    """Send the root logger to ``stream`` (stderr) in the journald or plain form.

    Idempotent: a handler installed by an earlier call is replaced, so child processes that
    call it again do not print every line twice. Returns the handler.
    """
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    handler.set_name("bastion")
    if is_journal_stream(stream):
        handler.setFormatter(JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter(_PLAIN_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "bastion"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def console_logging(level: int = logging.INFO) -> None:
    """Show bastion's log lines (load phases, bars) on stderr when the program has set up no
    logging of its own (``LLM(...)`` in a script); a program that has keeps its own."""
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(level)
