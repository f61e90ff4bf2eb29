"""Speculative decoding through the pipeline (rank 0): draft, forecast, prefetch, verify, accept, rewind.

One round, with K from adaptive K (runtime.decode.DraftLength, as single-process speculative
decoding: K follows acceptance, down to K = 0 plain rounds with probes; SpecConfig(adaptive_k=False):
always num_draft, for tests) and the verify window W = [p, d_1 .. d_K]:
- draft + forecast: the drafter (on rank 0) proposes d_1..d_K; after each of its steps
  the predictor forecasts the experts W will need in every prefetched MoE layer, and
- prefetch: each new forecast key goes to the rank owning its layer -- rank 0's own
  loader directly, the others' as one FORECAST message per draft step down the chain --
  so every rank's loader reads while the drafter runs.
- verify: W passes through the stages as one FORWARD message per hop.
- accept: greedy (exact match) or rejection sampling, on rank 0.
- rewind: rank 0 at once; the other ranks with the next window's header (trim the
  rejected tail, or restore the snapshot and re-run the accepted prefix of W from the
  input each rank kept).

Invariant: greedy output equals plain greedy decoding through the same pipeline; the
forecasts only change what is read when, never what is computed. Predictors that
learn from routing (previous, popularity, oracle) would need every rank's routing on
rank 0 and are refused; spmoe (drafter taps through the target's routers, kept on
rank 0 for every MoE layer) and none run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from predictor import make_predictor
from runtime.decode import DraftLength, SpecConfig, accept_greedy, accept_sampled, sample, text_config, top_k
from runtime.pipeline.generation import PipelineStats
from storage import ExpertKey

PIPELINE_PREDICTORS = ("spmoe", "none")


def pipeline_predictor(name: str, stage, draft_model, draft_config: dict, *, projection: Path | None = None,
                       forecast_k: int | None = None):
    """The forecaster rank 0 runs for every rank's layers."""
    k = top_k(stage.store.config)
    if name not in PIPELINE_PREDICTORS:
        raise ValueError(f"--predictor {name}: with --pipeline the forecaster is one of {', '.join(PIPELINE_PREDICTORS)} "
                         f"(the others learn from routing that stays on the rank owning each layer)")
    if name == "none":
        return make_predictor("none", top_k=k)
    from predictor.layer_map import layer_map
    from predictor.projection import Projections
    from runtime.checkpoints import model_fingerprint
    from runtime.decode import default_projection_path

    n_layers = int(text_config(stage.store.config)["num_hidden_layers"])
    path = projection or default_projection_path(stage.store.model_dir, draft_config)
    proj = None
    if Path(path).exists():
        proj = Projections.load(path)
        proj.check(stage.store.config, draft_config, path, (stage.model_fingerprint, model_fingerprint(draft_model)))
    elif projection is not None:
        raise ValueError(f"--projection {projection}: file not found")
    elif text_config(stage.store.config)["hidden_size"] != text_config(draft_config)["hidden_size"]:
        raise ValueError(f"drafter width differs from the target's: spmoe needs a projection; "
                         f"run `specmoe calibrate --model {stage.store.model_dir} --draft DIR`")
    return make_predictor("spmoe", top_k=forecast_k or k, routers=stage.routers,
                          layer_map=layer_map(n_layers, len(draft_model.layers)), projections=proj)


