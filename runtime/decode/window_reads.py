"""WindowReads: a verify window's demand reads, by the window positions that needed them.

A verify window is [pending, d_1 .. d_K]. spmoe forecasts from the drafter's hidden states, and the
drafter has states for pending .. d_{K-1} only: it never feeds its last draft d_K within the round
(runtime/decode/pairing.py's forecast_last, off by default). So the forecast is blind to the experts only
d_K routes to, and each of those that is not resident is a demand read the verify waits for. Counting
every demand read of a window by who needed it says what feeding d_K (one more drafter forward a round)
could save, and what no forecast of the drafter's states can:

- last_only: only d_K routed to it (what forecast_last could forecast);
- first_only: only pending routed to it (the drafter's first state of the round);
- middle_only: only one of d_1 .. d_{K-1} routed to it (the forecast had its state);
- shared: two or more window tokens routed to it;
- unrouted: no token's final routing names it (a repair read it for a layer input that changed).

Invariant: each demand read of a counted window lands in exactly one of the five; windows of one token
(plain rounds) are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np


@dataclass
class WindowReads:
    windows: int = 0  # verify windows of two or more tokens counted
    first_only: int = 0
    middle_only: int = 0
    last_only: int = 0
    shared: int = 0
    unrouted: int = 0

    @property
    def total(self) -> int:
        return self.first_only + self.middle_only + self.last_only + self.shared + self.unrouted

    def add(self, routing: dict[int, np.ndarray], reads: dict[int, np.ndarray], n_tokens: int) -> None:
        """One window of `n_tokens`: routing[layer] its expert ids (n_tokens, k) (the last rows if a layer was
        observed more than once), reads[layer] the experts its forward read in that layer."""
        if n_tokens < 2:
            return
        self.windows += 1
        for layer, experts in reads.items():
            ids = routing.get(layer)
            # Python sets over a few ints: a numpy op per read would cost more than the whole check (right after an eval)
            rows = [] if ids is None else np.asarray(ids).reshape(-1, np.shape(ids)[-1])[-n_tokens:].tolist()
            rows = [set(r) for r in rows]
            for e in np.asarray(experts).reshape(-1).tolist():
                used = [e in r for r in rows]  # which window tokens routed to e
                n = sum(used)
                if n == 0:
                    self.unrouted += 1
                elif n > 1:
                    self.shared += 1
                elif used[-1]:
                    self.last_only += 1
                elif used[0]:
                    self.first_only += 1
                else:
                    self.middle_only += 1

    @classmethod
    def summed(cls, rows: list[dict]) -> "WindowReads":
        """Several counters' to_json() rows over the same windows in different layers (pipeline ranks): the reads
        add up, the windows are each rank's (the most any rank counted)."""
        out = cls(windows=max((row["windows"] for row in rows), default=0))
        for f in fields(cls):
            if f.name != "windows":
                setattr(out, f.name, sum(row[f.name] for row in rows))
        return out

    def line(self) -> str:
        """'verify reads N/window, X% for the last draft only', or '' when no counted window read."""
        if not self.total:
            return ""
        return f"verify reads {self.total / max(1, self.windows):.2f}/window, {self.last_only / self.total:.0%} for the last draft only"

    def to_json(self) -> dict:
        return {**asdict(self), "total": self.total}
