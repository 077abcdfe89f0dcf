"""Progress of long loads: a bar redrawn in place on a terminal, three log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")
logger = logging.getLogger("bastion")


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
