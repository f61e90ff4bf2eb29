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
- One ticket at a time fills a loading slot (the one in _tickets); callers wait on it.
- A failed/cancelled prefetch frees its slot only if no demand call pins it, else
  the slot is re-read at demand priority for that call; a failed submit frees it.
- Safety checks raise (never `assert`): no slot -1 in a gather index under -O.
- Resizing (memory governor): only slots [0, usable) are filled; a new size applies
  at the layer's next usable_slots() (once per call), so a call never sees its
  capacity shrink under it. Experts beyond `usable` are evicted once unpinned;
  their free slots' pages go back to the OS where possible (runtime/cache/slab.py).
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np

from runtime.cache.cache_stats import CallStats, ResizeStats
from runtime.cache.resident_tables import ResidentTables
from runtime.cache.slab import allocate_slab, allocate_table, release_pages
from runtime.cache.slot_table import FREE, LOADING, VALID, SlotTable
from storage import AsyncLoader, ExpertKey, LayerLayout
from storage.loader import DEMAND, PREFETCH, LoadTicket


class ExpertCache(ResidentTables):
    """Budgeted per-layer expert slots backed by MLX slabs (device lookup: runtime/cache/resident_tables.py)."""

    def __init__(self, layouts: dict[int, LayerLayout], slots: dict[int, int], loader: AsyncLoader, policy: str = "lru",
                 min_usable: int = 1):
        self.layouts = layouts
        self.loader = loader
        self.device_tables: dict[int, mx.array] = {}  # layer -> expert -> slot if valid, else n_slots + expert

        def resident(layer: int, codes: np.ndarray) -> np.ndarray:
            self.device_tables[layer], host = allocate_table(codes)
            return host

        self.table = SlotTable({l: lay.n_experts for l, lay in layouts.items()}, slots, policy, resident)
        self.min_usable = min_usable  # resizing never goes below this (the model's top-k: one token's experts)
        self.resize_stats = ResizeStats()
        self.host_syncs = 0  # router read-backs, device-pass syncs, token read-backs: counted by the callers that make them
        self.active_pass = None  # the device pass building a forward now: its modules look slots up on the device
        self._lock = threading.RLock()
        self._ids_are_slots: tuple[int, frozenset] = (-1, frozenset())  # (table version, layers) of ids_are_slots()
        self._protected: dict[ExpertKey, int] = {}  # forecast experts pinned until their layer is verified
        self._tickets: dict[ExpertKey, LoadTicket] = {}  # the read filling each loading slot
        self._prefetch_tickets: dict[ExpertKey, LoadTicket] = {}  # those of them that prefetch() queued
        self._rereads: dict[ExpertKey, tuple[LoadTicket, LoadTicket]] = {}  # failed prefetch -> its demand re-read
        self._pending_usable: dict[int, int] = {}  # resizes asked for, applied at the layer's next call
        self._released = {l: np.zeros(n, bool) for l, n in slots.items()}  # slot pages given back to the OS
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

    def usable_now(self) -> dict[int, int]:
        """Usable slots of every layer, applying pending resizes (one lock round trip when there are some)."""
        if self._pending_usable:
            with self._lock:
                for layer in list(self._pending_usable):
                    self.usable_slots(layer)
        return {l: ls.usable for l, ls in self.table.layers.items()}

    def usable_slots(self, layer: int) -> int:
        """Slots a call of `layer` may fill. A pending resize of the layer takes effect here."""
        with self._lock:
            target = self._pending_usable.pop(layer, None)
            if target is not None:
                self._resize(layer, target)
            return self.table.layers[layer].usable

    def layers(self) -> list[int]:
        """The MoE layers this cache holds slots for, in order."""
        return list(self.table.layers)

    def total_usable_slots(self) -> int:
        with self._lock:
            return sum(ls.usable for ls in self.table.layers.values())

    @property
    def nbytes(self) -> int:
        return sum(self.n_slots(l) * lay.expert_bytes for l, lay in self.layouts.items())

    def slot_views(self, layer: int, slot: int) -> list[np.ndarray]:
        return [h[slot] for h in self._host[layer]]

    def stats(self):
        return {l: ls.stats for l, ls in self.table.layers.items()}

    # -- resizing (memory governor) ------------------------------------------------------
    def request_usable_slots(self, n: int | dict[int, int]) -> None:
        """Ask for `n` usable slots (per layer, or the same for all); thread-safe. Clamped to [min_usable, n_slots];
        applied at each layer's next usable_slots()."""
        with self._lock:
            for layer in self.table.layers:
                self._pending_usable[layer] = n[layer] if isinstance(n, dict) else n

    def set_usable_slots(self, n: int | dict[int, int]) -> int:
        """Resize now; only for callers with no call of these layers in progress (the
        decode thread between tokens, tests). Returns the experts evicted."""
        with self._lock:
            self.request_usable_slots(n)
            before = self.resize_stats.n_evicted
            for layer in self.table.layers:
                self.usable_slots(layer)
            return self.resize_stats.n_evicted - before

    def _resize(self, layer: int, n: int) -> None:
        ls = self.table.layers[layer]
        n = max(min(self.min_usable, ls.n_slots), min(int(n), ls.n_slots))
        if n == ls.usable:
            return
        if n < ls.usable:
            self.resize_stats.n_shrinks += 1
        else:
            self.resize_stats.n_grows += 1
            self._released[layer][:n] = False  # may be filled again (zero pages until loaded)
        self.resize_stats.n_evicted += self.table.set_usable(layer, n)
        self._release_beyond(layer)

    def _settle_beyond(self, layer: int) -> None:
        """After a release: drop experts left beyond the usable range and free their pages."""
        ls = self.table.layers[layer]
        if ls.usable < ls.n_slots:
            self.resize_stats.n_evicted += self.table.trim(layer)
            self._release_beyond(layer)

    def _release_beyond(self, layer: int) -> None:
        ls = self.table.layers[layer]
        released = self._released[layer]
        free = [s for s in range(ls.usable, ls.n_slots) if ls.state[s] == FREE and not released[s]]
        if not free:
            return
        # Slots are rows of each slab: release each run of consecutive free slots as one range.
        runs, start = [], free[0]
        for a, b in zip(free, free[1:] + [None]):
            if b != a + 1:
                runs.append((start, a + 1))
                start = b
        for host in self._host[layer]:
            row = host.shape[1]
            for a, b in runs:
                self.resize_stats.bytes_released += release_pages(host.ctypes.data + a * row, (b - a) * row)
        released[free] = True

    # -- demand path -------------------------------------------------------------------
    def _submit(self, key: ExpertKey, slot: int, **kw) -> LoadTicket:
        """Queue the read filling `key`'s reserved slot and remember its ticket (lock held)."""
        ticket = self.loader.submit(key, self.slot_views(key.layer, slot), on_done=self._on_done, **kw)
        self._tickets[key] = ticket
        return ticket

    def _on_done(self, ticket: LoadTicket) -> None:
        with self._lock:
            if self._tickets.get(ticket.key) is ticket:
                del self._tickets[ticket.key]
            was_prefetch = self._prefetch_tickets.get(ticket.key) is ticket
            if was_prefetch:
                del self._prefetch_tickets[ticket.key]
            if ticket.error is None and not ticket.cancelled:
                self.table.commit(ticket.key)
            elif was_prefetch and self._reread_for_demand(ticket.key, ticket):
                pass  # a demand call pins the slot: it stays loading, read again for that call
            else:
                self.table.abort(ticket.key, cancelled=ticket.cancelled)
                slot = self._protected.pop(ticket.key, None)
                if slot is not None:
                    self.table.unpin(ticket.key.layer, [slot])
            self._settle_beyond(ticket.key.layer)

    def _reread_for_demand(self, key: ExpertKey, failed: LoadTicket) -> bool:
        """After a failed/cancelled prefetch of `key` (lock held): if a demand call pins its
        slot (beyond the prefetch's protection), queue a demand read into it; True if so."""
        ls = self.table.layers[key.layer]
        slot = int(ls.expert_to_slot[key.expert])
        own = 1 if self._protected.get(key) == slot else 0
        if slot < 0 or ls.state[slot] != LOADING or ls.pins[slot] <= own:
            return False
        try:
            self._rereads[key] = (failed, self._submit(key, slot, priority=DEMAND))
        except Exception:
            return False  # the loader is closed: free the slot; the waiting call reports the failure
        return True

    def _wait_reads(self, tickets: list[LoadTicket]) -> None:
        """Wait for `tickets`, following a failed prefetch to its demand re-read; raises."""
        while True:  # each pass follows at most one re-read per key: a re-read is a demand ticket
            try:
                self.loader.wait_all(tickets)
                return
            except Exception:
                with self._lock:
                    rereads = [self._rereads.get(t.key, (None, None)) for t in tickets]
                following = [new if old is t else t for t, (old, new) in zip(tickets, rereads)]
                if all(n is t for n, t in zip(following, tickets)):
                    raise
                tickets = following

    def _await_room(self, layer: int, experts) -> bool:
        """Wait until `layer` can take the absent `experts`: unprotected prefetches still in flight occupy slots nobody
        may evict, so a call that needs them waits for their reads (promoted to demand) instead of failing for want of
        a slot. Returns whether it waited."""
        if not self._tickets:  # no read in flight (I/O threads add only re-reads into pinned slots): none to wait for
            return False
        experts = np.asarray(experts, np.int64)
        waited = False
        while True:
            with self._lock:
                ls = self.table.layers[layer]
                n_absent = int((ls.expert_to_slot[experts] < 0).sum())
                if n_absent == 0:
                    return waited
                state, pins, owner = ls.state[: ls.usable], ls.pins[: ls.usable], ls.slot_to_expert[: ls.usable]
                others = ls.not_holding(experts)
                room = int(((state == FREE) | ((state == VALID) & (pins == 0) & others)).sum())
                busy = np.flatnonzero((state == LOADING) & (pins == 0) & others)
                if n_absent <= room or not len(busy):
                    return waited  # enough room, or nothing to wait for (request() reports the shortage)
                waits = [t for t in (self._tickets.get(ExpertKey(layer, int(owner[s]))) for s in busy) if t is not None]
                for t in waits:
                    self.loader.promote(t)
            if not waits:
                return waited
            waited = True
            for t in waits:
                try:
                    t.wait()
                except Exception:
                    pass  # a failed prefetch frees its slot all the same; its error is not this call's

    # -- prefetch path -------------------------------------------------------------------
    def prefetch(self, keys: list[ExpertKey], round_id: int, max_bytes: int | None = None) -> int:
        """Queue reads of the `keys` not resident (earlier layers first), protect each till unprotect(layer); returns the bytes queued."""
        queued = 0
        with self._lock:
            # Resident keys first, pinned together per layer: reading an absent one must not evict them.
            absent, resident = [], {}
            for key in keys:
                if key in self._protected:
                    continue
                slot = int(self.table.layers[key.layer].expert_to_slot[key.expert])
                if slot < 0:
                    absent.append(key)
                else:
                    resident.setdefault(key.layer, []).append(slot)
                    self._protected[key] = slot
            for layer, slots in resident.items():
                self.table.pin(layer, slots)
            for key in absent:  # in the order given (earlier layers first)
                if key in self._protected:
                    continue  # listed twice
                nbytes = self.layouts[key.layer].expert_bytes
                if max_bytes is not None and queued + nbytes > max_bytes:
                    continue
                slot = self.table.reserve(key, prefetch=True)
                if slot is None:
                    continue  # every slot of the layer is in use: skip, demand will load it
                try:
                    ticket = self._submit(key, slot, priority=PREFETCH + key.layer, round_id=round_id)
                except BaseException:
                    self.table.abort(key)  # never leave a slot loading with no read to fill it
                    raise
                self._prefetch_tickets[key] = ticket
                self.table.pin(key.layer, [slot])
                self._protected[key] = slot
                queued += nbytes
        return queued

    def unprotect(self, layer: int | None = None) -> None:
        """End the protection of forecast experts of `layer` (all layers if None)."""
        if not self._protected:  # only this thread adds to it (prefetch): empty stays empty
            return
        with self._lock:
            slots: dict[int, list] = {}
            for key in [k for k in self._protected if layer is None or k.layer == layer]:
                slots.setdefault(key.layer, []).append(self._protected.pop(key))
            for l, held in slots.items():  # one unpin per layer
                self.table.unpin(l, held)
                self._settle_beyond(l)

    def use_valid(self, layer: int, experts: list[int], release: list[int]) -> tuple[list[int], int] | None:
        """unpin(layer, release), usable_slots(layer) and ensure() of `experts` (unique ids, at most the usable slots)
        when every one is valid, in one lock round trip: (their slots, pinned; prefetch hits). None when one is not
        valid or they are more than the usable slots: `release` is unpinned all the same, nothing else changed."""
        with self._lock:
            if release:
                self.unpin(layer, release)
            return self.table.use_valid(layer, experts) if len(experts) <= self.usable_slots(layer) else None

    def ensure(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, CallStats]:
        """Make `experts` (unique ids) valid in `layer`; returns their slots, pinned, and what it took. The caller
        must unpin(layer, slots) once every graph reading them is evaluated."""
        tickets, pinned, absent = [], [], []
        self._await_room(layer, experts)
        try:
            with self._lock:
                ls = self.table.layers[layer]
                used_before = ls.stats.prefetch_hits
                present, absent, pinned = self.table.request(layer, experts)
                prefetch_used = ls.stats.prefetch_hits - used_before
                for e in present:
                    slot = int(ls.expert_to_slot[e])
                    if ls.state[slot] == LOADING:
                        # An in-flight prefetch: wait for its own ticket at demand priority (never a 2nd read).
                        key = ExpertKey(layer, e)
                        ticket = self._tickets.get(key) or self._submit(key, slot, priority=DEMAND)
                        self.loader.promote(ticket)
                        tickets.append(ticket)
                for e in absent:  # the first read runs on this thread (waited next), the others wake I/O threads
                    tickets.append(self._submit(ExpertKey(layer, e), int(ls.expert_to_slot[e]), priority=DEMAND,
                                                wake=bool(tickets)))
            t0 = time.perf_counter()
            self._wait_reads(tickets)
            stall_ms = (time.perf_counter() - t0) * 1e3 if tickets else 0.0
            with self._lock:
                slots = ls.expert_to_slot[np.asarray(experts, np.int64)].copy()
                bad = (slots < 0) | (ls.state[slots] != VALID)
                if bad.any():
                    raise RuntimeError(f"layer {layer}: ensure() ended with experts {np.asarray(experts)[bad].tolist()} not valid")
            return slots, CallStats(len(present), len(absent), prefetch_used, len(absent) * self.layouts[layer].expert_bytes,
                                    stall_ms)
        except BaseException:
            self.loader.wake()  # a read queued for this call to run, which it will not wait for now
            with self._lock:
                for e in absent if pinned else ():
                    key = ExpertKey(layer, e)
                    if key not in self._tickets and self.table.state_of(key) == LOADING:
                        self.table.abort(key)  # reserved, but its read was never queued
                if pinned:
                    self.table.unpin(layer, pinned)
            raise

    # -- settling -------------------------------------------------------------------------
    def settle_inflight(self, layers=None) -> float:
        """Wait for every read in flight or queued (prefetches) -- of `layers` only, if given -- so their slots
        count as resident; returns the ms spent waiting. Failed prefetches are not errors here."""
        with self._lock:
            tickets = [t for k, t in self._tickets.items() if layers is None or k.layer in layers]
            for t in tickets:
                self.loader.promote(t)
        t0 = time.perf_counter()
        for t in tickets:
            try:
                t.wait()
            except Exception:
                pass  # its slot was freed; a call needing the expert reads it again
        return (time.perf_counter() - t0) * 1e3 if tickets else 0.0

    def empty(self) -> None:
        """Settle reads in flight, evict every expert (as freshly allocated; stats kept); raises if pinned."""
        self.settle_inflight()
        with self._lock:
            for layer in self.table.layers:
                self.table.clear(layer)

    def unpin(self, layer: int, slots) -> None:
        with self._lock:
            self.table.unpin(layer, slots)
            self._settle_beyond(layer)

    def slot_ids(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        """Map expert ids (any shape) to slot ids; every id must be resident."""
        with self._lock:
            slots = self.table.layers[layer].expert_to_slot[expert_ids]
        if (slots < 0).any():  # -1 would become an out-of-bounds uint32 gather index
            missing = sorted(set(np.asarray(expert_ids)[slots < 0].tolist()))
            raise RuntimeError(f"layer {layer}: slot_ids() of non-resident experts {missing}")
        return slots

    def absent(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The ids among `experts` that are neither valid nor loading in `layer` (a read would be needed)."""
        experts = np.asarray(experts, np.int64)
        with self._lock:
            return experts[self.table.layers[layer].expert_to_slot[experts] < 0]
