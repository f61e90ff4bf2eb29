"""FaultyReader: a reader wrapper that injects disk faults on chosen expert records.

Used only by tests, benches and the hidden `specmoe generate --inject SPEC` debug
flag; the runtime never builds one on its own. It sits where AsyncLoader expects
a reader (anything with read(path, offset, buffers) -> bytes and close()).

Fault kinds (what a real disk or kernel can do to one positioned read):
- eio:   raise OSError(EIO) before reading (a bad sector, a flaky NVMe link).
- eintr: raise InterruptedError (EINTR); Python retries EINTR inside os.preadv
         (PEP 475), so a wrapper is the only way a caller ever sees one.
- short: deliver only a prefix of the range, fill the rest with 0xA5 garbage and
         return the short count (a reader that forgot to loop on partial reads).
- slow:  sleep `ms` before an otherwise correct read. A delay per positioned read: a packed store reads an
         expert in one, a raw checkpoint in one per tensor (nine for a 4-bit SwitchGLU), so benches that
         emulate a latency per expert read packed stores.
- flip:  read correctly, then flip one bit of the delivered bytes (silent
         corruption between the medium and memory).

Spec grammar (`--inject`): faults separated by ";", each `kind[:key=value,...]`:
    layer=L, expert=E  only records of that layer / expert (default: any record)
    times=N|inf        how many times the fault fires (default inf: permanent)
    after=N            let N matching reads through first (default 0)
    p=F, seed=S        fire with probability F per matching read (default 1)
    ms=F               delay of `slow` (default 5)
    byte=B, bit=b      position of `flip` within the read (default: middle byte, bit 0)
    bytes=B            bytes `short` delivers (default: half the range)
e.g. "eio:layer=1,expert=3,times=2;slow:ms=5;flip:layer=2,times=1".

Faults act on a record's positioned reads that start a range. The loader cuts a long
range into pieces (storage/read_plan.py); the reads that continue a range are passed
through, so a fault fires once per range however it is cut, and a `slow` delay stays
one per expert read of a packed store.

Invariants: a read that no fault matches, and a read continuing a range, is passed
through untouched; counters and the random stream are guarded by one lock, so faults
fire exactly `times` times even with many I/O threads.
"""

from __future__ import annotations

import bisect
import errno
import math
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from storage.keys import ExpertKey

FAULT_KINDS = ("eio", "eintr", "short", "slow", "flip")
_INT_KEYS = {"layer", "expert", "after", "seed", "byte", "bit", "bytes"}
_FLOAT_KEYS = {"p", "ms"}


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # one of FAULT_KINDS
    layer: int | None = None  # match only this decoder layer (None: any)
    expert: int | None = None  # match only this expert (None: any)
    times: float = math.inf  # fires at most this many times (inf: every matching read)
    after: int = 0  # matching reads passed through before the first firing
    p: float = 1.0  # probability of firing on a matching read
    seed: int = 0  # seed of the random stream used by p
    ms: float = 5.0  # delay of a slow read
    byte: int | None = None  # flip: byte index within the read (None: middle)
    bit: int = 0  # flip: bit index 0..7
    nbytes: int | None = None  # short: bytes delivered (None: half)

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r}; expected one of {', '.join(FAULT_KINDS)}")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"fault {self.kind}: p={self.p}; expected 0 <= p <= 1")
        if not 0 <= self.bit <= 7:
            raise ValueError(f"fault {self.kind}: bit={self.bit}; expected 0..7")
        if self.times < 0 or self.after < 0 or self.ms < 0:
            raise ValueError(f"fault {self.kind}: times, after and ms must be >= 0")

    def matches(self, key: ExpertKey | None) -> bool:
        if self.layer is None and self.expert is None:
            return True
        if key is None:
            return False
        return (self.layer is None or key.layer == self.layer) and (self.expert is None or key.expert == self.expert)


def parse_faults(spec: str) -> list[FaultSpec]:
    """Parse an `--inject` spec (see the module docstring) into FaultSpecs."""
    faults = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, _, args = part.partition(":")
        kind = kind.strip()
        if kind not in FAULT_KINDS:
            raise ValueError(f"--inject {part!r}: unknown fault {kind!r}; expected one of {', '.join(FAULT_KINDS)}")
        fields: dict = {}
        for item in (a.strip() for a in args.split(",") if a.strip()):
            name, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"--inject {part!r}: {item!r} is not key=value")
            if name not in _INT_KEYS | _FLOAT_KEYS | {"times"}:
                raise ValueError(f"--inject {part!r}: unknown key {name!r}; expected one of "
                                 f"{', '.join(sorted(_INT_KEYS | _FLOAT_KEYS | {'times'}))}")
            try:
                if name == "times":
                    fields["times"] = math.inf if value in ("inf", "forever") else int(value)
                elif name in _INT_KEYS:
                    fields["nbytes" if name == "bytes" else name] = int(value)
                else:
                    fields[name] = float(value)
            except ValueError:
                raise ValueError(f"--inject {part!r}: {name}={value!r} is not a number") from None
        faults.append(FaultSpec(kind, **fields))
    if not faults:
        raise ValueError(f"--inject {spec!r}: no fault given; expected e.g. 'eio:layer=1,expert=3,times=2'")
    return faults


