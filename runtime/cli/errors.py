"""The one format every `specmoe` command prints an input error in.

Invariant: an error is exactly one line on stderr, `specmoe: error: WHAT` (WHAT names the flag or
file and what was expected); a multi-line message is joined with "; ", and click's usage errors
(unknown flag, missing option, value out of range or of the wrong type) use the same line, with
the command whose `-h` explains the flag.
"""

from __future__ import annotations

__all__ = ["PREFIX", "error_line", "usage_line"]

PREFIX = "specmoe: error: "


def error_line(message: object) -> str:
    """`message` as the one error line (blank lines dropped, the others joined with "; ")."""
    parts = [line.strip() for line in str(message).splitlines() if line.strip()]
    return PREFIX + "; ".join(parts)


def usage_line(error) -> str:
    """A click usage error as the one error line, e.g. `specmoe: error: Invalid value for '--max-tokens' /
    '-n': Input should be greater than or equal to 1 (see `specmoe generate -h`)`."""
    ctx = getattr(error, "ctx", None)
    where = f" (see `{ctx.command_path} -h`)" if ctx is not None and ctx.command_path else ""
    return error_line(" ".join(error.format_message().split()) + where)
