"""Bookkeeper: an accepted forward's MoE calls, booked with the cache off the critical path.

Each forward the device pass (runtime/decode/device_pass.py) accepts is handed over as a `ForwardRecord`: its
layers' expert ids and lookup codes, the calls that took the synced path, the reads its repairs and route syncs
made. `flush()` books them: recency, hits, misses and prefetch use in the cache, then the observer and telemetry get
the calls [(layer, expert ids (T, k), unique experts, (hits, misses, prefetch_used, bytes_read, stall_ms))], in layer
order. Plain decoding calls `flush(defer=True)` after queueing the next forward, so the booking overlaps that
forward's compute (on MLX's CPU backend too: `mx.async_eval` returns with the forward's ops still in flight,
bench/results/backend.txt, row 5).

Invariants: records are booked in the order they were accepted, each once; a hit forward (every layer looked up on
the device, nothing read) may wait for up to DEFER_FORWARDS - 1 later ones, and is booked from its slots only while
no expert lost its slot since its sync (else from its expert ids); whatever may choose a victim (a repair, a route
sync's reads, a build with synced layers) calls flush() first, so eviction choices see every earlier
use; reads a repair made for experts the accepted forward did not use count as wasted; a layer that took the synced
path is booked from its own calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

DEFER_FORWARDS = 16  # hit forwards whose bookkeeping flush(defer=True) books together


@dataclass
class ForwardRecord:
    host: dict  # MoE layer -> (expert ids (T, k), lookup codes (T, k)) of the layers looked up on the device
    synced: dict  # MoE layer -> (expert ids (T*, k), [CallStats]) of the layers that took the synced path
    loaded: dict  # MoE layer -> [(experts read, bytes, ms)] by its repairs and route syncs
    hit: tuple | None  # (layers, codes (L, T, k), eviction mark) of a one-token forward that read nothing, else None


class Bookkeeper:
    def __init__(self, cache, modules: dict, order: list, om, stats):
        self.cache = cache  # the ExpertCache the forwards read
        self.modules = modules  # MoE layer -> CachedSwitchGLU (its observer)
        self.order = order  # MoE layers in decoder order
        self.om = om  # for its telemetry (read at each flush: it may change between generations)
        self.stats = stats  # the pass's PassStats (wasted_reads, bookkeeping_s)
        self._waiting: list[ForwardRecord] = []

    def add(self, record: ForwardRecord, defer: bool = False) -> None:
        """Queue an accepted forward's record; book it now unless `defer` lets a hit forward wait."""
        self._waiting.append(record)
        if defer and record.hit is not None and len(self._waiting) < DEFER_FORWARDS:
            return
        self.flush()

    def flush(self) -> None:
        """Book every waiting record, in order."""
        if not self._waiting:
            return
        t0 = time.perf_counter()
        records, self._waiting = self._waiting, []
        for r in records:
            self._book(r)
        self.cache.unprotect()  # the forwards have passed every layer: their forecasts have served
        self.stats.bookkeeping_s += time.perf_counter() - t0

    def _book(self, r: ForwardRecord) -> None:
        calls = self._hit_calls(r.host, r.hit) if r.hit is not None else None
        if calls is None:
            calls, wasted = self._calls(r.host, r.synced, r.loaded)
            self.stats.wasted_reads += wasted
        for layer, ids, _, _ in calls:
            observer = self.modules[layer].observer
            if observer is not None:
                observer(layer, ids)
        if self.om.telemetry is not None:
            self.om.telemetry.on_forward(calls)

    def _hit_calls(self, host: dict, hit: tuple) -> list | None:
        """The calls of a one-token forward that hit everywhere, booked from its lookup codes (its slots),
        or None when an expert lost its slot since its sync (then _calls() books the expert ids)."""
        layers, codes, mark = hit
        used = self.cache.record_hit_forward(layers, codes.reshape(len(layers), -1).tolist(), mark)
        if used is None:
            return None
        k = codes.shape[-1]
        return [(layer, host[layer][0], k, (k, 0, u, 0, 0.0)) for layer, u in zip(layers, used)]

    def _calls(self, host: dict, synced: dict, loaded: dict) -> tuple[list, int]:
        """Book a forward's calls from their expert ids: [(layer, ids, n_unique, stats)] and wasted reads."""
        rows, wasted = [], 0
        for layer in self.order:
            h = host.get(layer)
            if h is None:
                continue
            ids = h[0]
            unique = ids[0] if ids.shape[0] == 1 else np.unique(ids)  # one token's k experts are distinct
            reads = loaded.get(layer) if loaded else None
            if reads:
                read = np.concatenate([r for r, _, _ in reads])
                used = int(np.isin(read, unique).sum())
                wasted += len(read) - used
                nbytes = sum(b for _, b, _ in reads)  # all of the layer's repair reads, used or not
                rows.append((layer, unique, used, len(read), nbytes, sum(ms for _, _, ms in reads)))
            else:
                rows.append((layer, unique, 0, 0, 0, 0.0))
        booked = self.cache.record_forward(rows)
        if not synced:  # every MoE layer looked up on the device: rows are the calls, in order
            return [(r[0], host[r[0]][0], len(r[1]), st) for r, st in zip(rows, booked)], wasted
        by_layer = {r[0]: (len(r[1]), st) for r, st in zip(rows, booked)}
        calls = []
        for layer in self.order:
            if layer in by_layer:
                calls.append((layer, host[layer][0], *by_layer[layer]))
            elif layer in synced:
                ids, cs = synced[layer]
                calls.append((layer, ids, len(np.unique(ids)), _sum_calls(cs)))
        return calls, wasted


def _sum_calls(calls: list) -> tuple:
    """(hits, misses, prefetch_used, bytes_read, stall_ms) over the groups of a synced (split) call."""
    return (sum(c.hits for c in calls), sum(c.misses for c in calls), sum(c.prefetch_used for c in calls),
            sum(c.bytes_read for c in calls), sum(c.stall_ms for c in calls))
