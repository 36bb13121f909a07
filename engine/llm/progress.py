"""Progress bars on stderr for the slow parts of start-up (loading a model, capturing
graphs) and for a run: redrawn in place on a terminal, one line per stage in a log."""
from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24


class Bar:
    """`bar.update(done)` / `bar.close()`; `total` units of work, named by `label`."""

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.done = 0
        self.note = ""

    def _line(self) -> str:
        filled = WIDTH * min(self.done, self.total) // self.total
        seconds = time.perf_counter() - self.start
        note = f", {self.note}" if self.note else ""
        return f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total}{note} ({seconds:.1f} s)"

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        self.done, self.note = done, note
        if total is not None:
            self.total = max(total, 1)
        if self.enabled and self.stream.isatty():
            print("\r" + self._line(), end="", file=self.stream, flush=True)

    def close(self, note: str = "") -> float:
        """Draw the finished bar (the only line a log gets) and return the seconds it took."""
        self.done, self.note = self.total, note
        if self.enabled:
            print(("\r" if self.stream.isatty() else "") + self._line(), file=self.stream, flush=True)
        return time.perf_counter() - self.start
