"""Stop sequences on streamed text: text is released only once it cannot start a stop string.

Invariants: the concatenation of everything `feed` and `flush` return equals the generated text
cut just before the first occurrence of any stop string (the whole text when none occurs); no
released text ever contains a stop string or is later retracted.
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it

    def feed(self, text: str) -> str:
        """Add generated text; return the part that is safe to send. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        cut, self.matched = min(((i, s) for s, i in ((s, self.pending.find(s)) for s in self.stops) if i >= 0),
                                default=(-1, None))
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        hold = 0  # longest suffix of pending that is a proper prefix of a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        """The held-back text at the end of generation (it did not become a stop string)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
