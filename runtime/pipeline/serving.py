"""`specmoe serve --pipeline`: rank 0 runs the OpenAI-compatible server and drives the stages.

    mlx.launch -n 2 --backend ring -- specmoe serve -m MODEL --pipeline --port 8080

Rank 0 serves HTTP (runtime.serve, one request at a time) through a PipelineBackend; the
other ranks run their stage loop (runtime.pipeline.worker) until STOP. Per request, rank 0
sends one RESET: every rank keeps the cached prefix this prompt shares with the tokens its
caches hold (plain decoding over KV caches, as the single-process prompt cache), or starts
fresh (speculative decoding; recurrent caches). While no request runs, rank 0 sends a
HEARTBEAT whenever it has sent nothing for a quarter of --pipeline-timeout, so the other
ranks' receive timeouts only fire when rank 0 is really gone. When the server stops (Ctrl-C
or SIGTERM to rank 0), rank 0 sends STOP and every rank exits 0.

Invariants: the chain is used by one thread at a time (the generation worker or the
heartbeat, under one lock); a request's tokens equal `specmoe generate --pipeline` for the
same prompt and settings (greedy: stock mlx-lm's); a bad request is refused before anything
is sent down the chain; a pipeline failure (a rank gone, a timeout) ends every rank with one
error line, never a server that answers without its stages.
"""

from __future__ import annotations

import threading
import time

from mlx_lm.sample_utils import make_sampler

from runtime.pipeline.driver import PipelineDriver
from runtime.pipeline.generation import PipelineStats, plain_stream
from runtime.pipeline.launch import PipelineRun, fail_rank, run_ranks
from runtime.serve import Backend, Piece, serve_backend

__all__ = ["PipelineBackend", "run_serve"]


