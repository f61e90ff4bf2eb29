"""The loop of ranks 1..N-1: receive a message, act, pass it on, until STOP.

FORWARD: apply the rewind the header carries (for the previous verify window), run
this rank's layers over the window, pass the hidden states on (the last rank sends
them back to rank 0 unless the window needs no reply). FORECAST: queue prefetches
for this rank's layers on its loader, pass the other ranks' part on. RESET (serve: a new
request): keep the shared prompt prefix of the caches or start fresh, pass it on.
HEARTBEAT (serve: rank 0 idle): pass it on; the wait for it is what keeps this rank's
receive timeout from firing between requests. The last rank sends neither back. STOP: append
this rank's report and pass the reports on. ERROR: pass it on and stop.

Invariant: a rank never waits for anything but its predecessor's next message, and
that wait has the channel's timeout; any exception here is sent on as an ERROR
naming this rank before it propagates.
"""

from __future__ import annotations

import json
import os
import time

import mlx.core as mx
import numpy as np

from runtime.pipeline.channel import (ERROR, FORECAST, FORWARD, HEARTBEAT, KEEP, NO_REPLY, RESET, STOP, Channel, Message,
                                      text_payload)
from runtime.pipeline.errors import PipelineError
from storage import ExpertKey


class StageTimer:
    """Per-rank time and counts of the work a stage did."""

    def __init__(self):
        self.compute_s = 0.0  # time in this rank's layers (forward + rewind re-runs)
        self.n_windows = 0  # windows run
        self.n_reruns = 0  # rewinds that re-ran accepted tokens
        self.n_forecast_keys = 0  # experts this rank was asked to prefetch
        self.prefetch_bytes_queued = 0  # bytes of prefetch reads queued
        self.n_resets = 0  # new requests (serve): caches reset or trimmed to a shared prompt prefix
        self.n_heartbeats = 0  # idle heartbeats seen (serve)

    def to_json(self) -> dict:
        return dict(vars(self))


def rank_report(stage, ch: Channel, timer: StageTimer) -> dict:
    return {**stage.memory(), "counters": stage.counters(), "timer": timer.to_json(), "channel": dict(vars(ch.stats))}


def parse_fault(spec: str | None) -> tuple[str, int, int] | None:
    """--pipeline-fault die:RANK:WINDOW or hang:RANK:WINDOW (debug: a rank that crashes or stops answering)."""
    if not spec:
        return None
    try:
        kind, rank, window = spec.split(":")
        if kind not in ("die", "hang"):
            raise ValueError
        return kind, int(rank), int(window)
    except ValueError:
        raise ValueError(f"--pipeline-fault {spec!r}: expected die:RANK:WINDOW or hang:RANK:WINDOW") from None


def maybe_fault(fault, rank: int, n_windows: int) -> None:
    if fault and fault[1] == rank and fault[2] == n_windows:
        if fault[0] == "die":
            os._exit(9)  # a crash: no message, no clean-up
        while True:
            time.sleep(3600)  # alive, silent


def serve_stage(stage, ch: Channel, fault=None) -> None:
    last = ch.rank == ch.size - 1
    timer = StageTimer()
    while True:
        msg = ch.recv()
        if msg.op == FORWARD:
            maybe_fault(fault, ch.rank, timer.n_windows)
            t0 = time.perf_counter()
            timer.n_reruns += stage.rewind(msg.trim, msg.rerun) > 0
            kind = "verify" if msg.flags & KEEP else "prefill" if msg.flags & NO_REPLY else "step"
            h = stage.run(msg.payload, keep=bool(msg.flags & KEEP), kind=kind)
            stage.end_round(msg.round_id)
            timer.compute_s += time.perf_counter() - t0
            timer.n_windows += 1
            if not (last and msg.flags & NO_REPLY):
                ch.send(Message(FORWARD, msg.n_tokens, msg.round_id, msg.trim, msg.rerun, ch.rank, msg.flags, h))
        elif msg.op == FORECAST:
            pairs = np.array(msg.payload).reshape(-1, 2)
            own = np.isin(pairs[:, 0], stage.layer_ids)
            if own.any() and stage.cache is not None:
                keys = [ExpertKey(int(l), int(e)) for l, e in pairs[own]]
                timer.n_forecast_keys += len(keys)
                timer.prefetch_bytes_queued += stage.cache.prefetch(keys, msg.round_id, None)
            if not own.all() and not last:
                ch.send(Message(FORECAST, round_id=msg.round_id, origin=msg.origin, payload=mx.array(pairs[~own])))
        elif msg.op in (RESET, HEARTBEAT):
            if msg.op == RESET:
                stage.reset(msg.n_tokens)
                timer.n_resets += 1
            else:
                timer.n_heartbeats += 1
            if not last:
                ch.send(Message(msg.op, msg.n_tokens, origin=msg.origin))
        elif msg.op == STOP:
            reports = json.loads(msg.text())
            reports.append(rank_report(stage, ch, timer))
            ch.send(Message(STOP, origin=ch.rank, payload=text_payload(reports)))
            return
        elif msg.op == ERROR:
            if ch.next_rank != msg.origin:
                try:
                    ch.send(msg, timeout_s=5.0)
                except PipelineError:
                    pass
            raise PipelineError(msg.text(), rank=msg.origin)
        else:
            raise PipelineError(f"rank {ch.rank}: unexpected message op {msg.op} from rank {ch.prev_rank}", rank=ch.prev_rank)
