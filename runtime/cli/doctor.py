"""`specmoe doctor`: measure what matters on this machine and print a report to paste into an issue.

Invariants: finishes in under two minutes (under 30 s with --quick); prints the report even when a
check fails (that check shows its error); `--json PATH` writes the same dict atomically; a bad
`--json`/`--dir` path is one line on stderr and exit 2, checked before anything runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from runtime.cli.errors import error_line

__all__ = ["register"]


def _write_json(path: Path, report: dict) -> None:
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=".doctor-", suffix=".json")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2, default=str)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def doctor_command(
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON to PATH.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Smaller, faster checks (for tests; ~20 s).")] = False,
    data_dir: Annotated[Optional[Path], typer.Option(
        "--dir", help="Directory for the SSD probe's temporary file (default: the temp directory; use the "
                      "disk your models live on).")] = None,
    decode: Annotated[bool, typer.Option(
        "--decode/--no-decode", help="Run the embedded-pair decodes, each beside stock mlx-lm.")] = True,
) -> None:
    """Measure this machine (sync latency, cold SSD reads, decoding on the embedded pair against stock mlx-lm) beside
    the planner."""
    if json_path is not None and not (json_path.parent if str(json_path.parent) else Path(".")).is_dir():
        typer.echo(error_line(f"--json {str(json_path)!r}: directory does not exist"), err=True)
        raise SystemExit(2)
    if data_dir is not None and not data_dir.is_dir():
        typer.echo(error_line(f"--dir {str(data_dir)!r} is not a directory"), err=True)
        raise SystemExit(2)
    from runtime.doctor import render_report, run_doctor

    report = run_doctor(quick=quick, data_dir=data_dir, decode=decode,
                        progress=lambda step: typer.echo(f"doctor: {step} ...", err=True))
    typer.echo(render_report(report))
    from runtime.macos import last_doctor_path

    try:  # the engine's fast-synch decision reads the last report (runtime/macos)
        last = last_doctor_path()
        last.parent.mkdir(parents=True, exist_ok=True)
        _write_json(last, report)
    except OSError as error:
        typer.echo(f"doctor: could not keep the report for the Mac settings: {error}", err=True)
    if json_path is not None:
        _write_json(json_path, report)
        typer.echo(f"\nwrote {json_path}; feed it to the planner with `specmoe plan --from-doctor {json_path}`")


def register(app: typer.Typer) -> None:
    """Add the `doctor` command to the project's typer app."""
    app.command("doctor")(doctor_command)
