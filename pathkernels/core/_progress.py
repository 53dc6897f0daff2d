"""Progress: a tqdm bar on a terminal or in a notebook; elsewhere (a log file, CI) a plain line on
stderr about every 10 seconds, so that a log shows the work going on without a line per update."""

from __future__ import annotations

import contextlib
import sys
import time
from contextvars import ContextVar

LOG_INTERVAL = 10.0  # seconds between two plain lines

# The end (time.monotonic()) of the time limit in force, set by time_limit(); None: no limit.
_DEADLINE: ContextVar[float | None] = ContextVar("pathkernels_deadline", default=None)


class TimeLimitReached(Exception):
    """A progress bar was updated after the end of the :func:`time_limit` in force."""


@contextlib.contextmanager
def time_limit(end: float):
    """Within the block, every bar of :func:`progress_bar` (one that draws nothing where progress
    is off) raises :class:`TimeLimitReached` when it is updated after ``time.monotonic()`` has
    passed ``end``: how the command line stops a walk at its ``--time-limit`` between two chunks.
    The work that was stopped leaves no result; the caller keeps what it had before it. Per thread
    (and per asyncio task): other threads' bars are not limited."""
    token = _DEADLINE.set(float(end))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


class _Limited:
    """A bar (or None) whose ``update`` raises :class:`TimeLimitReached` past ``end``."""

    def __init__(self, bar, end: float):
        self.bar, self.end = bar, end

    def update(self, count: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(count)
        if time.monotonic() > self.end:
            self.close()
            raise TimeLimitReached

    def set_postfix_str(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _LogLines:
    """``update``/``set_postfix_str``/``close`` like tqdm's, printing a line at most every
    ``LOG_INTERVAL`` seconds, and one at the end."""

    def __init__(self, total: int, unit: str, desc: str, *, interval: float = LOG_INTERVAL):
        self.total, self.unit, self.desc, self.interval = total, unit, desc, interval
        self.done, self.postfix = 0, ""
        self.start = self.last = time.monotonic()
        self.closed = False

    def update(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._print(now)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._print(time.monotonic())

    def _print(self, now: float) -> None:
        elapsed = now - self.start
        share = self.done / self.total if self.total else 1.0
        left = f", about {elapsed * (1 - share) / share:.0f} s left" if 0 < share < 1 else ""
        postfix = f" ({self.postfix})" if self.postfix else ""
        counted = f"{self.done:,}/{self.total:,} {self.unit}s ({100 * share:.0f} %)"
        print(f"{self.desc}: {counted}, {elapsed:.0f} s{left}{postfix}", file=sys.stderr, flush=True)


def draws_bars() -> bool:
    """Whether stderr shows a bar as a bar: a terminal, or a Jupyter kernel (tqdm's widgets)."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def progress_bar(total: int, *, enabled: bool = True, unit: str = "path", desc: str = "pathkernels"):
    """A bar with ``update(count)``, ``set_postfix_str(text)`` and ``close()``; None when not enabled.

    tqdm (when installed) where bars can be drawn (:func:`draws_bars`); elsewhere plain lines on
    stderr about every 10 seconds, and one when the work ends. Within :func:`time_limit`, a bar
    that stops the work at the limit (one that draws nothing when not enabled)."""
    end = _DEADLINE.get()
    bar = _bar(total, unit, desc) if enabled else None
    return bar if end is None else _Limited(bar, end)


def _bar(total: int, unit: str, desc: str):
    if draws_bars():
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is optional
            pass
        else:
            return tqdm(total=total, unit=unit, unit_scale=True, desc=desc)
    return _LogLines(total, unit, desc)


@contextlib.contextmanager
def quiet_model_loading():
    """transformers' "Loading weights" progress bar off while reading a small local model (the
    library's fixtures, the command line's ``--model``), restored after: it prints to stderr for
    models that load in a blink. transformers is imported by the caller; without it, nothing."""
    logging = getattr(sys.modules.get("transformers"), "utils", None)
    logging = getattr(logging, "logging", None)
    if logging is None or not logging.is_progress_bar_enabled():
        yield
        return
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()
