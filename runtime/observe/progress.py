"""Progress for long steps that shows on terminals and in logs alike.

`progress_bar(console)` is rich's live bar when `console` is a terminal, and otherwise a
`LineProgress`: the same add_task / update / advance calls, printing one plain line per task every
few seconds (`SPECMOE_PROGRESS_SECONDS`, default 5; from a ticker thread, so one long call still
shows) and a last line when the step ends, so a 642-second calibration under nohup, CI or a pipe
is never silent.

Invariants: progress goes to the console it is given (stderr for every command), never stdout;
a LineProgress prints at most one line per task per interval, plus one per task at the end.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["progress_bar", "LineProgress"]


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("SPECMOE_PROGRESS_SECONDS", "5")))
    except ValueError:
        return 5.0


class LineProgress:
    """rich.progress.Progress's add_task/update/advance, as periodic plain lines."""

    def __init__(self, console, *, unit: str = "", every_s: float | None = None, clock=time.monotonic):
        self.console, self.unit, self.clock = console, unit, clock
        self.every_s = _interval() if every_s is None else every_s
        self.tasks: dict[int, dict] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker = None

    def __enter__(self) -> "LineProgress":
        if self.every_s > 0:  # a step may sit in one call for minutes: a thread keeps the lines coming
            self._ticker = threading.Thread(target=self._tick, name="specmoe-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        for task_id in list(self.tasks):
            self._print(task_id, final=exc[0] is None)

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            for task_id in list(self.tasks):
                self._print(task_id)

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        task_id = len(self.tasks)
        self.tasks[task_id] = {"description": description, "total": total, "completed": 0, "start": self.clock()}
        return task_id

    def update(self, task_id: int, *, description: str | None = None, total: float | None = None,
               advance: float = 0, **_) -> None:
        t = self.tasks[task_id]
        if description is not None:
            t["description"] = description
        if total is not None:
            t["total"] = total
        self.advance(task_id, advance)

    def advance(self, task_id: int, advance: float = 1) -> None:
        with self._lock:
            self.tasks[task_id]["completed"] += advance

    def _amount(self, n: float) -> str:
        if self.unit == "bytes":
            from runtime.cache import format_bytes

            return format_bytes(int(n))
        return f"{n:g}"

    def _print(self, task_id: int, final: bool = False) -> None:
        with self._lock:
            t = dict(self.tasks[task_id])
        done, total = t["completed"], t["total"]
        amount = self._amount(done) + (f"/{self._amount(total)} ({100 * done / total:.0f}%)" if total else "")
        state = "done, " if final else ""
        self.console.print(f"{t['description']}: {amount}, {state}{self.clock() - t['start']:.0f} s elapsed",
                           highlight=False, markup=False)


def progress_bar(*columns, console, transient: bool = True, unit: str = ""):
    """rich's Progress on a terminal, else a LineProgress (one line every few seconds)."""
    if console.is_terminal:
        from rich.progress import Progress

        return Progress(*columns, console=console, transient=transient)
    return LineProgress(console, unit=unit)
