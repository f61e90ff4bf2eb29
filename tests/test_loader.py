"""AsyncLoader: priorities, de-duplication, cancellation, retries, direct I/O."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import GatedReader, expert_views as _views
from storage import AsyncLoader, ExpertKey, ExpertStore, LoaderConfig, StoreError
from storage.loader import DEMAND, PREFETCH
from storage import drop_pages
from storage.reader import RangeReader


class FlakyReader(RangeReader):
    """Fails the first `failures` reads with EIO."""

    def __init__(self, failures: int):
        super().__init__("buffered")
        self.failures = failures

    def read(self, path, offset, buffers):
        if self.failures > 0:
            self.failures -= 1
            raise OSError(5, "Input/output error")
        return super().read(path, offset, buffers)




def _expected(store, key):
    v = _views(store, key.layer)
    store.read_into(key, v)
    return b"".join(x.tobytes() for x in v)


def test_demand_is_served_before_queued_prefetches(store):
    reader = GatedReader()
    loader = AsyncLoader(store, LoaderConfig(threads=1), reader=reader)
    layer = store.moe_layers[0]
    keys = [ExpertKey(layer, e) for e in range(6)]
    done_order = []
    pre = [loader.submit(k, _views(store, layer), priority=PREFETCH, round_id=1, on_done=lambda t: done_order.append(t.key.expert)) for k in keys[:5]]
    time.sleep(0.05)  # the single thread is now blocked on the first prefetch
    dem = loader.submit(keys[5], _views(store, layer), priority=DEMAND, on_done=lambda t: done_order.append(t.key.expert))
    reader.gate.set()
    for t in pre + [dem]:  # the thread's own order (wait_all would read queued tickets itself: below)
        t.wait()
    assert done_order[:2] == [0, 5]  # the read in flight finishes, then the demand jumps the queue
    assert loader.stats.n_demand == 1 and loader.stats.n_prefetch == 5
    loader.close()


class OneGateReader(RangeReader):
    """Blocks only the read at `offset` until the gate opens; records which thread read what."""

    def __init__(self, offset: int):
        super().__init__("buffered")
        self.offset, self.gate, self.by = offset, threading.Event(), {}

    def read(self, path, offset, buffers):
        if offset == self.offset:
            self.gate.wait(5)
        self.by[offset] = threading.current_thread().name
        return super().read(path, offset, buffers)


def test_a_waiter_reads_what_no_thread_has_started(store):
    """The only I/O thread is stuck on a slow read: wait_all() on a queued demand reads it on the calling thread
    instead of queueing behind it, most urgent first; the slow read is left to its thread."""
    layer = store.moe_layers[0]
    slow, keys = ExpertKey(layer, 0), [ExpertKey(layer, e) for e in (1, 2)]
    reader = OneGateReader(store.ranges(slow)[0].offset)
    loader = AsyncLoader(store, LoaderConfig(threads=1), reader=reader)
    stuck = loader.submit(slow, _views(store, layer), priority=PREFETCH)
    time.sleep(0.05)  # the thread has started the slow read
    views = [_views(store, layer) for _ in keys]
    done = []
    tickets = [loader.submit(k, v, priority=p, on_done=lambda t: done.append(t.key.expert))
               for k, v, p in zip(keys, views, (PREFETCH, DEMAND))]
    loader.wait_all(tickets)
    assert not stuck.done() and done == [2, 1]  # the demand first, both while the thread is still blocked
    assert all(reader.by[store.ranges(k)[0].offset] == threading.current_thread().name for k in keys)
    assert all(b"".join(x.tobytes() for x in v) == _expected(store, k) for k, v in zip(keys, views))
    reader.gate.set()
    loader.wait_all([stuck])
    assert reader.by[store.ranges(slow)[0].offset].startswith("specmoe-io")
    assert loader.stats.n_requests == 3 and loader.pending() == 0
    loader.close()


def test_inflight_requests_are_deduplicated_and_promoted(store):
    reader = GatedReader()
    loader = AsyncLoader(store, LoaderConfig(threads=1), reader=reader)
    layer = store.moe_layers[0]
    blocker = loader.submit(ExpertKey(layer, 0), _views(store, layer), priority=PREFETCH)
    time.sleep(0.05)
    views = _views(store, layer)
    first = loader.submit(ExpertKey(layer, 3), views, priority=PREFETCH, round_id=1)
    second = loader.submit(ExpertKey(layer, 3), _views(store, layer), priority=DEMAND)
    assert first is second and first.priority == DEMAND
    reader.gate.set()
    loader.wait_all([blocker, second])
    assert b"".join(v.tobytes() for v in views) == _expected(store, ExpertKey(layer, 3))
    assert loader.stats.n_deduped == 1 and loader.stats.n_promoted == 1 and loader.stats.n_requests == 2
    assert reader.order.count(store.ranges(ExpertKey(layer, 3))[0].offset) == 1
    loader.close()


def test_cancel_stale_drops_queued_prefetches_of_old_rounds(store):
    reader = GatedReader()
    loader = AsyncLoader(store, LoaderConfig(threads=1), reader=reader)
    layer = store.moe_layers[1]
    cancelled = []
    first = loader.submit(ExpertKey(layer, 0), _views(store, layer), priority=PREFETCH, round_id=1)
    time.sleep(0.05)
    old = [loader.submit(ExpertKey(layer, e), _views(store, layer), priority=PREFETCH, round_id=1,
                         on_done=lambda t: cancelled.append(t.cancelled)) for e in (1, 2)]
    new = loader.submit(ExpertKey(layer, 3), _views(store, layer), priority=PREFETCH, round_id=2)
    assert loader.cancel_stale(2) == 2
    reader.gate.set()
    loader.wait_all([first, new])
    assert cancelled == [True, True] and all(t.done() and t.cancelled for t in old)
    assert not first.cancelled  # a read already started is never interrupted
    assert loader.stats.n_cancelled == 2
    loader.close()


def test_transient_errors_are_retried(store):
    loader = AsyncLoader(store, LoaderConfig(threads=1, max_retries=3, retry_backoff_ms=0.1), reader=FlakyReader(2))
    key = ExpertKey(store.moe_layers[0], 2)
    views = _views(store, key.layer)
    loader.wait_all([loader.submit(key, views)])
    assert b"".join(v.tobytes() for v in views) == _expected(store, key)
    assert loader.stats.n_retries == 2 and loader.stats.n_failed == 0
    loader.close()


def test_permanent_errors_name_layer_expert_file_and_offset(store):
    loader = AsyncLoader(store, LoaderConfig(threads=1, max_retries=2, retry_backoff_ms=0.1), reader=FlakyReader(99))
    key = ExpertKey(store.moe_layers[2], 9)
    ticket = loader.submit(key, _views(store, key.layer))
    with pytest.raises(StoreError) as err:
        loader.wait_all([ticket])
    msg = str(err.value)
    rng = store.ranges(key)[0]
    assert f"expert 9 of layer {key.layer}" in msg and rng.path in msg and str(rng.offset) in msg
    assert loader.stats.n_failed == 1
    loader.close()


def test_direct_io_reads_the_same_bytes(store):
    layer = store.moe_layers[0]
    for path in {r.path for e in range(4) for r in store.ranges(ExpertKey(layer, e))}:
        drop_pages(path)
    loader = AsyncLoader(store, LoaderConfig(threads=2, io_mode="direct"))
    for e in range(4):
        key = ExpertKey(layer, e)
        views = _views(store, layer)
        loader.wait_all([loader.submit(key, views)])
        assert b"".join(v.tobytes() for v in views) == _expected(store, key)
    assert loader.stats.bytes_read == 4 * store.layout(layer).expert_bytes
    loader.close()


def test_direct_io_on_unaligned_raw_ranges(tiny_dirs):
    store = ExpertStore.open(tiny_dirs["mixtral"], io_mode="direct")
    key = ExpertKey(store.moe_layers[1], 11)
    views = _views(store, key.layer)
    store.read_into(key, views)
    plain = ExpertStore.open(tiny_dirs["mixtral"])
    assert b"".join(v.tobytes() for v in views) == _expected(plain, key)


def test_checksum_verification_fails_corrupt_records(tmp_path, tiny_qwen):
    from storage.packer import convert

    packed = convert(tiny_qwen, tmp_path / "p")
    store = ExpertStore.open(packed)
    key = ExpertKey(store.moe_layers[0], 1)
    (rng,) = store.ranges(key)
    with open(rng.path, "r+b") as f:
        f.seek(rng.offset)
        f.write(b"\xff\xff\xff\xff")
    loader = AsyncLoader(store, LoaderConfig(threads=1, verify_checksums=True))
    with pytest.raises(StoreError, match="checksum mismatch"):
        loader.wait_all([loader.submit(key, _views(store, key.layer))])
    ok = ExpertKey(store.moe_layers[0], 2)
    loader.wait_all([loader.submit(ok, _views(store, ok.layer))])
    loader.close()


def test_a_read_its_caller_waits_for_wakes_no_io_thread(store):
    """submit(wake=False) + wait_all(): the caller reads it and no I/O thread wakes, neither for the submit nor
    when the read finishes (a woken thread that finds nothing costs GIL hand-offs: ~0.2 ms a read here)."""
    layer = store.moe_layers[0]
    reader = OneGateReader(-1)  # never blocks; records which thread read what
    loader = AsyncLoader(store, LoaderConfig(threads=2), reader=reader)
    first = loader.submit(ExpertKey(layer, 0), _views(store, layer), wake=False)
    time.sleep(0.05)
    assert not first.started and not first.done()  # no thread took it
    loader.wait_all([first])
    for e in range(1, 12):
        loader.wait_all([loader.submit(ExpertKey(layer, e), _views(store, layer), wake=False)])
    time.sleep(0.05)  # a thread woken by a finished read would have found nothing by now
    me = threading.current_thread().name
    assert all(reader.by[store.ranges(ExpertKey(layer, e))[0].offset] == me for e in range(12))
    assert loader.stats.n_idle_wakes == 0 and loader.stats.n_requests == 12
    loader.close()


def test_a_ticket_nobody_waits_for_is_still_read(store):
    """A wake=False ticket whose caller does not wait: wake() lets a thread take it, and drain() serves it."""
    layer = store.moe_layers[0]
    reader = OneGateReader(-1)
    loader = AsyncLoader(store, LoaderConfig(threads=1), reader=reader)
    views = _views(store, layer)
    woken = loader.submit(ExpertKey(layer, 1), views, wake=False)
    loader.wake()
    woken.wait(2)
    assert reader.by[store.ranges(ExpertKey(layer, 1))[0].offset].startswith("specmoe-io")
    assert b"".join(x.tobytes() for x in views) == _expected(store, ExpertKey(layer, 1))
    drained = loader.submit(ExpertKey(layer, 2), _views(store, layer), wake=False)
    loader.drain(timeout=2)
    assert drained.done() and drained.error is None and loader.pending() == 0
    loader.close()


# -- pieces: one ticket read by several threads ------------------------------------------------------------------
class SlowThreadReader(RangeReader):
    """Every read takes `ms`; records (offset, thread name) of each read."""

    def __init__(self, ms: float = 10.0):
        super().__init__("buffered")
        self.ms, self.by, self.lock = ms, [], threading.Lock()

    def read(self, path, offset, buffers):
        time.sleep(self.ms / 1e3)
        with self.lock:
            self.by.append((offset, threading.current_thread().name))
        return super().read(path, offset, buffers)


def test_a_large_expert_is_read_by_several_threads_in_pieces(store):
    """piece_bytes below the record's size: the caller and the woken I/O threads each read a share of one
    expert; the bytes, the stats and the single on_done are as for one read."""
    layer = store.moe_layers[0]
    key = ExpertKey(layer, 5)
    nbytes = store.layout(layer).expert_bytes
    reader = SlowThreadReader()
    loader = AsyncLoader(store, LoaderConfig(threads=3, piece_bytes=1024), reader=reader)
    views, calls = _views(store, layer), []
    ticket = loader.submit(key, views, wake=False, on_done=calls.append)
    assert len(ticket.pieces) == -(-nbytes // 1024) > 3
    loader.wait_all([ticket])
    assert b"".join(v.tobytes() for v in views) == _expected(store, key)
    assert len({name for _, name in reader.by}) >= 3  # the caller and at least two I/O threads
    assert sorted(o for o, _ in reader.by) == [store.ranges(key)[0].offset + i * 1024 for i in range(len(ticket.pieces))]
    assert calls == [ticket] and loader.stats.bytes_read == nbytes and loader.stats.n_requests == 1
    loader.close()


def test_pieces_of_a_ticket_nobody_waits_for_are_all_read_by_the_threads(store):
    layer = store.moe_layers[1]
    loader = AsyncLoader(store, LoaderConfig(threads=2, piece_bytes=1024), reader=SlowThreadReader(1))
    views = [_views(store, layer) for _ in range(3)]
    tickets = [loader.submit(ExpertKey(layer, e), v, priority=PREFETCH, round_id=1) for e, v in zip((1, 2, 3), views)]
    loader.drain(timeout=5)
    assert all(t.done() and t.error is None for t in tickets)
    assert all(b"".join(x.tobytes() for x in v) == _expected(store, ExpertKey(layer, e)) for e, v in zip((1, 2, 3), views))
    loader.close()


def test_a_started_ticket_is_neither_cancelled_nor_left_unfinished_by_close(store):
    """A thread has taken the first piece: cancel_stale() leaves the ticket alone, and close() lets the threads
    read its other pieces before they end (the waiter is released with the whole record)."""
    layer = store.moe_layers[0]
    key = ExpertKey(layer, 7)
    reader = GatedReader()
    loader = AsyncLoader(store, LoaderConfig(threads=1, piece_bytes=1024), reader=reader)
    views = _views(store, layer)
    ticket = loader.submit(key, views, priority=PREFETCH, round_id=1)
    queued = loader.submit(ExpertKey(layer, 8), _views(store, layer), priority=PREFETCH, round_id=1)
    time.sleep(0.05)  # the thread holds the first piece at the gate
    assert ticket.started and ticket.unclaimed() and not queued.started
    assert loader.cancel_stale(2) == 1 and queued.cancelled and not ticket.cancelled
    closer = threading.Thread(target=loader.close)
    closer.start()
    time.sleep(0.05)
    reader.gate.set()
    closer.join(5)
    ticket.wait(1)
    assert b"".join(v.tobytes() for v in views) == _expected(store, key)


class FailAtReader(RangeReader):
    """Fails every read at `offset` with EIO."""

    def __init__(self, offset: int):
        super().__init__("buffered")
        self.offset = offset

    def read(self, path, offset, buffers):
        if offset == self.offset:
            raise OSError(5, "Input/output error")
        return super().read(path, offset, buffers)


def test_a_failed_piece_fails_its_ticket_once_naming_the_piece(store):
    layer = store.moe_layers[2]
    key = ExpertKey(layer, 4)
    bad = store.ranges(key)[0].offset + 2048  # the third piece
    calls = []
    loader = AsyncLoader(store, LoaderConfig(threads=2, piece_bytes=1024, max_retries=1, retry_backoff_ms=0.1),
                         reader=FailAtReader(bad))
    ticket = loader.submit(key, _views(store, layer), on_done=calls.append)
    with pytest.raises(StoreError, match=f"expert 4 of layer {layer} at offset {bad} failed after 2 attempts"):
        loader.wait_all([ticket])
    assert calls == [ticket] and loader.stats.n_failed == 1 and loader.stats.n_retries == 1
    assert loader.pending() == 0
    ok = ExpertKey(layer, 5)
    loader.wait_all([loader.submit(ok, _views(store, layer))])  # the loader keeps serving
    loader.close()


def test_checksums_are_checked_once_every_piece_is_in(tmp_path, tiny_qwen):
    from storage.faults import FaultyReader
    from storage.packer import convert

    store = ExpertStore.open(convert(tiny_qwen, tmp_path / "p"))
    key = ExpertKey(store.moe_layers[0], 3)
    faulty = FaultyReader(RangeReader("buffered"), f"flip:layer={key.layer},expert={key.expert},times=1", store=store)
    loader = AsyncLoader(store, LoaderConfig(threads=2, verify_checksums=True, piece_bytes=1024), reader=faulty)
    views = _views(store, key.layer)
    loader.wait_all([loader.submit(key, views)])  # the flipped first piece fails the CRC: read again, whole
    assert faulty.counts["flip"] == 1 and loader.stats.n_retries == 1
    assert b"".join(v.tobytes() for v in views) == _expected(store, key)
    loader.close()
