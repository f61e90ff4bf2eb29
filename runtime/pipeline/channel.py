"""Channel: messages between neighbouring pipeline ranks over mx.distributed send/recv.

A message is one fixed-size frame: an int32 header and, inline, its payload (a
window's hidden states, a forecast, or UTF-8 text) when that fits the frame;
a larger payload (a prefill chunk) follows as a second transfer. One transfer per
message matters: each costs the link's latency (and on a loaded CPU, MLX's ring
threads' wake-ups). Ranks form a chain
0 -> 1 -> ... -> N-1 -> 0, so every hop is between ring neighbours.

Invariants:
- Every receive has a timeout: it runs on a helper thread and the caller waits at
  most `timeout_s`; a peer that is gone raises at once ("connection lost"), a peer
  that is alive but silent raises after the timeout. Either way a PipelineError
  names the peer, never a hang.
- Messages from one peer arrive in the order they were sent (one TCP stream).
- A receive that timed out leaves its helper thread blocked inside MLX: the process
  must exit after a PipelineError (`runtime.pipeline.launch` does, with os._exit).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from runtime.pipeline.errors import PipelineError

HEADER_LEN = 8
HEAD_BYTES = (HEADER_LEN + 6) * 4  # header, ndim, 4 dims, inline flag (int32)
FRAME_BYTES = 64 * 1024  # payload bytes carried inside the header frame (a verify window of a 35B-A3B in bf16: 9 x 4 KB)
# header: [op, n_tokens, round, trim, rerun, payload dtype code + 1 (0: none), origin, flags, ndim, dim0..dim3]
FORWARD, FORECAST, STOP, ERROR, STATS, RESET, HEARTBEAT = 1, 2, 3, 4, 5, 6, 7
KEEP, NO_REPLY = 1, 2  # FORWARD flags: snapshot + keep the window for a rewind; the last rank sends nothing back
OP_NAMES = {FORWARD: "forward", FORECAST: "forecast", STOP: "stop", ERROR: "error", STATS: "stats", RESET: "reset",
            HEARTBEAT: "heartbeat"}
DTYPES = {0: mx.float32, 1: mx.bfloat16, 2: mx.float16, 3: mx.int32, 4: mx.uint8}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


@dataclass
class Message:
    op: int  # FORWARD, FORECAST, STOP, ERROR, STATS, RESET (a new request) or HEARTBEAT (rank 0 is idle, alive)
    n_tokens: int = 0  # FORWARD: tokens in the window; RESET: cached positions every rank keeps (0: fresh caches)
    round_id: int = 0  # speculative round (prefetch bookkeeping), 0 outside speculation
    trim: int = 0  # FORWARD: positions each rank drops from its caches before running the window
    rerun: int = 0  # FORWARD: restore the snapshot and re-run this many tokens of the last window first
    origin: int = 0  # the rank that produced the message (ERROR: the rank at fault)
    flags: int = 0  # FORWARD: KEEP | NO_REPLY
    payload: mx.array | None = None  # FORWARD (1, T, D) hidden states; FORECAST (M, 2) int32; ERROR/STATS uint8 text

    def text(self) -> str:
        return bytes(np.array(self.payload)).decode("utf-8", "replace") if self.payload is not None else ""


def text_payload(obj) -> mx.array:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return mx.array(np.frombuffer(data.encode("utf-8"), np.uint8))


def _peer(peer) -> str:
    return f"rank {peer}" if isinstance(peer, int) else str(peer)


def _rank(peer) -> int | None:
    return peer if isinstance(peer, int) else None


@dataclass
class ChannelStats:
    n_sent: int = 0  # messages sent
    n_received: int = 0  # messages received
    n_frames: int = 0  # transfers sent (a message is one frame, or two when its payload is too big to inline)
    bytes_sent: int = 0  # payload bytes sent
    bytes_received: int = 0  # payload bytes received
    send_s: float = 0.0  # wall time in sends
    wait_s: float = 0.0  # wall time waiting for receives


class Channel:
    """Send to and receive from ring neighbours with a timeout on every receive."""

    def __init__(self, group, timeout_s: float = 120.0, frame_bytes: int = FRAME_BYTES):
        if timeout_s <= 0:
            raise ValueError(f"--pipeline-timeout {timeout_s}; expected seconds > 0")
        self.frame_bytes = frame_bytes  # every rank must use the same value (frames have a fixed size)
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.timeout_s = timeout_s
        self.stats = ChannelStats()
        self.waiting_for = None  # the peer a transfer in progress waits for (named when the rank is stopped)

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.size

    # -- raw transfers -------------------------------------------------------------------
    def _blocking(self, fn, peer, what: str, timeout_s: float):
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - reported to the waiting caller
                box["error"] = e

        t = threading.Thread(target=run, name=f"pipeline-{what}", daemon=True)
        t.start()
        self.waiting_for = peer
        try:
            t.join(timeout_s)
        finally:
            self.waiting_for = None
        if t.is_alive():
            raise PipelineError(f"rank {self.rank}: no {what} from {_peer(peer)} within {timeout_s:g}s "
                                f"({_peer(peer)} is stuck or gone; see its output)", rank=_rank(peer))
        if "error" in box:
            verb = {"message": "receiving from", "send": "sending to"}.get(what, f"the {what} with")
            raise PipelineError(f"rank {self.rank}: {verb} {_peer(peer)} failed: {box['error']} "
                                f"({_peer(peer)} stopped; see its output)", rank=_rank(peer)) from box["error"]
        return box.get("value")

    def _send_array(self, x: mx.array, dst: int, timeout_s: float) -> None:
        self._blocking(lambda: mx.eval(mx.distributed.send(x, dst, group=self.group)), dst, "send", timeout_s)

    def _recv_array(self, shape, dtype, src: int, timeout_s: float) -> mx.array:
        def recv():
            a = mx.distributed.recv(shape, dtype, src, group=self.group)
            mx.eval(a)
            return a

        return self._blocking(recv, src, "message", timeout_s)

    # -- messages ------------------------------------------------------------------------
    def send(self, msg: Message, dst: int | None = None, timeout_s: float | None = None) -> None:
        """One frame (header + payload inline when it fits `frame_bytes`), else a header frame and the payload."""
        dst = self.next_rank if dst is None else dst
        timeout_s = timeout_s or self.timeout_s
        t0 = time.perf_counter()
        p = msg.payload
        header = [msg.op, msg.n_tokens, msg.round_id, msg.trim, msg.rerun, 0, msg.origin, msg.flags]
        shape = ()
        if p is not None:
            if p.dtype not in DTYPE_CODES:
                raise PipelineError(f"rank {self.rank}: cannot send a {p.dtype} payload", rank=self.rank)
            header[5] = DTYPE_CODES[p.dtype] + 1  # 0: no payload
            shape = tuple(p.shape)
        if len(shape) > 4:
            raise PipelineError(f"rank {self.rank}: payloads have at most 4 dimensions, not {len(shape)}", rank=self.rank)
        inline = p is not None and p.nbytes <= self.frame_bytes
        head = mx.array(header + [len(shape)] + list(shape) + [0] * (4 - len(shape)) + [int(inline)], mx.int32)
        parts = [head.view(mx.uint8)]
        if inline:
            parts.append(p.reshape(-1).view(mx.uint8))
        used = sum(x.size for x in parts)
        parts.append(mx.zeros((HEAD_BYTES + self.frame_bytes - used,), mx.uint8))
        frame = mx.concatenate(parts)
        mx.eval(frame)  # computed here, on the caller's thread; the helper thread only moves bytes
        self._send_array(frame, dst, timeout_s)
        if p is not None and not inline:
            mx.eval(p)
            self._send_array(p, dst, timeout_s)
        if p is not None:
            self.stats.bytes_sent += p.nbytes
        self.stats.n_sent += 1
        self.stats.n_frames += 1 + (p is not None and not inline)
        self.stats.send_s += time.perf_counter() - t0

    def recv(self, src: int | None = None, timeout_s: float | None = None) -> Message:
        src = self.prev_rank if src is None else src
        timeout_s = timeout_s or self.timeout_s
        t0 = time.perf_counter()
        frame = self._recv_array((HEAD_BYTES + self.frame_bytes,), mx.uint8, src, timeout_s)
        h = np.array(frame[:HEAD_BYTES].view(mx.int32)).tolist()
        op, n_tokens, round_id, trim, rerun, code, origin, flags = h[:HEADER_LEN]
        if op not in OP_NAMES:
            raise PipelineError(f"rank {self.rank}: malformed message (op {op}) from rank {src}", rank=src)
        payload = None
        if code:
            ndim = h[HEADER_LEN]
            shape = tuple(h[HEADER_LEN + 1 : HEADER_LEN + 1 + ndim])
            dtype = DTYPES[code - 1]
            if h[HEADER_LEN + 5]:  # inline
                n = int(np.prod(shape)) * dtype.size
                payload = frame[HEAD_BYTES : HEAD_BYTES + n].view(dtype).reshape(shape)
            else:
                payload = self._recv_array(shape, dtype, src, timeout_s)
            self.stats.bytes_received += payload.nbytes
        self.stats.n_received += 1
        self.stats.wait_s += time.perf_counter() - t0
        return Message(op, n_tokens, round_id, trim, rerun, origin, flags, payload)

    def all_gather_bytes(self, data: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Every rank's `data` (each at most 4 KiB), in rank order."""
        if len(data) > 4096:
            raise ValueError("all_gather_bytes: at most 4096 bytes per rank")
        buf = np.zeros(4100, np.uint8)
        buf[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
        buf[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)

        def gather():
            out = mx.distributed.all_gather(mx.array(buf)[None], group=self.group)
            mx.eval(out)
            return np.array(out)

        rows = self._blocking(gather, "every rank", "start-up exchange", timeout_s or self.timeout_s)
        return [bytes(r[4 : 4 + int(np.frombuffer(r[:4].tobytes(), np.uint32)[0])]) for r in rows]
