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
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")

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


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "",
             stream: IO[str] | None = None) -> Iterator[T]:
    """Yield from ``iterable``, reporting progress: a bar redrawn in place on a terminal, and
    otherwise (journald, files) only three log lines - start, halfway, done with the duration -
    since a redrawn bar would flood the journal."""
    stream = sys.stderr if stream is None else stream
    if total is None:
        total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
    if stream.isatty():
        return _bar(iterable, total, desc, stream)
    return _log_lines(iterable, total, desc)


def _log_lines(iterable: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    start = time.monotonic()
    logger.info("%s: started%s", desc, f" ({total} items)" if total is not None else "")
    count = 0
    half = None if not total else (total + 1) // 2
    for item in iterable:
        yield item
        count += 1
        if count == half and count != total:
            logger.info("%s: 50%% (%d/%d)", desc, count, total)
    logger.info("%s: done, %d items in %.2f s", desc, count, time.monotonic() - start)


def _bar(iterable: Iterable[T], total: int | None, desc: str, stream: IO[str],
         width: int = 30, min_redraw_s: float = 0.1) -> Iterator[T]:
    start = last_draw = time.monotonic()
    count = 0

    def draw() -> None:
        elapsed = time.monotonic() - start
        if total:
            filled = width * count // total
            bar = "#" * filled + "." * (width - filled)
            stream.write(f"\r{desc} [{bar}] {count}/{total} {elapsed:.1f}s")
        else:
            stream.write(f"\r{desc} {count} {elapsed:.1f}s")
        stream.flush()

    draw()
    for item in iterable:
        yield item
        count += 1
        now = time.monotonic()
        if now - last_draw >= min_redraw_s:
            draw()
            last_draw = now
    draw()
    stream.write("\n")
    stream.flush()
