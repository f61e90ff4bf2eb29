"""Writing results for scripts: `--json PATH` outputs and console helpers.

Invariant: a JSON file is written to a temporary sibling and renamed into place,
so a reader never sees half a file and a failed run leaves no file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console

# Tables go to pipes and logs as often as to terminals: do not squeeze them to 80 columns there (the widest,
# the demo's 12 columns, needs ~190); COLUMNS, if set, still decides.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200)
err_console = Console(stderr=True, soft_wrap=True)  # progress, budgets and notes: stderr, so stdout stays pipeable


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fail(message: str, code: int = 2) -> None:
    """Print a one-line error and exit (used for input errors found by the CLI itself)."""
    print(f"specmoe: error: {message}", file=sys.stderr)
    raise SystemExit(code)
