"""Progress: a tqdm bar on a terminal or in a notebook; elsewhere (a log file, CI) a plain line on
stderr about every 10 seconds, so that a log shows the work going on without a line per update."""

from __future__ import annotations

import sys
import time

LOG_INTERVAL = 10.0  # seconds between two plain lines


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
    stderr about every 10 seconds, and one when the work ends."""
    if not enabled:
        return None
    if draws_bars():
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is optional
            pass
        else:
            return tqdm(total=total, unit=unit, unit_scale=True, desc=desc)
    return _LogLines(total, unit, desc)
