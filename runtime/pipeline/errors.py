"""PipelineError: what every rank reports when the pipeline cannot go on.

Invariant: a failure anywhere in the pipeline ends every rank with a PipelineError
(or a clean exit on a STOP), never a hang: every receive has a timeout, a rank that
fails tells the next rank before it exits, and the message names the rank at fault.
"""

from __future__ import annotations


class PipelineError(RuntimeError):
    """The pipeline stopped; `rank` is the rank the problem is attributed to (None: unknown)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
