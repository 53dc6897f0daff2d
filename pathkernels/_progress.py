"""Progress bars: tqdm when installed, else a plain counter on stderr (every 10 %)."""

from __future__ import annotations

import sys


class _PlainProgress:
    def __init__(self, total: int, unit: str, desc: str):
        self.total, self.unit, self.desc = total, unit, desc
        self.done, self.shown = 0, 0

    def update(self, count: int = 1) -> None:
        self.done += count
        tenth = 10 * self.done // max(self.total, 1)
        if tenth > self.shown or self.done >= self.total:
            self.shown = tenth
            print(f"{self.desc}: {self.done:,}/{self.total:,} {self.unit}s", file=sys.stderr)

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, *, enabled: bool = True, unit: str = "path", desc: str = "pathkernels"):
    """A bar with ``update(count)``, ``set_postfix_str(text)`` and ``close()``; None when not enabled."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return _PlainProgress(total, unit, desc)
    return tqdm(total=total, unit=unit, unit_scale=True, desc=desc)
