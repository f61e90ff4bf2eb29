"""Telemetry: what each forward pass cost, per MoE layer, fed by the modules themselves.

A round is one target forward (a decode step, a prefill chunk, a verify window or
a re-run after a rewind). The cache-backed modules report every call (the routed
expert ids and the cache's CallStats); the decoder labels rounds and says how
many of a verify window's tokens were accepted. Nothing is inferred from timings.

Invariants: per-layer and per-kind totals are the sums of all rounds' records,
while only the most recent `max_rounds` round records are kept (memory stays flat
over long runs; the soak bench checks it); a routing
trace gets exactly the tokens that became part of the output sequence (prefill,
decode, and the accepted prefix plus the target's token of each verify window;
never rejected drafts or re-runs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)  # slots: built and added up for every MoE layer of every forward
class LayerRecord:
    n_tokens: int = 0  # tokens through the layer
    n_pairs: int = 0  # (token, expert) pairs = tokens x k
    n_unique: int = 0  # distinct experts the call needed
    hits: int = 0  # of those, already resident (or loading)
    misses: int = 0  # read on demand
    prefetch_used: int = 0  # hits that a prefetch provided
    bytes_read: int = 0  # demand bytes
    stall_ms: float = 0.0  # time waiting for reads

    def add(self, other: "LayerRecord") -> None:
        # Field by field, spelled out: this runs twice per layer per forward.
        self.n_tokens += other.n_tokens
        self.n_pairs += other.n_pairs
        self.n_unique += other.n_unique
        self.hits += other.hits
        self.misses += other.misses
        self.prefetch_used += other.prefetch_used
        self.bytes_read += other.bytes_read
        self.stall_ms += other.stall_ms




@dataclass
class RoundRecord:
    index: int  # order of the round in the run
    kind: str  # "forward" (unlabelled), "prefill", "decode", "verify" or "rerun"
    n_tokens: int = 0  # tokens in the forward
    n_accepted: int | None = None  # verify: draft tokens accepted
    prefetch_queued: int = 0  # verify: experts queued by prefetch for this window
    prefetch_wasted: int = 0  # verify: queued experts the window did not use
    layers: dict[int, LayerRecord] = field(default_factory=dict)  # MoE layer -> record


class Telemetry:
    def __init__(self, moe_layers: list[int], *, keep_rounds: bool = True, trace: bool = False, max_rounds: int = 1024):
        self.moe_layers = list(moe_layers)
        self.keep_rounds = keep_rounds  # keep recent per-round records
        self.tracing = trace  # collect routing for a trace (grows with the run, by design)
        self.totals = {l: LayerRecord() for l in moe_layers}
        self.rounds: deque[RoundRecord] = deque(maxlen=max_rounds)  # the most recent rounds
        self.kinds: dict[str, LayerRecord] = {}  # all rounds of a kind, all layers summed
        self.n_rounds: dict[str, int] = {}  # rounds per kind
        self._verify_unique = 0.0  # sum over verify rounds of mean unique experts per layer
        self._verify_pairs = 0.0  # sum over verify rounds of mean (token, expert) pairs per layer
        self.sequences: list[list[np.ndarray]] = []  # per sequence: (tokens, layers, k) blocks
        self._current: RoundRecord | None = None
        self._routing: dict[int, np.ndarray] = {}
        self._label: tuple[str, int] | None = None
        self._n = 0

    # -- fed by the decoder ------------------------------------------------------------
    def new_sequence(self) -> None:
        self._close()
        self.sequences.append([])

    def label(self, kind: str) -> None:
        """Label the next forward (the modules open the round when layer calls arrive)."""
        self._close()
        self._label = (kind, 0)

    def end_verify(self, n_accepted: int, prefetch_queued: int = 0, prefetch_wasted: int = 0) -> None:
        r = self._current
        if r is not None:
            r.n_accepted, r.prefetch_queued, r.prefetch_wasted = n_accepted, prefetch_queued, prefetch_wasted
        self._close(keep_tokens=n_accepted + 1)

    # -- fed by the modules ------------------------------------------------------------
    def on_call(self, layer: int, ids: np.ndarray, calls: list) -> None:
        self._record(layer, ids, LayerRecord(ids.shape[0], ids.size, len(np.unique(ids)),
                                             sum(c.hits for c in calls), sum(c.misses for c in calls),
                                             sum(c.prefetch_used for c in calls), sum(c.bytes_read for c in calls),
                                             sum(c.stall_ms for c in calls)))

    def on_forward(self, calls: list) -> None:
        """A whole forward's calls at once, [(layer, ids (tokens, k), n_unique, (hits, misses, prefetch_used,
        bytes_read, stall_ms))], in layer order: the same records as on_call() for each, without
        re-deriving the unique experts, filed in one loop (the decoder's bookkeeping of every token)."""
        if not calls:
            return
        cur = self._current
        if cur is not None and cur.layers and calls[0][0] not in cur.layers and \
                not cur.layers.keys().isdisjoint(c[0] for c in calls):
            for layer, ids, n_unique, st in calls:  # a round already holding some of these layers: call by call
                self._record(layer, ids, LayerRecord(ids.shape[0], ids.size, n_unique, *st))
            return
        ids0 = calls[0][1]
        self._record(calls[0][0], ids0, LayerRecord(ids0.shape[0], ids0.size, calls[0][2], *calls[0][3]))
        layers, totals, routing = self._current.layers, self.totals, self._routing if self.tracing else None
        for layer, ids, n_unique, st in calls[1:]:
            rec = LayerRecord(ids.shape[0], ids.size, n_unique, *st)
            layers[layer] = rec
            totals[layer].add(rec)
            if routing is not None:
                routing[layer] = ids

    def _record(self, layer: int, ids: np.ndarray, rec: LayerRecord) -> None:
        """File one layer call; a layer seen again in the open round starts a new round."""
        if self._current is None or layer in self._current.layers:
            self._close()
            kind = self._label[0] if self._label else ("decode" if ids.shape[0] == 1 else "prefill")
            self._label = None
            self._current = RoundRecord(self._n, kind, ids.shape[0])
            self._n += 1
        self._current.layers[layer] = rec
        self.totals[layer].add(rec)
        if self.tracing:
            self._routing[layer] = ids

    def _close(self, keep_tokens: int | None = None) -> None:
        r = self._current
        if r is None:
            return
        self._current = None
        if self.keep_rounds:
            self.rounds.append(r)
        agg = self.kinds.setdefault(r.kind, LayerRecord())
        for rec in r.layers.values():
            agg.add(rec)
        self.n_rounds[r.kind] = self.n_rounds.get(r.kind, 0) + 1
        if r.kind == "verify" and r.layers:
            self._verify_unique += float(np.mean([l.n_unique for l in r.layers.values()]))
            self._verify_pairs += float(np.mean([l.n_pairs for l in r.layers.values()]))
        if self.tracing and r.kind != "rerun" and len(self._routing) == len(self.moe_layers):
            block = np.stack([self._routing[l] for l in self.moe_layers], axis=1)  # (tokens, layers, k)
            if keep_tokens is not None:
                block = block[:keep_tokens]
            if not self.sequences:
                self.sequences.append([])
            self.sequences[-1].append(block.astype(np.uint16))
        self._routing = {}

    def flush(self) -> None:
        self._close()

    # -- reading -------------------------------------------------------------------------
    def trace_sequences(self) -> list[np.ndarray]:
        self._close()
        return [np.concatenate(blocks) for blocks in self.sequences if blocks]

    def summary(self, exclude: tuple[str, ...] = ()) -> dict:
        """Totals over all rounds, or over the rounds whose kind is not in `exclude`."""
        self._close()
        t = LayerRecord()
        for kind, rec in self.kinds.items():
            if kind not in exclude:
                t.add(rec)
        n_verify = self.n_rounds.get("verify", 0)
        return {
            "rounds": sum(n for k, n in self.n_rounds.items() if k not in exclude),
            "hit_rate": t.hits / (t.hits + t.misses) if t.hits + t.misses else 1.0,
            "unique_per_layer_per_verify": self._verify_unique / n_verify if n_verify else None,
            "pairs_per_layer_per_verify": self._verify_pairs / n_verify if n_verify else None,
            "bytes_read": t.bytes_read, "stall_ms": t.stall_ms, "misses": t.misses, "hits": t.hits,
            "prefetch_used": t.prefetch_used,
        }


def read_summary(c0: dict, c1: dict, n_tokens: int) -> dict:
    """What was read between two OffloadedModel.counters() snapshots, per token: demand misses,
    prefetch reads, used (a call hit them) and wasted (evicted unused), and MB (demand + prefetch)."""
    d = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("misses", "prefetch_loaded", "prefetch_hits", "prefetch_wasted",
                                                     "bytes_read")}
    per = (lambda v: v / n_tokens) if n_tokens else (lambda v: 0.0)
    return {"demand_misses_per_token": per(d["misses"]), "prefetch_reads_per_token": per(d["prefetch_loaded"]),
            "prefetch_used_per_token": per(d["prefetch_hits"]), "prefetch_wasted_per_token": per(d["prefetch_wasted"]),
            "mb_read_per_token": per(d["bytes_read"]) / 1e6}
