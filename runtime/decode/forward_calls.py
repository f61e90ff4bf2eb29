"""ForwardCalls: an accepted forward's MoE calls, booked with the cache (DevicePass mixin).

DevicePass.flush() books each accepted forward once: recency, hits, misses and prefetch use in the cache,
then the observer and telemetry get its calls [(layer, expert ids (T, k), unique experts, (hits, misses,
prefetch_used, bytes_read, stall_ms))], in layer order.

Invariants: a hit forward (every layer looked up on the device, nothing read) is booked from its slots only
while no expert lost its slot since its sync (else from its expert ids); reads a repair made for experts the
accepted forward did not use count as wasted; a layer that took the synced path is booked from its own calls.
"""

from __future__ import annotations

import numpy as np


class ForwardCalls:
    """Mixin of DevicePass: uses its cache and order (MoE layers in decoder order)."""

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
            calls = [(r[0], host[r[0]][0], len(r[1]), st) for r, st in zip(rows, booked)]
        else:
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
