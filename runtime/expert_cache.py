"""ExpertCache: per-layer slabs of expert slots in unified memory, filled by the loader.

Each MoE layer owns one slab per expert tensor, shaped [n_slots, *per_expert_shape],
allocated once. A slot holds one expert's slice of every tensor. The slabs are
ordinary MLX arrays, so a stock SwitchGLU can run `gather_qmm` on them with slot
ids in place of expert ids; the loader writes into zero-copy numpy views of them.

Invariants:
- Bytes of a slot change only while it is loading, i.e. after reserve() and
  before commit()/abort(); a reserved slot was free or held an unpinned expert.
- Callers pin every slot a not-yet-evaluated graph may read and unpin after it
  was evaluated, so a slot a pending graph reads is never overwritten.
- ensure() returns only after every requested expert is valid, or raises (and
  then leaves nothing pinned and no failed slot valid).
- All bookkeeping is serialised by one lock; loads complete on I/O threads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from runtime.slot_table import LOADING, VALID, SlotTable
from storage import AsyncLoader, ExpertKey, LayerLayout
from storage.loader import DEMAND, PREFETCH, LoadTicket

_MX_DTYPE = {
    "U8": mx.uint8, "U16": mx.uint16, "U32": mx.uint32, "I8": mx.int8, "I16": mx.int16,
    "I32": mx.int32, "F16": mx.float16, "F32": mx.float32,
}


@dataclass(frozen=True)
class CallStats:
    hits: int  # unique experts already valid or loading
    misses: int  # unique experts read on demand
    prefetch_used: int  # hits on experts a prefetch brought in (or was bringing in)
    bytes_read: int  # bytes of the demand reads
    stall_ms: float  # time blocked waiting for reads (demand misses and in-flight prefetches)


def allocate_slab(n_slots: int, shape: tuple[int, ...], dtype: str) -> tuple[mx.array, np.ndarray]:
    """An evaluated MLX array [n_slots, *shape] and a writable uint8 view [n_slots, nbytes] of it."""
    full = (n_slots, *shape)
    if dtype == "BF16":
        # numpy has no bfloat16: allocate 16-bit storage and view it as bf16 in MLX.
        base = mx.zeros(full, mx.uint16)
        mx.eval(base)
        slab = base.view(mx.bfloat16)
        mx.eval(slab)
        host = np.asarray(base)
    elif dtype in _MX_DTYPE:
        slab = mx.zeros(full, _MX_DTYPE[dtype])
        mx.eval(slab)
        host = np.asarray(slab)
    else:
        raise ValueError(f"cannot allocate a slab of dtype {dtype}; expected one of {sorted(_MX_DTYPE) + ['BF16']}")
    assert host.flags.writeable and host.flags.c_contiguous, "slab view must be writable and contiguous"
    return slab, host.reshape(n_slots, -1).view(np.uint8)


class ExpertCache:
    """Budgeted per-layer expert slots backed by MLX slabs."""

    def __init__(self, layouts: dict[int, LayerLayout], slots: dict[int, int], loader: AsyncLoader, policy: str = "lru"):
        self.layouts = layouts
        self.loader = loader
        self.table = SlotTable({l: lay.n_experts for l, lay in layouts.items()}, slots, policy)
        self._lock = threading.RLock()
        self._protected: dict[ExpertKey, int] = {}  # forecast experts pinned until their layer is verified
        self.slabs: dict[int, dict[str, mx.array]] = {}
        self._host: dict[int, list[np.ndarray]] = {}
        for layer, lay in layouts.items():
            arrays, hosts = {}, []
            for t in lay.tensors:
                arr, host = allocate_slab(slots[layer], t.shape, t.dtype)
                arrays[t.name] = arr
                hosts.append(host)
            self.slabs[layer], self._host[layer] = arrays, hosts

    # -- facts -----------------------------------------------------------------------
    def n_slots(self, layer: int) -> int:
        return self.table.layers[layer].n_slots

    def usable_slots(self, layer: int) -> int:
        return self.table.layers[layer].usable

    @property
    def nbytes(self) -> int:
        return sum(self.n_slots(l) * lay.expert_bytes for l, lay in self.layouts.items())

    def slot_views(self, layer: int, slot: int) -> list[np.ndarray]:
        return [h[slot] for h in self._host[layer]]

    def stats(self):
        return {l: ls.stats for l, ls in self.table.layers.items()}

    # -- demand path -------------------------------------------------------------------
    def _on_done(self, ticket: LoadTicket) -> None:
        with self._lock:
            if ticket.error is None and not ticket.cancelled:
                self.table.commit(ticket.key)
                return
            self.table.abort(ticket.key, cancelled=ticket.cancelled)
            slot = self._protected.pop(ticket.key, None)
            if slot is not None:
                self.table.unpin(ticket.key.layer, [slot])

    # -- prefetch path -------------------------------------------------------------------
    def prefetch(self, keys: list[ExpertKey], round_id: int, max_bytes: int | None = None) -> int:
        """Queue reads of the `keys` not resident (earlier layers first) and protect every
        key from eviction until unprotect(layer). Returns the bytes queued."""
        queued = 0
        with self._lock:
            for key in keys:
                if key in self._protected:
                    continue
                ls = self.table.layers[key.layer]
                slot = int(ls.expert_to_slot[key.expert])
                if slot < 0:
                    nbytes = self.layouts[key.layer].expert_bytes
                    if max_bytes is not None and queued + nbytes > max_bytes:
                        continue
                    slot = self.table.reserve(key, prefetch=True)
                    if slot is None:
                        continue  # every slot of the layer is in use: skip, demand will load it
                    self.table.pin(key.layer, [slot])
                    self._protected[key] = slot
                    self.loader.submit(key, self.slot_views(key.layer, slot), priority=PREFETCH + key.layer,
                                       round_id=round_id, on_done=self._on_done)
                    queued += nbytes
                else:
                    self.table.pin(key.layer, [slot])
                    self._protected[key] = slot
        return queued

    def unprotect(self, layer: int | None = None) -> None:
        """End the protection of forecast experts of `layer` (all layers if None)."""
        with self._lock:
            for key in [k for k in self._protected if layer is None or k.layer == layer]:
                self.table.unpin(key.layer, [self._protected.pop(key)])

    def ensure(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, CallStats]:
        """Make `experts` (unique ids) valid in `layer`; returns their slots, pinned, and what it took.

        The caller must unpin(layer, slots) once every graph reading them is evaluated.
        """
        tickets, pinned = [], []
        try:
            with self._lock:
                ls = self.table.layers[layer]
                used_before = ls.stats.prefetch_hits
                present, absent, pinned = self.table.request(layer, experts)
                prefetch_used = ls.stats.prefetch_hits - used_before
                for e in present:
                    slot = int(ls.expert_to_slot[e])
                    if ls.state[slot] == LOADING:
                        # An in-flight prefetch: wait for it, now at demand priority.
                        tickets.append(self.loader.submit(ExpertKey(layer, e), self.slot_views(layer, slot),
                                                          priority=DEMAND, on_done=self._on_done))
                for e in absent:
                    slot = int(ls.expert_to_slot[e])
                    tickets.append(self.loader.submit(ExpertKey(layer, e), self.slot_views(layer, slot),
                                                      priority=DEMAND, on_done=self._on_done))
            t0 = time.perf_counter()
            self.loader.wait_all(tickets)
            stall_ms = (time.perf_counter() - t0) * 1e3 if tickets else 0.0
            with self._lock:
                slots = ls.expert_to_slot[np.asarray(experts, np.int64)].copy()
                assert (slots >= 0).all() and (ls.state[slots] == VALID).all(), "ensure() returned an invalid slot"
            stats = CallStats(len(present), len(absent), prefetch_used, len(absent) * self.layouts[layer].expert_bytes, stall_ms)
            return slots, stats
        except BaseException:
            with self._lock:
                if pinned:
                    self.table.unpin(layer, pinned)
            raise

    def unpin(self, layer: int, slots) -> None:
        with self._lock:
            self.table.unpin(layer, slots)

    def slot_ids(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        """Map expert ids (any shape) to slot ids; every id must be resident."""
        with self._lock:
            slots = self.table.layers[layer].expert_to_slot[expert_ids]
        assert (slots >= 0).all(), "slot_ids() of a non-resident expert"
        return slots