@dataclass(frozen=True)
class FaultEvent:
    kind: str  # the fault that fired
    key: ExpertKey | None  # the record it hit (None: a range that is no expert record)
    path: str  # file read
    offset: int  # absolute offset of the read


class _Armed:
    """A FaultSpec plus its counters and random stream."""

    def __init__(self, spec: FaultSpec):
        self.spec = spec
        self.seen = 0  # matching reads so far
        self.fired = 0  # times the fault fired
        self.rng = random.Random(spec.seed)

    def fire(self, key: ExpertKey | None) -> bool:
        s = self.spec
        if not s.matches(key):
            return False
        self.seen += 1
        if self.seen <= s.after or self.fired >= s.times:
            return False
        if s.p < 1.0 and self.rng.random() >= s.p:
            return False
        self.fired += 1
        return True


class FaultyReader:
    """Wraps a reader; reads of records matched by a FaultSpec misbehave as specified."""

    def __init__(self, inner, faults: list[FaultSpec] | str, store=None):
        self.inner = inner  # the real reader (RangeReader)
        self.faults = [_Armed(f) for f in (parse_faults(faults) if isinstance(faults, str) else faults)]
        self.counts: Counter = Counter()  # fault kind -> times fired
        self.events: deque[FaultEvent] = deque(maxlen=1000)  # the most recent firings
        self.n_reads = 0  # reads seen (faulty or not)
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, int], ExpertKey] = {}
        self._spans: dict[str, tuple[list[int], list[int]]] = {}  # path -> (range starts sorted, their ends)
        if store is not None:
            # Reads arrive as (path, offset); faults name (layer, expert): map one to the other.
            spans: dict[str, list[tuple[int, int]]] = {}
            for layer in store.moe_layers:
                for e in range(store.layout(layer).n_experts):
                    key = ExpertKey(layer, e)
                    for r in store.ranges(key):
                        self._keys[(r.path, r.offset)] = key
                        spans.setdefault(r.path, []).append((r.offset, r.offset + r.nbytes))
            for path, s in spans.items():
                s.sort()
                self._spans[path] = ([a for a, _ in s], [b for _, b in s])

    def _continues_a_range(self, path: str, offset: int) -> bool:
        """Whether a read at `offset` starts inside an expert range, past its first byte (a later piece of it)."""
        starts, ends = self._spans.get(path, ((), ()))
        i = bisect.bisect_right(starts, offset) - 1
        return i >= 0 and starts[i] < offset < ends[i]

    def _choose(self, key: ExpertKey | None, path: str, offset: int) -> list[FaultSpec]:
        with self._lock:
            self.n_reads += 1
            fired = [a.spec for a in self.faults if a.fire(key)]
            for s in fired:
                self.counts[s.kind] += 1
                self.events.append(FaultEvent(s.kind, key, path, offset))
        return fired

    def read(self, path: str, offset: int, buffers: list) -> int:
        key = self._keys.get((path, offset))
        if key is None and self._continues_a_range(path, offset):
            return self.inner.read(path, offset, buffers)
        fired = self._choose(key, path, offset)
        kinds = {s.kind for s in fired}
        for s in fired:
            if s.kind == "slow":
                time.sleep(s.ms / 1e3)
        if "eio" in kinds:
            raise OSError(errno.EIO, f"Input/output error (injected at {path}:{offset})")
        if "eintr" in kinds:
            raise InterruptedError(errno.EINTR, f"Interrupted system call (injected at {path}:{offset})")
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)
        short = next((s for s in fired if s.kind == "short"), None)
        if short is not None:
            return self._read_short(path, offset, views, total, short)
        n = self.inner.read(path, offset, buffers)
        for s in fired:
            if s.kind == "flip" and total:
                _flip(views, total // 2 if s.byte is None else s.byte % total, s.bit)
        return n

    def _read_short(self, path: str, offset: int, views: list, total: int, s: FaultSpec) -> int:
        keep = total // 2 if s.nbytes is None else max(0, min(s.nbytes, total))
        prefix, left = [], keep
        for v in views:
            take = min(left, len(v))
            if take:
                prefix.append(v[:take])
            v[take:] = b"\xa5" * (len(v) - take)  # what a careless caller would commit
            left -= take
        if prefix:
            self.inner.read(path, offset, prefix)
        return keep

    def close(self) -> None:
        self.inner.close()


def _flip(views: list, pos: int, bit: int) -> None:
    for v in views:
        if pos < len(v):
            v[pos] ^= 1 << bit
            return
        pos -= len(v)
