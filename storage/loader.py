"""AsyncLoader: a pool of I/O threads paging expert records into caller buffers.

Contract:
- submit() queues one (key, views) read; demand requests (priority 0) are served
  before prefetches (priority >= 1), lower priority first, then FIFO.
- A ticket's bytes are read as pieces (storage/read_plan.py, at most piece_bytes
  each): several threads read one large expert at once. A ticket keeps its place
  in the queue until its last piece is taken; it is done when every piece is read.
- A key already queued or being read is not read twice: the second submit gets
  the first ticket (and raises its priority if the new one is more urgent);
  promote(ticket) raises the priority of a ticket the caller already holds.
- cancel_stale(round_id) drops queued prefetches of other rounds; a read already
  started (any piece taken) is never interrupted.
- Transient OS errors, and reads that return fewer bytes than asked, are
  retried per piece (bounded, with backoff); with verify_checksums the whole
  record is checked once its last piece is in, and a CRC mismatch is re-read once.
  A request that cannot be served fails its ticket with a StoreError naming
  layer, expert, file and offset.
- wait_all() reads any piece of its tickets no I/O thread has taken yet on the calling
  thread (most urgent first) instead of waiting for a thread to wake for it; a caller
  about to wait submits its first read with wake=False (no thread woken for its first
  piece; one for each further piece).
- No ticket is left unserved: one queued with wake=False is taken by the next woken
  I/O thread, by wake(), drain() or close() if its caller does not wait for it.
- on_done(ticket) runs exactly once per ticket (done, failed or cancelled) before
  waiters are released, so callers observe the bookkeeping it does.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from storage.checksum import crc32_of
from storage.errors import StoreError
from storage.keys import ExpertKey
from storage.read_plan import PieceRead, plan_pieces
from storage.reader import IO_MODES, RangeReader

DEMAND = 0
PREFETCH = 1


@dataclass(frozen=True)
class LoaderConfig:
    threads: int = 4  # I/O threads; SSDs want a queue depth of several
    io_mode: str = "buffered"  # "buffered" (page cache) or "direct" (O_DIRECT / F_NOCACHE)
    verify_checksums: bool = False  # check packed-record CRC32 after every read
    max_retries: int = 3  # attempts after the first for transient OS errors
    retry_backoff_ms: float = 2.0  # first backoff; doubles each retry
    piece_bytes: int | None = 512 << 10  # largest read one thread does for a ticket (None: a ticket is one piece)

    def __post_init__(self):
        if not 1 <= self.threads <= 64:
            raise ValueError(f"LoaderConfig.threads={self.threads}; expected 1..64")
        if self.io_mode not in IO_MODES:
            raise ValueError(f"LoaderConfig.io_mode={self.io_mode!r}; expected one of {IO_MODES}")
        if self.max_retries < 0:
            raise ValueError(f"LoaderConfig.max_retries={self.max_retries}; expected >= 0")
        if self.piece_bytes is not None and self.piece_bytes < 1:
            raise ValueError(f"LoaderConfig.piece_bytes={self.piece_bytes}; expected None or a positive byte count")


@dataclass
class LoaderStats:
    n_requests: int = 0  # tickets created (after in-flight de-duplication)
    n_demand: int = 0  # tickets created at demand priority
    n_prefetch: int = 0  # tickets created at prefetch priority
    n_deduped: int = 0  # submits answered by a ticket already queued or in flight
    n_promoted: int = 0  # queued prefetches raised to demand priority
    n_cancelled: int = 0  # queued prefetches dropped as stale
    n_failed: int = 0  # tickets that ended with an error
    n_retries: int = 0  # re-reads after a transient error or a checksum mismatch
    bytes_read: int = 0  # bytes delivered into buffers
    read_ms: float = 0.0  # time spent inside reads, summed over threads
    wait_ms: float = 0.0  # time demand callers spent blocked in wait_all()
    n_idle_wakes: int = 0  # I/O threads woken that found nothing to read (each a GIL hand-off for nothing)

    def copy(self) -> "LoaderStats":
        return LoaderStats(**self.__dict__)


@dataclass(eq=False)
class LoadTicket:
    key: ExpertKey  # the expert being read
    views: list  # destination buffers, one per layout tensor
    priority: int  # 0 = demand; larger = later
    round_id: int | None  # the speculative round a prefetch belongs to
    on_done: Callable[["LoadTicket"], None] | None = None
    error: BaseException | None = None  # set if the read failed
    cancelled: bool = False  # dropped before it started
    pieces: list = field(default_factory=list)  # list[list[PieceRead]]: what one thread reads at a time
    claimed: int = 0  # pieces taken by a thread, in order
    left: int = 0  # pieces not finished yet
    _event: threading.Event = field(default_factory=threading.Event)

    @property
    def started(self) -> bool:
        """A thread has taken a piece: the read can no longer be cancelled."""
        return self.claimed > 0

    def unclaimed(self) -> bool:
        return self.claimed < len(self.pieces)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"load of {self.key} did not finish in {timeout}s")
        if self.error is not None:
            raise self.error


class AsyncLoader:
    """Thread pool of positioned reads from an ExpertStore."""

    def __init__(self, store, config: LoaderConfig = LoaderConfig(), reader: RangeReader | None = None):
        self.store = store
        self.config = config
        self.reader = reader or RangeReader(config.io_mode)
        self.stats = LoaderStats()
        self._heap: list = []
        self._seq = itertools.count()
        self._inflight: dict[ExpertKey, LoadTicket] = {}
        # One lock, two conditions: I/O threads wait on _work for tickets; drain() waits on _cv for finished ones.
        # A finished read wakes only drain()'s waiters: waking every idle I/O thread after each read cost ~0.2 ms
        # of GIL hand-offs per demand read here (4 threads taking the GIL in turn to find nothing to do).
        lock = threading.RLock()  # what a bare Condition() holds
        self._cv = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._closed = False
        self._active = 0  # tickets whose on_done has not finished yet
        self._threads = [
            threading.Thread(target=self._worker, name=f"specmoe-io-{i}", daemon=True)
            for i in range(config.threads)
        ]
        for t in self._threads:
            t.start()

    # -- submitting ------------------------------------------------------------------
    def submit(self, key: ExpertKey, views: list, *, priority: int = DEMAND, round_id: int | None = None,
               on_done: Callable[[LoadTicket], None] | None = None, wake: bool = True) -> LoadTicket:
        """Queue a read of `key` into `views`. wake=False: the caller waits for it next (wait_all() runs it on the
        calling thread), so no I/O thread is woken for it -- a woken thread would only contend for the GIL while
        the caller reads. Any later wake (another submit, wake(), drain(), close()) lets a thread take it."""
        with self._cv:
            if self._closed:
                raise RuntimeError("AsyncLoader is closed")
            ticket = self._inflight.get(key)
            if ticket is not None:
                self.stats.n_deduped += 1
                if priority < ticket.priority and ticket.unclaimed():
                    ticket.priority = priority
                    self.stats.n_promoted += 1
                    heapq.heappush(self._heap, (priority, next(self._seq), ticket))
                    self._work.notify()
                return ticket
            ticket = LoadTicket(key, views, priority, round_id, on_done)
            ticket.pieces = plan_pieces(self.store.reads(key, views), self.config.piece_bytes)
            ticket.left = len(ticket.pieces)
            self._inflight[key] = ticket
            self._active += 1
            self.stats.n_requests += 1
            if priority == DEMAND:
                self.stats.n_demand += 1
            else:
                self.stats.n_prefetch += 1
            heapq.heappush(self._heap, (priority, next(self._seq), ticket))
            helpers = min(len(ticket.pieces) - (not wake), self.config.threads)
            if helpers > 0:
                self._work.notify(helpers)
            return ticket

    def wake(self) -> None:
        """Let the I/O threads take every queued ticket (after submit(wake=False) whose caller will not wait)."""
        with self._cv:
            self._work.notify_all()

    def wait_all(self, tickets: list[LoadTicket]) -> None:
        """Block until every ticket is done; raise the first error (after all finished). A piece no I/O thread
        has taken yet is read by the waiter itself, most urgent first: it would otherwise wait for a thread
        to wake (~0.1 ms here per hand-off) while the I/O threads take the rest."""
        t0 = time.perf_counter()
        for t in sorted(tickets, key=lambda t: t.priority):
            while (i := self._claim(t)) is not None:
                self._run(t, i)
        for t in tickets:
            t._event.wait()
        with self._cv:
            self.stats.wait_ms += (time.perf_counter() - t0) * 1e3
        for t in tickets:
            if t.error is not None:
                raise t.error
            if t.cancelled:
                raise RuntimeError(f"load of {t.key} was cancelled while a caller waited for it")

    def promote(self, ticket: LoadTicket, priority: int = DEMAND) -> None:
        """Serve a still-queued `ticket` at `priority` (no-op once its read has started)."""
        with self._cv:
            if not ticket.unclaimed() or ticket.cancelled or ticket.done() or priority >= ticket.priority:
                return
            ticket.priority = priority
            self.stats.n_promoted += 1
            heapq.heappush(self._heap, (priority, next(self._seq), ticket))
            self._work.notify()

    def cancel_stale(self, round_id: int | None) -> int:
        """Drop queued prefetches whose round is not `round_id`; returns how many."""
        dropped = []
        with self._cv:
            for _, _, t in self._heap:
                if not t.started and not t.cancelled and t.priority != DEMAND and t.round_id != round_id:
                    t.cancelled = True
                    self._inflight.pop(t.key, None)
                    dropped.append(t)
            self._heap = [e for e in self._heap if not e[2].cancelled]
            heapq.heapify(self._heap)
            self.stats.n_cancelled += len(dropped)
        for t in dropped:
            self._finish(t)
        return len(dropped)

    def pending(self) -> int:
        """Tickets not finished yet (queued, reading, or running on_done)."""
        with self._cv:
            return self._active

    def threads_alive(self) -> bool:
        """True while every I/O thread is running (a soak checks that none died)."""
        return all(t.is_alive() for t in self._threads)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every submitted ticket has finished, callbacks included."""
        with self._cv:
            self._work.notify_all()  # a ticket queued with wake=False whose caller never waited
            if not self._cv.wait_for(lambda: self._active == 0, timeout):
                raise TimeoutError(f"{self._active} loads still pending after {timeout}s")

    # -- the I/O threads ---------------------------------------------------------------
    def _worker(self) -> None:
        woken = False  # woken, and read nothing since
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self.stats.n_idle_wakes += woken
                    self._work.wait()
                    woken = True
                if self._closed and not self._heap:
                    return
                prio, seq, ticket = heapq.heappop(self._heap)
                if ticket.cancelled or not ticket.unclaimed() or prio != ticket.priority:
                    continue  # stale heap entry (cancelled, taken by a waiter, or re-pushed at a new priority)
                i = self._take(ticket)
                if ticket.unclaimed():
                    heapq.heappush(self._heap, (prio, seq, ticket))  # the rest keeps its place in the queue
            woken = False
            self._run(ticket, i)

    def _take(self, ticket: LoadTicket) -> int:
        """The index of the ticket's next piece, now claimed (lock held)."""
        ticket.claimed += 1
        return ticket.claimed - 1

    def _claim(self, ticket: LoadTicket) -> int | None:
        """Take the next unread piece of `ticket` for the calling thread; None if none is left to take. After
        close() only tickets already started are served (their other pieces are in flight)."""
        with self._cv:
            if ticket.cancelled or not ticket.unclaimed() or (self._closed and not ticket.started):
                return None
            return self._take(ticket)

    def _run(self, ticket: LoadTicket, i: int) -> None:
        """Read piece `i` of a ticket; the thread that finishes its last piece checks and finishes the ticket."""
        error = self._read_piece(ticket, ticket.pieces[i])
        with self._cv:
            if error is not None and ticket.error is None:
                ticket.error = error
            ticket.left -= 1
            if ticket.left:
                return
        if ticket.error is None and self.config.verify_checksums:
            self._verify(ticket)
        with self._cv:
            self.stats.n_failed += ticket.error is not None
            if self._inflight.get(ticket.key) is ticket:
                del self._inflight[ticket.key]
        self._finish(ticket)

    def _read_piece(self, ticket: LoadTicket, piece: list[PieceRead]) -> BaseException | None:
        """Read one piece, retrying transient errors and short reads; the error that ends it, or None."""
        key, cfg = ticket.key, self.config
        t0 = time.perf_counter()
        expected = sum(r.nbytes for r in piece)
        attempts = 0
        while True:
            try:
                n = sum(self.reader.read(r.path, r.offset, r.views) for r in piece)
                if n != expected:
                    # A reader that returns short must not get its buffers committed: retry.
                    raise OSError(errno.EIO, f"short read ({n} of {expected} bytes)")
                with self._cv:
                    self.stats.bytes_read += n
                    self.stats.read_ms += (time.perf_counter() - t0) * 1e3
                return None
            except OSError as e:
                attempts += 1
                if attempts > cfg.max_retries:
                    return StoreError(piece[0].path, f"reading expert {key.expert} of layer {key.layer} at offset {piece[0].offset} failed after {attempts} attempts: {e.strerror or e}")
                with self._cv:
                    self.stats.n_retries += 1
                time.sleep(cfg.retry_backoff_ms * (2 ** (attempts - 1)) / 1e3)
            except BaseException as e:  # a StoreError or a bug: never leave the ticket hanging
                return e

    def _verify(self, ticket: LoadTicket) -> None:
        """Check a fully read record's CRC; on a mismatch read it again once (every piece, on this thread)."""
        key = ticket.key
        if self._checksum_ok(key, ticket.views):
            return
        with self._cv:
            self.stats.n_retries += 1
        for piece in ticket.pieces:
            ticket.error = self._read_piece(ticket, piece)
            if ticket.error is not None:
                return
        if not self._checksum_ok(key, ticket.views):
            rng = self.store.ranges(key)[0]
            ticket.error = StoreError(rng.path, f"checksum mismatch for expert {key.expert} of layer {key.layer} at offset {rng.offset}", tensor=f"layer {key.layer} expert {key.expert}")

    def _checksum_ok(self, key: ExpertKey, views: list) -> bool:
        expected = self.store.checksum(key)
        if expected is None:
            return True
        return crc32_of(views) == expected

    def _finish(self, ticket: LoadTicket) -> None:
        try:
            if ticket.on_done is not None:
                ticket.on_done(ticket)
        finally:
            ticket._event.set()
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def close(self) -> None:
        """Cancel every ticket no thread has started; pieces left of started ones are read before the threads end."""
        with self._cv:
            self._closed = True
            for _, _, t in self._heap:
                if not t.started and not t.cancelled:
                    t.cancelled = True
            stale = [t for _, _, t in self._heap if t.cancelled and not t.started]
            self._heap = [e for e in self._heap if e[2].started and e[2].unclaimed()]
            heapq.heapify(self._heap)
            self._work.notify_all()
            self._cv.notify_all()
        for t in stale:
            if not t.done():
                self._finish(t)
        for t in self._threads:
            t.join(timeout=5)
        self.reader.close()
