"""`specmoe calibrate`: fit drafter->target projections for SP-MoE forecasting.

Both models read the same calibration text teacher-forced (no KV cache, fixed
chunks). For each target MoE layer t we collect the target's post-attention
residual (the input of the norm in front of its router) and the drafter's at layer
m(t), hold out every tenth chunk (and at least the last one, so the scores are
always held-out), and fit a ridge regression per layer. Reported, on the held-out
tokens only: R^2 and how often the projected state picks the same top-k experts as
the target's own (router agreement), beside the agreement of no projection (the
drafter's state as is) when the widths are equal.

A projection is worse than none when, on the held-out tokens, its mean router
agreement is below no projection's (equal widths), or (different widths, where
spmoe cannot run without one) its R^2 is below 0 -- worse than predicting the mean
-- in more than half of the layers; `specmoe calibrate` then warns and does not
install it where `generate` looks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from predictor.layer_map import layer_map
from predictor.projection import Projections, config_digest, ridge_fit
from runtime.decode import text_config
from runtime.checkpoints import model_fingerprint
from runtime.decode import HiddenTaps


@dataclass
class CalibrationReport:
    n_tokens: int  # calibration tokens (fit + held out)
    r2: dict[int, float]  # target layer -> held-out R^2 of the projected residual
    agreement: dict[int, float]  # target layer -> held-out top-k overlap of router choices
    held_out_tokens: int = 0  # tokens the scores were computed on (never fitted on)
    baseline_agreement: dict[int, float] | None = None  # no projection (equal widths only), held-out

    def worse_layers(self) -> list[int]:
        """Layers where the projection does worse than none on held-out tokens: lower router
        agreement than the drafter's state as is (equal widths), else R^2 < 0 (worse than the mean)."""
        base = self.baseline_agreement
        if base:
            return [l for l in self.r2 if self.agreement[l] < base[l]]
        return [l for l in self.r2 if self.r2[l] < 0]

    def worse_than_none(self) -> str | None:
        """Why the projection as a whole should not be used, or None."""
        base = self.baseline_agreement
        if base:
            mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
            if mean(self.agreement) < mean(base):
                return (f"mean held-out router agreement {mean(self.agreement):.1%} is below no projection's "
                        f"{mean(base):.1%}")
            return None
        negative = self.worse_layers()
        if len(negative) > len(self.r2) / 2:
            return f"held-out R^2 < 0 in {len(negative)} of {len(self.r2)} layers (worse than predicting the mean)"
        return None


def _residuals(model, taps: HiddenTaps, ids: list[int], layers: dict[int, int]) -> dict[int, np.ndarray]:
    taps.enabled = True
    mx.eval(model(mx.array(ids)[None]))
    taps.enabled = False
    rec = taps.take()
    return {t: np.array(rec[src]["h"][0].astype(mx.float32)) for t, src in layers.items()}


def calibrate(target, draft_model, draft_config: dict, text: str, *, max_tokens: int = 8192, chunk: int = 256,
              lam: float = 1e-2, progress: Callable[[int], None] | None = None) -> tuple[Projections, CalibrationReport]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # long calibration texts exceed model_max_length on purpose
    ids = list(target.tokenizer.encode(text))[:max_tokens]
    if len(ids) < 2 * chunk:
        raise ValueError(f"calibration text has {len(ids)} tokens; expected at least {2 * chunk} (pass a longer --text)")
    moe = target.moe_layers
    lm = layer_map(len(target.model.layers), len(draft_model.layers))
    t_taps, d_taps = HiddenTaps(target.model), HiddenTaps(draft_model)
    xs, ys, held = {l: [] for l in moe}, {l: [] for l in moe}, []
    try:
        for i, start in enumerate(range(0, len(ids) - chunk + 1, chunk)):
            piece = ids[start : start + chunk]
            y = _residuals(target.model, t_taps, piece, {l: l for l in moe})
            x = _residuals(draft_model, d_taps, piece, {l: lm[l] for l in moe})
            held.append(i % 10 == 9)
            for l in moe:
                xs[l].append(x[l])
                ys[l].append(y[l])
            if progress:
                progress(len(piece))
    finally:
        t_taps.remove()
        d_taps.remove()
    if not any(held):
        held[-1] = True  # fewer than 10 chunks: hold out the last, never score on fitted tokens
    fit_idx = [i for i, h in enumerate(held) if not h]
    test_idx = [i for i, h in enumerate(held) if h]
    same_width = text_config(target.config)["hidden_size"] == text_config(draft_config)["hidden_size"]
    baseline = {} if same_width else None
    weights, r2, agreement = {}, {}, {}
    routers, k = target.routers(), target.top_k
    for l in moe:
        x_fit, y_fit = np.concatenate([xs[l][i] for i in fit_idx]), np.concatenate([ys[l][i] for i in fit_idx])
        x_test, y_test = np.concatenate([xs[l][i] for i in test_idx]), np.concatenate([ys[l][i] for i in test_idx])
        w = ridge_fit(x_fit, y_fit, lam)
        weights[l] = w
        pred = np.concatenate([x_test, np.ones((len(x_test), 1))], axis=1) @ w
        r2[l] = float(1 - ((pred - y_test) ** 2).sum() / ((y_test - y_test.mean(0)) ** 2).sum())
        agreement[l] = _router_agreement(routers[l], pred, y_test, k)
        if baseline is not None:
            baseline[l] = _router_agreement(routers[l], x_test, y_test, k)
    meta = {
        "target_model_type": target.config.get("model_type"), "target_digest": config_digest(target.config),
        "drafter_model_type": draft_config.get("model_type"), "drafter_digest": config_digest(draft_config),
        "target_width": text_config(target.config)["hidden_size"], "drafter_width": text_config(draft_config)["hidden_size"],
        "layer_map": {str(t): d for t, d in lm.items()}, "n_tokens": len(ids), "ridge_lambda": lam,
        "target_weights": model_fingerprint(target.model), "drafter_weights": model_fingerprint(draft_model),
    }
    held_out = sum(len(xs[moe[0]][i]) for i in test_idx)
    return Projections(weights, meta), CalibrationReport(len(ids), r2, agreement, held_out, baseline)


def _router_agreement(router, predicted: np.ndarray, actual: np.ndarray, k: int) -> float:
    def top(h):
        logits = np.array(router.gate(router.norm(mx.array(h.astype(np.float32)))).astype(mx.float32))
        return np.argpartition(-logits, k - 1, axis=-1)[:, :k]

    a, b = top(predicted), top(actual)
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(a, b)]))