class PipelineBackend(Backend):
    """What runtime.serve generates with when the model is a pipeline (rank 0's view).

    Shares Backend's prompt encoding (chat template, plain transcript); replaces generation
    and the stats. Backend.__init__ (which needs a runtime.api engine) is
    not called: the attributes the encoding reads are set here."""

    def __init__(self, stage, draft, ch, run: PipelineRun, log=print):
        self.tokenizer = stage.tokenizer
        self.chat_template_args = {}
        self.started = time.time()
        self.stage, self.draft, self.run, self.log = stage, draft, run, log
        self.driver = PipelineDriver(stage, ch)
        self.eos = set(stage.tokenizer.eos_token_ids)
        self.predictor = None
        if draft is not None:
            from runtime.pipeline.speculative import pipeline_predictor

            self.predictor = pipeline_predictor(run.predictor, stage, draft[0], draft[1], projection=run.projection,
                                                forecast_k=run.forecast_k)
        self.heartbeat_s = max(0.2, run.timeout_s / 4)
        self._chain = threading.Lock()  # the generation worker or the heartbeat, never both
        self._lock = threading.Lock()  # the totals
        self._totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0,
                        "decode_s": 0.0, "heartbeats": 0}
        self._last: PipelineStats | None = None
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, name="pipeline-heartbeat", daemon=True)
        self._beat.start()

    # -- requests --------------------------------------------------------------------------
    can_batch = False  # a pipeline decodes one request at a time: stages hold one sequence's caches
    batch_stats = None  # so /health reports no batching section

    def reset_prompt_cache(self) -> None:
        with self._chain:
            self._guard(lambda: self.driver.reset(0))

    def stream(self, ids: list[int], request):
        """Pieces for `ids`, as mlx-lm's stream_generate frames them (the EOS token is not shown)."""
        with self._chain:
            stats = PipelineStats(self.driver.ch.size, len(ids), 0, 0.0, 0.0, 0.0)
            t0 = time.perf_counter()
            tokens, drafter, cached = self._guard(lambda: self._start(ids, request, stats))
            n = 0
            try:
                detok = self.tokenizer.detokenizer
                detok.reset()
                while True:
                    token = self._guard(lambda: next(tokens, None))
                    if token is None:
                        break
                    n += 1
                    finish = "stop" if token in self.eos else "length" if n >= request.max_tokens else None
                    if finish != "stop":
                        detok.add_token(token)
                    if finish is not None:
                        detok.finalize()
                    yield Piece(detok.last_segment, token, finish, stats, cached)
                    if finish is not None:
                        break
            finally:
                self._guard(tokens.close)  # fills `stats`; the chain is between windows here
                if drafter is not None and drafter.taps:
                    drafter.taps.remove()
                with self._lock:
                    t = self._totals
                    t["requests"] += 1
                    t["prompt_tokens"] += len(ids)
                    t["cached_prompt_tokens"] += cached
                    t["completion_tokens"] += n
                    t["decode_s"] += time.perf_counter() - t0
                    self._last = stats

    def _start(self, ids: list[int], request, stats: PipelineStats):
        """RESET the chain for this request; the token generator, the drafter (or None), cached tokens."""
        import mlx.core as mx

        from runtime.decode import SpecConfig, common_prefix, make_drafter
        from runtime.pipeline.speculative import PipelineSpeculative

        seed = self.run.seed if request.seed is None else request.seed
        mx.random.seed(seed)
        if self.draft is None:  # plain: keep the prompt prefix the caches already hold (not the last prompt token)
            self.driver.reset(min(common_prefix(self.driver.tokens, ids), len(ids) - 1))
            cached = len(self.driver.tokens)
            sampler = make_sampler(temp=request.temperature, top_p=request.top_p, min_p=request.min_p, top_k=request.top_k)
            return plain_stream(self.driver, ids, max_tokens=request.max_tokens, sampler=sampler, eos_ids=self.eos,
                                stats=stats), None, cached
        self.driver.reset(0)
        run = self.run
        drafter = make_drafter(self.draft[0], run.predictor if run.cutoff != 0 else "none")
        cfg = SpecConfig(num_draft=run.num_draft, cutoff=run.cutoff, temp=request.temperature, top_p=request.top_p,
                         top_k=request.top_k, min_p=request.min_p, seed=seed)
        spec = PipelineSpeculative(self.driver, drafter, self.predictor, cfg)
        return spec.stream(ids, request.max_tokens, self.eos, stats), drafter, 0

    def _guard(self, fn):
        """fn(); a failure of the chain (or anything after a message went out) ends every rank."""
        try:
            return fn()
        except ValueError:
            raise  # bad input, refused before anything was sent
        except Exception as e:  # noqa: BLE001 - a rank is gone or the chain is out of step: stop them all
            fail_rank(self.driver.ch, 0, e, getattr(e, "rank", None) if getattr(e, "rank", None) != 0 else None)

    # -- idle ------------------------------------------------------------------------------
    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 2):
            if not self._chain.acquire(blocking=False):
                continue  # a request is running: its messages keep the ranks waiting for less than the timeout
            try:
                if not self._stop.is_set() and time.monotonic() - self.driver.last_send >= self.heartbeat_s:
                    self._guard(self.driver.heartbeat)
                    with self._lock:
                        self._totals["heartbeats"] += 1
            finally:
                self._chain.release()

    def close(self) -> None:
        """STOP every rank (they exit 0) and print every rank's report line."""
        self._stop.set()
        self._beat.join(timeout=self.heartbeat_s + 5)
        with self._chain:
            stats = self._last or PipelineStats(self.driver.ch.size, 0, 0, 0.0, 0.0, 0.0)
            stats.ranks = self._guard(self.driver.stop)
        self.log(f"specmoe serve --pipeline: stopped every rank ({self._totals['requests']} requests); last request: "
                 f"{stats.line()}")

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.stage.counters()
        with self._lock:
            totals, last = dict(self._totals), self._last
        hits, misses = c["hits"], c["misses"]
        ch = self.driver.ch
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "requests": totals,
            "pipeline": {"ranks": ch.size, "split": [list(r) for r in self.stage.split.ranges],
                         "timeout_s": self.run.timeout_s, "heartbeat_s": self.heartbeat_s,
                         "channel_rank0": dict(vars(ch.stats)), "rank0_windows": self.driver.timer.n_windows},
            "expert_cache": {"rank": 0, "hit_rate": hits / (hits + misses) if hits + misses else None, "hits": hits,
                             "misses": misses, "budget_bytes": self.stage.cache.nbytes if self.stage.cache else 0},
            "io": {"rank": 0, "bytes_read": c["bytes_read"], "load_wait_ms": round(c["load_wait_ms"], 3),
                   "prefetch_used": c["prefetch_hits"]},
            "host_syncs": {"rank": 0, "by_window_kind": c["host_syncs"],  # the other ranks report theirs with STOP
                           "how": "per stage: 1 per device-pass window + 1 per repair (+ synced layer calls); "
                                  "synced path: 1 per MoE layer + 1"},
            "speculative": None if self.draft is None else {"num_draft": self.run.num_draft, "predictor": self.run.predictor,
                                                            "adaptive_k": True},
            "memory": self.stage.memory(),
            "last_request": None if last is None else last.to_json(),
        }


def run_serve(run: PipelineRun, config, log=print) -> int:
    """Every rank of an `mlx.launch` group: rank 0 serves `config` (a runtime.serve.ServeConfig)."""
    import os
    import signal

    def rank0(stage, draft, ch) -> int:
        backend = PipelineBackend(stage, draft, ch, run, log)
        # uvicorn handles SIGINT/SIGTERM (graceful shutdown, then backend.close: STOP to every rank) and
        # re-raises the signal once it has stopped: a stop asked for is a clean exit, not a failure.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            serve_backend(backend, config, stage.store.config, log, close=backend.close,
                          note=f"; a pipeline over {ch.size} ranks, rank 0 pid {os.getpid()}")
        except KeyboardInterrupt:
            pass
        return 0

    return run_ranks(run, rank0, serving=True)
