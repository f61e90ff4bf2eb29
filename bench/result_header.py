"""The first line of a full-scale bench's result file: the bench, its arguments, the UTC start time, the load
average before and after, the wall time and an optional note on the conditions. Invariant: one line, in the
order tests/test_readme_results.py reads (the date right after the arguments)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_result(out: str | Path, bench: str, argv: list[str] | None, t0: float, load0: str, text: str,
                 note: str = "") -> None:
    """Write `text` to `out` under the header line; `argv` None: this process's own arguments."""
    head = (f"# {bench}: {' '.join(sys.argv[1:] if argv is None else argv)} | "
            f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime(t0))} | load average before {load0}, after {loadavg()}"
            f" | wall {time.time() - t0:.0f} s" + (f" | {note}" if note else ""))
    Path(out).write_text(head + "\n" + text + "\n")
