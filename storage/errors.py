"""Errors raised for bad checkpoints and stores.

Invariant: every StoreError message names the file (and the tensor or record
when there is one) and says what was expected, in one line.
"""

from __future__ import annotations

from pathlib import Path


class StoreError(ValueError):
    """A checkpoint or packed store is malformed, inconsistent or unreadable."""

    def __init__(self, path: str | Path, problem: str, *, tensor: str | None = None):
        where = f"{path}" if tensor is None else f"{path} [{tensor}]"
        super().__init__(f"{where}: {problem}")
        self.path = str(path)
        self.tensor = tensor
        self.problem = problem
