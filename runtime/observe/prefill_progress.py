"""PrefillProgress: a progress display for prompt processing that lasts more than a moment.

Nothing is shown for a prefill that ends within `delay_s` (default one second). After that, on
a terminal a rich progress bar on stderr; elsewhere (a pipe, a log file) plain lines, at most one
per `every_s` seconds, and a last line with the tokens/s when done.

Invariants: the display only reads the fraction it is given (never the model); update() with a
fraction that goes backwards is ignored; close() is idempotent and always ends the bar.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class PrefillProgress:
    def __init__(self, n_tokens: int, *, stream: TextIO | None = None, delay_s: float = 1.0, every_s: float = 5.0,
                 tty: bool | None = None, clock=time.perf_counter):
        self.n_tokens = n_tokens
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = delay_s
        self.every_s = every_s
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.t0 = clock()
        self.fraction = 0.0
        self.shown = False  # anything displayed yet
        self._last_line = None  # time of the last plain line
        self._bar = None
        self._task = None
        self._closed = False

    def update(self, fraction: float) -> None:
        """The share of the prefill done, 0..1."""
        if self._closed or fraction < self.fraction:
            return
        self.fraction = min(1.0, fraction)
        now = self.clock()
        if now - self.t0 < self.delay_s:
            return
        if self.tty:
            self._show_bar()
        elif self._last_line is None or now - self._last_line >= self.every_s:
            self._line(now)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.update(self._task, completed=self.n_tokens)
            self._bar.stop()
        if self.shown:
            s = self.clock() - self.t0
            print(f"prefill: {self.n_tokens} tokens in {s:.1f} s ({self.n_tokens / s:.0f} tok/s)", file=self.stream,
                  flush=True)

    def _show_bar(self) -> None:
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("prefill"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total} tokens"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=Console(file=self.stream), transient=True)
            self._task = self._bar.add_task("prefill", total=self.n_tokens)
            self._bar.start()
            self.shown = True
        self._bar.update(self._task, completed=self.fraction * self.n_tokens)

    def _line(self, now: float) -> None:
        self._last_line = now
        self.shown = True
        print(f"prefill: {self.fraction:.0%} of {self.n_tokens} tokens, {now - self.t0:.1f} s", file=self.stream, flush=True)
