"""A one-line progress indication on stderr: rewritten in place on a terminal, a line per quarter
otherwise (so logs stay short)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._quarter = 0

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.start
        return f"{self.label}: {self.done}/{self.total} requests, {elapsed:.1f} s"

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()
            return
        quarter = 4 * self.done // max(self.total, 1)
        if quarter > self._quarter:
            self._quarter = quarter
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
