"""Speculative decoding through the pipeline (rank 0): draft, forecast, prefetch, verify, accept, rewind.

One round, with K = num_draft and the verify window W = [p, d_1 .. d_K]:
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
from pathlib import Path

import mlx.core as mx
import numpy as np

from predictor import make_predictor
from runtime.decode import SpecConfig, accept_greedy, accept_sampled, text_config, top_k
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

    def _forecast_and_prefetch(self, taps) -> None:
        if not self.prefetch_layers:
            return
        forecast = self.predictor.forecast(taps, self.prefetch_layers)
        new = [k for k in (ExpertKey(l, int(e)) for l in self.prefetch_layers for e in forecast.experts(l))
               if k not in self._queued]
        if new:
            self._queued.update(new)
            self.driver.forecast(new, self._round, self.cfg.max_prefetch_bytes)

    def _accept(self, draft, logits: mx.array) -> tuple[int, int]:
        if self.cfg.temp == 0:
            return accept_greedy(draft.tokens, np.array(mx.argmax(logits, axis=-1)))
        p = np.array(self.cfg.sampling.probabilities(logits), np.float64)
        return accept_sampled(draft.tokens, draft.q, p, self.rng)  # pads the shorter vocabulary: no target mass lost

    def step(self, pending: int) -> list[int]:
        self._round += 1
        self._queued = set()
        draft = self.drafter.propose(self.cfg.num_draft, sampling=self.cfg.sampling, rng=self.rng,
                                     on_step=self._forecast_and_prefetch)
        window = [pending] + draft.tokens
        logits = self.driver.window(window, keep=True, round_id=self._round)[0]  # (K+1, V)
        n, token = self._accept(draft, logits)
        self.driver.rewind(len(window) - 1 - n, n + 1)
        self.drafter.settle(n, token)
        self.n_rounds += 1
        self.n_drafted += len(draft.tokens)
        self.n_accepted += n
        return draft.tokens[:n] + [token]

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids=(), on_token=None) -> tuple[list[int], PipelineStats]:
        if max_tokens < 1:
            raise ValueError(f"--max-tokens {max_tokens}; expected >= 1")
        if not prompt_ids:
            raise ValueError("the prompt is empty after tokenization; expected at least one token")
        t0 = time.perf_counter()
        self.driver.prefill(prompt_ids[:-1], self.cfg.prefill_chunk)
        self.drafter.prefill(prompt_ids)
        t1 = time.perf_counter()  # decode throughput counts every round, as SpecStats does
        pending, out = prompt_ids[-1], []
        while len(out) < max_tokens:
            done = False
            for token in self.step(pending):
                out.append(token)
                if on_token:
                    on_token(token)
                if token in eos_ids or len(out) >= max_tokens:
                    done = True
                    break
            if done:
                break
            pending = out[-1]
        t_end = time.perf_counter()
        stats = PipelineStats(n_ranks=self.driver.ch.size, n_prompt_tokens=len(prompt_ids), n_tokens=len(out),
                              prefill_s=t1 - t0, decode_s=t_end - t1,
                              tokens_per_s=len(out) / (t_end - t1) if t_end > t1 else 0.0,
                              n_windows=self.driver.timer.n_windows, n_drafted=self.n_drafted,
                              n_accepted=self.n_accepted, n_rounds=self.n_rounds)
        return out, stats