class PipelineSpeculative:
    def __init__(self, driver, drafter, predictor, cfg: SpecConfig = SpecConfig()):
        self.driver = driver
        self.drafter = drafter
        self.predictor = predictor
        self.cfg = cfg
        moe = sorted(driver.stage.store.moe_layers)
        cutoff = len(moe) if cfg.cutoff is None else cfg.cutoff
        if cutoff > len(moe):
            raise ValueError(f"--cutoff {cutoff} is beyond the model's {len(moe)} MoE layers; expected 0..{len(moe)}")
        self.prefetch_layers = moe[:cutoff]
        self.rng = np.random.default_rng(cfg.seed)
        self.n_rounds = self.n_drafted = self.n_accepted = 0
        self._round = 0
        self._queued: set[ExpertKey] = set()
        self.draft_length = DraftLength(cfg.num_draft, adaptive=cfg.adaptive_k)
        self.n_plain_rounds = 0

    def _forecast_and_prefetch(self, taps) -> None:
        if not self.prefetch_layers:
            return
        forecast = self.predictor.forecast(taps, self.prefetch_layers)
        new = [k for k in (ExpertKey(l, int(e)) for l in self.prefetch_layers for e in forecast.experts(l))
               if k not in self._queued]
        if new:
            self._queued.update(new)
            self.driver.forecast(new, self._round)

    def _accept(self, tokens: list[int], q, logits: mx.array) -> tuple[int, int]:
        if self.cfg.temp == 0:
            return accept_greedy(tokens, np.array(mx.argmax(logits, axis=-1)))
        p = np.array(self.cfg.sampling.probabilities(logits), np.float64)
        if not tokens:  # a plain round: the target's own sample
            return 0, sample(p[0], self.rng)
        return accept_sampled(tokens, q, p, self.rng)  # pads the shorter vocabulary: no target mass lost

    def step(self, pending: int) -> list[int]:
        self._round += 1
        self._queued = set()
        k = self.draft_length.next_k()
        if k:
            draft = self.drafter.propose(k, sampling=self.cfg.sampling, rng=self.rng,
                                         on_step=self._forecast_and_prefetch)
            tokens, q = draft.tokens, draft.q
        else:  # a plain round: no drafter work, no forecast, nothing to rewind
            tokens, q = [], None
        window = [pending] + tokens
        logits = self.driver.window(window, keep=bool(k), round_id=self._round)[0]  # (K+1, V)
        n, token = self._accept(tokens, q, logits)
        if k:
            self.driver.rewind(len(window) - 1 - n, n + 1)
            self.drafter.settle(n, token)
        else:
            self.drafter.skip(token)
        self.draft_length.record(k, n)
        self.n_rounds += 1
        self.n_plain_rounds += k == 0
        self.n_drafted += len(tokens)
        self.n_accepted += n
        return tokens[:n] + [token]

    def stream(self, prompt_ids: list[int], max_tokens: int, eos_ids=(), stats: PipelineStats | None = None) -> Iterator[int]:
        """Yield up to `max_tokens` tokens, a round's tokens as the round ends; the driver's caches must
        be fresh (driver.reset(0)). `stats` is filled in once the generator is exhausted or closed."""
        if max_tokens < 1:
            raise ValueError(f"--max-tokens {max_tokens}; expected >= 1")
        if not prompt_ids:
            raise ValueError("the prompt is empty after tokenization; expected at least one token")
        if self.driver.tokens:
            raise ValueError("rank 0: speculative decoding through the pipeline starts from fresh caches")
        t0, w0 = time.perf_counter(), self.driver.timer.n_windows
        self.driver.prefill(prompt_ids[:-1], self.cfg.prefill_chunk)
        self.drafter.prefill(prompt_ids)
        t1 = time.perf_counter()  # decode throughput counts every round, as SpecStats does
        pending, n_out = prompt_ids[-1], 0
        try:
            while n_out < max_tokens:
                for token in self.step(pending):
                    n_out += 1
                    yield token
                    if token in eos_ids or n_out >= max_tokens:
                        return
                    pending = token
        finally:
            if stats is not None:
                t_end = time.perf_counter()
                stats.n_ranks, stats.n_prompt_tokens, stats.n_tokens = self.driver.ch.size, len(prompt_ids), n_out
                stats.prefill_s, stats.decode_s = t1 - t0, t_end - t1
                stats.tokens_per_s = n_out / (t_end - t1) if t_end > t1 else 0.0
                stats.n_windows = self.driver.timer.n_windows - w0
                stats.n_drafted, stats.n_accepted = self.n_drafted, self.n_accepted
                stats.n_rounds, stats.n_plain_rounds = self.n_rounds, self.n_plain_rounds

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids=(), on_token=None) -> tuple[list[int], PipelineStats]:
        stats = PipelineStats(self.driver.ch.size, len(prompt_ids), 0, 0.0, 0.0, 0.0)
        out = []
        for token in self.stream(prompt_ids, max_tokens, eos_ids, stats):
            out.append(token)
            if on_token:
                on_token(token)
        return out, stats
