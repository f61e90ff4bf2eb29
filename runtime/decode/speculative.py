"""SpeculativeDecoder: draft -> forecast -> prefetch -> verify -> accept -> rewind.

One round, with K = num_draft and the verify window W = [p, d_1 .. d_K] where p
is the last emitted token (not yet seen by the target):
- draft:    the drafter proposes d_1..d_K; after each of its steps the predictor
            forecasts the experts the target will need for W, and
- prefetch: forecast experts of the first `cutoff` MoE layers are queued on the
            loader (earlier layers first, capped in bytes) and protected from
            eviction until their layer is verified. Reads overlap the drafting.
- verify:   one target forward over W (K+1 tokens) as a device pass: expert lookups on
            the device and one host sync when the forecast covered the window; absent
            experts are read at once and the pass recomputes from the first layer that
            missed (runtime/decode/device_pass.py).
- accept:   greedy (exact match) or rejection sampling (target distribution kept).
- adapt:    K follows acceptance round by round, down to K = 0: plain decoding
            with no drafter work (runtime/decode/draft_length.py), a stretch of such
            rounds decoded as plain decoding decodes (runtime/decode/plain_stretch.py).
            Near the end K is cut so the window ends at the last token wanted: a draft past it
            would cost its experts' reads and its compute and never be emitted.
- rewind:   trimmable caches drop the rejected tail; caches that cannot be trimmed
            (GatedDeltaNet state, a full rotating cache) are restored from a
            snapshot taken before verify and the accepted tokens are re-run.
            Queued prefetches of the round are cancelled.

A decoder runs one generation (stream/generate): its KV caches keep that context, so a second is refused.

Invariant: greedy output equals greedy decoding of the target alone; sampled
output has the target's distribution. The predictor only changes what is read
when, never what is computed. "Equals" is bit-exact where verify windows run
stock mlx-lm arithmetic (the CPU backend: tested); on Metal the dedup kernel
computes windows within metal.dedup_verify.tolerance of stock, and MLX's own
multi-token kernels may round differently from single-token decode, so a near-tie
in the argmax can resolve differently there (as in any speculative decoder).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from predictor.base import DraftTaps, ExpertForecast
from runtime.cache import DEFAULT_PREFILL_STEP
from runtime.decode.draft_length import DraftLength
from runtime.decode.forecast_score import ForecastScore
from runtime.decode.kv_only import kv_only
from runtime.decode.drafter import ModelDrafter
from runtime.decode.device_pass import DevicePass
from runtime.decode.plain import holds_every_expert
from runtime.decode.plain_stretch import plain_stretch
from runtime.decode.prefill import PrefillMeter
from runtime.decode.rollback import roll_back, snapshot_untrimmable
from runtime.decode.warm import warm_start
from runtime.decode.sampling import Sampling, accept_greedy, accept_sampled
from runtime.decode.spec_stats import SpecStats
from storage import ExpertKey


@dataclass(frozen=True)
class SpecConfig:
    num_draft: int = 4  # K: tokens proposed per round
    cutoff: int | None = None  # prefetch for the first `cutoff` MoE layers; None: all, 0: none
    temp: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # mlx-lm's sampler filters (0: off); the target's distribution keeps them
    min_p: float = 0.0
    seed: int = 0
    prefill_chunk: int = DEFAULT_PREFILL_STEP  # prompt tokens per target forward during prefill (mlx-lm's 2048);
    # under --memory-limit the target's ContextGovernor sizes it instead: the whole prompt unless its activations need less
    warm: str | None = None  # None: a full budget reads every expert first; "off": none (runtime/decode/warm.py)
    one_sync: str = "auto"  # verify as device passes (one host sync, repair): auto (layers whose windows keep missing
    # routed) or on (never routed); off: one sync per layer
    adaptive_k: bool = True  # K per round from acceptance, down to 0 (plain rounds); False: always num_draft
    route: str = "auto"  # auto (with one_sync auto): a window's layers whose misses make it pay sync before their
    # experts (runtime/decode/window_routes.py); off: never

    def __post_init__(self):
        if self.num_draft < 1:
            raise ValueError(f"--num-draft {self.num_draft}; expected K >= 1")
        if self.cutoff is not None and self.cutoff < 0:
            raise ValueError(f"--cutoff {self.cutoff}; expected 0 (no prefetch) up to the number of MoE layers")
        self.sampling  # validates temp, top_p, top_k, min_p
        if self.one_sync not in ("auto", "on", "off"):
            raise ValueError(f"--one-sync {self.one_sync!r}; expected auto, on or off")
        if self.route not in ("auto", "off"):
            raise ValueError(f"route={self.route!r}; expected auto or off")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temp, self.top_p, self.top_k, self.min_p)


class SpeculativeDecoder:
    def __init__(self, target, drafter: ModelDrafter, predictor, cfg: SpecConfig = SpecConfig()):
        self.target = target  # OffloadedModel
        self.drafter = drafter
        self.predictor = predictor
        self.cfg = cfg
        moe = target.moe_layers
        cutoff = len(moe) if cfg.cutoff is None else cfg.cutoff
        if cutoff > len(moe):
            raise ValueError(f"--cutoff {cutoff} is beyond the model's {len(moe)} MoE layers; expected 0..{len(moe)}")
        self.prefetch_layers = moe[:cutoff]
        # Forecasts cost drafter-side compute every draft step: make them only for layers we prefetch.
        self.forecast_layers = self.prefetch_layers
        self.cache = make_prompt_cache(target.model)
        self.rng = np.random.default_rng(cfg.seed)
        self.stats = SpecStats(per_layer={l: ForecastScore() for l in moe}, prefetch_layers=list(self.prefetch_layers))
        self._routing: dict[int, np.ndarray] = {}
        self._round = 0
        self._forecast = ExpertForecast.empty()
        self._queued: set[ExpertKey] = set()
        self._queued_ids: dict[int, set[int]] = {}  # the same, per layer: expert ids
        self._pass = DevicePass(target) if cfg.one_sync != "off" else None
        self._route = cfg.route == "auto" and cfg.one_sync == "auto"  # "on": one sync and repairs, never routed
        if self._pass is not None:  # layers whose windows keep missing sync before their experts (window_routes.py)
            self._pass.route_windows = self._route
        self.draft_length = DraftLength(cfg.num_draft, adaptive=cfg.adaptive_k)
        self._streamed = False  # one generation per decoder: its caches keep the context it ran

    # -- phases ------------------------------------------------------------------------
    def _forecast_and_prefetch(self, taps: DraftTaps) -> None:
        if not self.forecast_layers:
            return
        self._forecast = self.predictor.forecast(taps, self.forecast_layers)
        new = []  # keys not queued earlier this round (a forecast mostly grows by a few experts per step)
        for l in self.prefetch_layers:
            queued = self._queued_ids.setdefault(l, set())
            for e in self._forecast.experts(l).tolist():
                if e not in queued:
                    queued.add(e)
                    new.append(ExpertKey(l, e))
        if not new:
            return
        self._queued.update(new)
        queued = self.target.cache.prefetch(new, self._round)  # bounded by the cache's free slots
        self.stats.prefetch_bytes_queued += queued

    def _draft(self, k: int):
        t0 = time.perf_counter()
        self._forecast, self._queued, self._queued_ids = ExpertForecast.empty(), set(), {}
        prepare = getattr(self.predictor, "prepare", None) if self.forecast_layers else None
        draft = self.drafter.propose(k, sampling=self.cfg.sampling, rng=self.rng, on_step=self._forecast_and_prefetch,
                                     on_taps=None if prepare is None else (lambda taps: prepare(taps, self.forecast_layers)))
        self.stats.draft_s += time.perf_counter() - t0
        return draft

    def _verify(self, window: list[int], snapshot: list) -> mx.array:
        t0 = time.perf_counter()
        self._routing = {}
        self.target.set_observer(self._observe)
        try:
            self.target.label_round("verify")
            logits = self._forward(window, count=True)[0]  # (K+1, V)
        finally:
            self.target.set_observer(None)  # also when the forward raises: never leave it observing
        mx.eval(logits)
        self.stats.verify_s += time.perf_counter() - t0
        if self._pass is not None:
            self.stats.window_reads.add(self._routing, self._pass.forward_reads, len(window))
        return logits

    def _forward(self, tokens: list[int], count: bool) -> mx.array:
        """The target over `tokens` as a device pass (one host sync if their experts are resident)."""
        inputs = mx.array(tokens)[None]
        forward = lambda: self.target.model(inputs, cache=self.cache)  # noqa: E731
        if self._pass is None:
            return forward()
        before = (self._pass.stats.host_syncs, self._pass.stats.repairs, self._pass.stats.multi_sync)
        if count:
            # Layers whose windows keep missing sync their codes before their experts run (window_routes.py's rule on
            # the windows' own miss rates): a miss there costs its read, no recompute. A window the forecast
            # usually covers keeps its one sync.
            routes = self._pass.window_routes()
            unrouted = {l for l in self.target.moe_layers if l not in routes}
            if unrouted:
                # Those layers' prefetches land first: a forecast expert still loading would read as absent and
                # cost a repair (a recompute) instead of the same wait. A routed layer needs no such wait: it
                # waits at its own route sync for its experts still in flight (promoted to demand), so its reads
                # overlap the earlier layers' compute.
                self.stats.settle_ms += self.target.cache.settle_inflight(unrouted)
        routed0 = self._pass.stats.routed
        out = self._pass.run(forward, self.cache, len(tokens))
        if count:
            self.stats.routed_rounds += self._pass.stats.routed - routed0
            self.stats.one_sync_tries += 1
            self.stats.host_syncs += self._pass.stats.host_syncs - before[0]
            self.stats.repairs += self._pass.stats.repairs - before[1]
            self.stats.one_sync_fallbacks += self._pass.stats.multi_sync - before[2]
        return out

    def _observe(self, layer: int, ids: np.ndarray) -> None:
        self._routing[layer] = np.concatenate([self._routing[layer], ids]) if layer in self._routing else ids

    def _accept(self, draft, logits: mx.array) -> tuple[int, int]:
        if self.cfg.temp == 0:
            return accept_greedy(draft.tokens, np.array(mx.argmax(logits, axis=-1)))
        p = np.array(self.cfg.sampling.probabilities(logits), np.float64)
        # Padded vocabularies may differ in length: accept_sampled pads the shorter with zeros
        # (trimming p would drop target probability mass).
        return accept_sampled(draft.tokens, draft.q, p, self.rng)

    def _score_forecast(self) -> None:
        for l, ids in self._routing.items():
            if l not in self.forecast_layers:
                continue
            actual = set(np.unique(ids).tolist())
            forecast = set(self._forecast.experts(l).tolist())
            s = self.stats.per_layer[l]
            s.hits += len(actual & forecast)
            s.forecast += len(forecast)
            s.actual += len(actual)

    def _rewind(self, window: list[int], n_accepted: int, snapshot: list) -> None:
        t0 = time.perf_counter()
        rejected = len(window) - 1 - n_accepted
        if any(s is not None for s in snapshot):
            if rejected:
                roll_back(self.cache, snapshot, len(window))
                self.target.label_round("rerun")
                # The verify pass has just used these tokens' experts: a one-sync pass almost always holds.
                self._forward(window[: n_accepted + 1], count=False)
                mx.eval([c.state for c in self.cache])
                self.target.end_round()
                self.stats.n_reruns += 1
        elif rejected:
            for c in self.cache:
                c.trim(rejected)
        self.target.drop_prefetches_before(self._round + 1)
        self.target.cache.unprotect()
        self.stats.rewind_s += time.perf_counter() - t0

    # -- the loop ------------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int], on_chunk=None) -> int:
        """Feed all prompt tokens but the last to both models; returns the pending token.
        on_chunk(processed, total) after each chunk, as mlx-lm's prompt_progress_callback."""
        if not prompt_ids:
            raise ValueError("the prompt is empty after tokenization; expected at least one token")
        head = prompt_ids[:-1]
        warm_start(self.target, self.cfg.warm)  # reads overlap the prefill
        step = self.prefill_step(len(prompt_ids))
        limit = self.target.context_governor
        for i in range(0, len(head), step):  # each chunk of >= 64 tokens runs expert-major (each expert read once)
            if limit is not None:  # slots give way to the KV this chunk adds
                limit.observe(self.cache, i, min(i + step, len(head)) + 1, chunk=step)
            self.target.label_round("prefill")
            with kv_only(self.target):  # logits unread: the last layer's experts are skipped, as stock's lazy graph does
                self.target.model(mx.array(head[i : i + step])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            if on_chunk is not None:
                on_chunk(min(i + step, len(head)), len(head))
        self.drafter.prefill(prompt_ids)
        self.target.cache.settle_inflight()  # the warm start's reads are in before the first round
        return prompt_ids[-1]

    def prefill_step(self, n_prompt: int) -> int:
        """Prompt tokens per target prefill forward: the memory limit's chunk (the whole prompt unless its
        activations need less) when the target has one, else cfg.prefill_chunk."""
        limit = self.target.context_governor
        if limit is None:
            return self.cfg.prefill_chunk
        return limit.chunk_for(max(1, n_prompt - 1), n_prompt + self.cfg.num_draft + 1)

    def step(self, pending: int, max_new: int | None = None, eos_ids=()) -> list[int]:
        """One round: returns the tokens it emits (accepted drafts plus one target token); with K = 0, a stretch
        of plain rounds up to the next probe (at most `max_new` tokens, ending after an `eos_ids` token)."""
        self._round += 1
        k = self.draft_length.next_k()
        if k == 0:
            return self._plain(pending, self.draft_length.plain_rounds() if max_new is None
                               else min(max_new, self.draft_length.plain_rounds()), eos_ids)
        if max_new == 1:  # one token left: the target's own, as a plain round (no draft can be emitted)
            return self._last_token(pending, eos_ids)
        if k == 1 and self.draft_length.probing and self.cfg.sampling.greedy:
            return self._probe(pending, eos_ids)
        wanted = k if max_new is None else min(k, max_new - 1)  # no drafts past the last token wanted
        k, cut = wanted, wanted < k
        draft = self._draft(k)
        window = [pending] + draft.tokens
        snapshot = snapshot_untrimmable(self.cache)
        logits = self._verify(window, snapshot)
        n, token = self._accept(draft, logits)
        if self.target.telemetry is not None:
            used = {ExpertKey(l, int(e)) for l, ids in self._routing.items() for e in np.unique(ids)}
            self.target.telemetry.end_verify(n, len(self._queued), len(self._queued - used))
        self._score_forecast()
        self.predictor.observe(self._routing)
        self._rewind(window, n, snapshot)
        self.drafter.settle(n, token)
        self.draft_length.record(k, n, cut=cut)
        self.stats.n_rounds += 1
        self.stats.n_drafted += len(draft.tokens)
        self.stats.n_accepted += n
        return draft.tokens[:n] + [token]

    def _plain(self, pending: int, n: int, eos_ids) -> list[int]:
        """K = 0: `n` plain rounds at once, decoded as plain decoding decodes; the drafter queues their tokens."""
        tokens = self._plain_tokens(pending, n, eos_ids)
        for token in tokens:
            self.drafter.skip(token)
            self.draft_length.record(0, 0)
        self._round += len(tokens) - 1
        self.stats.n_plain_rounds += len(tokens)
        self.stats.n_rounds += len(tokens)
        return tokens

    def _last_token(self, pending: int, eos_ids) -> list[int]:
        """The generation's last token: decoded as a plain round; K and its stretch are left as they were."""
        tokens = self._plain_tokens(pending, 1, eos_ids)
        self.drafter.skip(tokens[0])
        self.stats.n_plain_rounds += 1
        self.stats.n_rounds += 1
        return tokens

    def _probe(self, pending: int, eos_ids) -> list[int]:
        """The greedy probe after a stretch (K = 1): the drafter feeds the stretch's tokens in one forward and proposes
        d_1; the target decodes its token as a plain round does; d_1 is accepted when it is that token. No verify
        window: a rejected probe costs the target nothing beyond plain decoding (an accepted one forgoes the token
        a K = 1 verify would have added after d_1)."""
        t0 = time.perf_counter()
        proposal = self.drafter.propose(1).tokens[0]
        self.stats.draft_s += time.perf_counter() - t0
        tokens = self._plain_tokens(pending, 1, eos_ids)
        n = int(proposal == tokens[0])
        self.drafter.settle(0, tokens[0])  # d_1 was not fed; the target's token is pending, accepted or not
        self.draft_length.record(1, n)
        self.stats.n_rounds += 1
        self.stats.n_probes += 1
        self.stats.n_drafted += 1
        self.stats.n_accepted += n
        return tokens

    def _plain_tokens(self, pending: int, n: int, eos_ids) -> list[int]:
        t0, device = time.perf_counter(), self._pass is not None and (self.cfg.one_sync == "on" or holds_every_expert(self.target))
        tokens = plain_stretch(self.target, self.cache, pending, n, sampling=self.cfg.sampling, rng=self.rng,
                               device_pass=self._pass if device else None, eos_ids=eos_ids)
        self.stats.verify_s += time.perf_counter() - t0
        return tokens

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids=(), on_token=None, progress=None) -> list[int]:
        """All of stream() at once; on_token(token) is called as each arrives."""
        out: list[int] = []
        for token in self.stream(prompt_ids, max_tokens, eos_ids, progress=progress):
            out.append(token)
            if on_token:
                on_token(token)
        return out

    def stream(self, prompt_ids: list[int], max_tokens: int, eos_ids=(), progress=None) -> Iterator[int]:
        """Yield up to `max_tokens` tokens after `prompt_ids`, a round's tokens as the round ends.
        self.stats covers the run once the generator is exhausted or closed. `progress`: a
        PrefillProgress showing the prompt's processing."""
        if max_tokens < 1:
            raise ValueError(f"--max-tokens {max_tokens}; expected >= 1")
        if self._streamed:
            raise RuntimeError("this SpeculativeDecoder already ran a generation and its KV caches hold that context; "
                               "build one per generation (runtime.decode.speculative_decoder)")
        self._streamed = True
        meter = PrefillMeter(self.target, max(0, len(prompt_ids) - 1), progress).start()
        try:
            pending = self.prefill(prompt_ids, on_chunk=meter.on_chunk)
        finally:
            self.stats.prefill = meter.stop()
            self.stats.prefill.chunk_tokens = self.prefill_step(len(prompt_ids))
        c0 = self.target.counters()
        t0 = time.perf_counter()
        n_out = 0
        limit, observed = self.target.context_governor, -8
        try:
            while n_out < max_tokens:
                if limit is not None and self.stats.n_rounds >= observed + 8:  # slots give way as the KV grows (plain
                    observed, now = self.stats.n_rounds, len(prompt_ids) + n_out  # decoding's rule), a stretch included
                    ahead = max(8 * (self.cfg.num_draft + 1), self.draft_length.plain_rounds() + 8)
                    limit.observe(self.cache, now, now + ahead, chunk=self.cfg.num_draft + 1)
                for token in self.step(pending, max_tokens - n_out, eos_ids):
                    n_out += 1
                    yield token
                    if token in eos_ids or n_out >= max_tokens:
                        return
                    pending = token
        finally:
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.n_tokens += n_out
            c1 = self.target.counters()
            self.stats.counters = {k: c1[k] if k in ("usable_slots", "returns_memory") else c1[k] - c0[k] for k in c1}
