"""PipelineDriver: rank 0's side of the chain -- embed, its layers, send, receive, head.

Shapes: T = tokens in a window, D = hidden, V = vocabulary.

A window of T tokens is one FORWARD message per hop carrying (1, T, D) hidden
states; the last rank returns its output to rank 0, which applies the final norm
and LM head. Rewinds of a verify window are applied on rank 0 at once and ride on
the next FORWARD header to the other ranks (so a rewind costs no extra message).
Forecast keys for other ranks' layers go out as one FORECAST message per draft step.

Invariant: rank 0 only ever waits for the last rank's reply to the window it sent,
with the channel's timeout; an ERROR reply raises a PipelineError naming its origin.
"""

from __future__ import annotations

import json
import time

import mlx.core as mx
import numpy as np

from runtime.pipeline.channel import (ERROR, FORECAST, FORWARD, HEARTBEAT, KEEP, NO_REPLY, RESET, STOP, Channel, Message,
                                      text_payload)
from runtime.pipeline.errors import PipelineError
from runtime.pipeline.worker import StageTimer, rank_report
from storage import ExpertKey


class PipelineDriver:
    def __init__(self, stage, ch: Channel):
        if stage.rank != 0:
            raise ValueError("PipelineDriver runs on rank 0")
        self.stage = stage
        self.ch = ch
        self.timer = StageTimer()
        self.window_s = 0.0  # wall time of windows that waited for a reply (rank 0 view of the whole chain)
        self._rewind = (0, 0)  # (rejected, keep) for the other ranks, sent with the next window
        self.tokens: list[int] = []  # the tokens every rank's caches hold, in order (prompt-cache reuse)
        self.last_send = time.monotonic()  # when rank 0 last sent anything down the chain (heartbeats)

    def window(self, tokens: list[int], *, keep: bool = False, reply: bool = True, round_id: int = 0) -> mx.array | None:
        """Run `tokens` through every stage; (1, T, V) logits, or None when no reply is wanted."""
        t0 = time.perf_counter()
        kind = "verify" if keep else "step" if reply else "prefill"
        h = self.stage.run(self.stage.embed_tokens(tokens), keep=keep, kind=kind)
        self.stage.end_round(round_id)
        self.timer.compute_s += time.perf_counter() - t0
        self.timer.n_windows += 1
        self.tokens.extend(tokens)
        if self.ch.size > 1:
            trim, rerun = self._rewind
            self._rewind = (0, 0)
            flags = (KEEP if keep else 0) | (0 if reply else NO_REPLY)
            self.ch.send(Message(FORWARD, len(tokens), round_id, trim, rerun, 0, flags, h))
            self.last_send = time.monotonic()
            if not reply:
                return None
            msg = self.ch.recv()
            if msg.op == ERROR:
                raise PipelineError(msg.text(), rank=msg.origin)
            if msg.op != FORWARD or msg.n_tokens != len(tokens):
                raise PipelineError(f"rank 0: expected the output of a {len(tokens)}-token window from rank "
                                    f"{self.ch.prev_rank}, got op {msg.op} ({msg.n_tokens} tokens)", rank=self.ch.prev_rank)
            h = msg.payload
        elif not reply:
            return None
        logits = self.stage.logits(h)
        self.window_s += time.perf_counter() - t0
        return logits

    def prefill(self, ids: list[int], step: int) -> None:
        """Feed `ids` in chunks of `step` tokens without waiting for replies."""
        for i in range(0, len(ids), step):
            self.window(ids[i : i + step], reply=False)

    def rewind(self, rejected: int, keep_tokens: int) -> None:
        """Drop the rejected tail of the last verify window: now on rank 0, with the next window elsewhere."""
        t0 = time.perf_counter()
        self.timer.n_reruns += self.stage.rewind(rejected, keep_tokens) > 0
        self.timer.compute_s += time.perf_counter() - t0
        self._rewind = (rejected, keep_tokens)
        if rejected > 0:
            del self.tokens[-rejected:]

    def reset(self, keep: int) -> None:
        """A new request: every rank keeps the first `keep` cached tokens (0: fresh caches). One message."""
        keep = max(0, min(keep, len(self.tokens)))
        if not self.stage.chain_trimmable:
            keep = 0
        self.stage.reset(keep)
        self._rewind = (0, 0)  # the other ranks trim to `keep` too, rejected tail included
        del self.tokens[keep:]
        if self.ch.size > 1:
            self.ch.send(Message(RESET, keep))
            self.last_send = time.monotonic()

    def heartbeat(self) -> None:
        """Tell the other ranks rank 0 is alive while it has no work (their receives have timeouts)."""
        if self.ch.size > 1:
            self.ch.send(Message(HEARTBEAT))
            self.last_send = time.monotonic()

    def forecast(self, keys: list[ExpertKey], round_id: int) -> int:
        """Queue `keys` on the loader of the rank owning each layer; bytes queued on rank 0."""
        local = [k for k in keys if k.layer in self.stage.layer_ids]
        remote = [(k.layer, k.expert) for k in keys if k.layer not in self.stage.layer_ids]
        queued = 0
        if local and self.stage.cache is not None:
            queued = self.stage.cache.prefetch(local, round_id)
            self.timer.n_forecast_keys += len(local)
            self.timer.prefetch_bytes_queued += queued
        if remote and self.ch.size > 1:
            self.ch.send(Message(FORECAST, round_id=round_id, payload=mx.array(np.array(remote, np.int32))))
            self.last_send = time.monotonic()
        return queued

    def stop(self) -> list[dict]:
        """End the run on every rank; returns every rank's report, in rank order."""
        mine = rank_report(self.stage, self.ch, self.timer)
        if self.ch.size == 1:
            return [mine]
        self.ch.send(Message(STOP, payload=text_payload([mine])))
        msg = self.ch.recv()
        if msg.op == ERROR:
            raise PipelineError(msg.text(), rank=msg.origin)
        if msg.op != STOP:
            raise PipelineError(f"rank 0: expected the ranks' reports, got op {msg.op}", rank=self.ch.prev_rank)
        return json.loads(msg.text())
