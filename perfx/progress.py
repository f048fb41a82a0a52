"""Terminal output: a table formatter and a progress bar on stderr for long work (loads, selftest, tuning sweeps); silent when not a terminal
unless asked, so scripts and `--json` output stay clean."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    def __init__(self, total: int, label: str = "", stream=None, enabled: bool | None = None, width: int = 28):
        self.total, self.label, self.done = max(int(total), 1), label, 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width, self.started, self.note = width, time.perf_counter(), ""
        self._lock = threading.Lock()   # a load's builds note their progress from a thread of their own

    def update(self, step: int = 1, note: str = ""):
        with self._lock:
            self._update(step, note)

    def _update(self, step: int, note: str):
        self.done = min(self.done + step, self.total)
        self.note = note or self.note
        if self.enabled:
            filled = int(self.width * self.done / self.total)
            elapsed = time.perf_counter() - self.started
            eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
            bar = "#" * filled + "-" * (self.width - filled)
            line = f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {self.note}"
            self.stream.write(line[:160].ljust(100))
            self.stream.flush()

    def close(self):
        with self._lock:
            if self.enabled:
                self.stream.write("\n")
                self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def format_table(rows: list[tuple]) -> str:
    """Rows of cells (the first is the header) as aligned text columns, a rule under the header."""
    rows = [tuple(str(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
