"""Per-layer linear maps from drafter hidden states to target hidden states.

Fitted by ridge regression on calibration tokens (teacher-forced text run through
both models): for target layer t with drafter layer m(t), W_t minimises
||[H_d 1] W - H_t||^2 + lam ||W||^2 (the bias row is not penalised much: lam is
small). Saved as a safetensors file whose metadata names the target and drafter
(model_type, hidden sizes, layer counts, a digest of each config) so a file made
for another pair is refused.

Invariant: apply() maps (..., D_d) -> (..., D_t) for every layer in the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np


def config_digest(config: dict) -> str:
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_experts", "num_local_experts",
            "num_experts_per_tok", "vocab_size", "moe_intermediate_size", "intermediate_size")
    cfg = config.get("text_config", config)
    return hashlib.sha256(json.dumps({k: cfg.get(k) for k in keys}, sort_keys=True).encode()).hexdigest()[:16]


def ridge_fit(x: np.ndarray, y: np.ndarray, lam: float = 1e-2) -> np.ndarray:
    """W of shape (D_x + 1, D_y) minimising ||[x 1] W - y||^2 + lam * n * ||W||^2."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    xb = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    gram = xb.T @ xb + lam * x.shape[0] * np.eye(xb.shape[1])
    return np.linalg.solve(gram, xb.T @ y)


class Projections:
    def __init__(self, weights: dict[int, np.ndarray], meta: dict):
        self.weights = weights  # target layer -> (D_d + 1, D_t)
        self.meta = meta  # who the file is for (see check())
        self._mx = {l: (mx.array(w[:-1].astype(np.float32)), mx.array(w[-1].astype(np.float32))) for l, w in weights.items()}

    def apply(self, layer: int, h: mx.array) -> mx.array:
        w, b = self._mx[layer]
        return h.astype(mx.float32) @ w + b

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.stem}.tmp.safetensors")  # mx.save_safetensors wants the suffix
        arrays = {f"layer.{l}": mx.array(w.astype(np.float32)) for l, w in self.weights.items()}
        mx.save_safetensors(str(tmp), arrays, metadata={"specmoe": json.dumps(self.meta)})
        tmp.rename(path)

    @classmethod
    def load(cls, path: str | Path) -> "Projections":
        path = Path(path)
        try:
            arrays, metadata = mx.load(str(path), return_metadata=True)
            meta = json.loads(metadata["specmoe"])
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a specmoe projection file ({type(e).__name__}: {e})") from None
        weights = {int(k.split(".")[1]): np.array(v, np.float64) for k, v in arrays.items()}
        return cls(weights, meta)

    def check(self, target_config: dict, drafter_config: dict, where, fingerprints: tuple[str, str] | None = None) -> None:
        """Refuse a file made for another pair: configs must match, and weights too when fingerprints are given."""
        want = {"target": config_digest(target_config), "drafter": config_digest(drafter_config)}
        got = {"target": self.meta.get("target_digest"), "drafter": self.meta.get("drafter_digest")}
        if fingerprints is not None and want == got:
            stored = (self.meta.get("target_weights"), self.meta.get("drafter_weights"))
            if stored != tuple(fingerprints):
                raise ValueError(
                    f"{where}: projection file was fitted for other weights of this architecture "
                    f"(target/drafter {stored[0]}/{stored[1]}, loaded {fingerprints[0]}/{fingerprints[1]}); "
                    "run `specmoe calibrate` again for this pair"
                )
        if want != got:
            raise ValueError(
                f"{where}: projection file was made for target {self.meta.get('target_model_type')}/"
                f"{got['target']} and drafter {got['drafter']}, not this pair ({want['target']}, {want['drafter']}); "
                "run `specmoe calibrate` for this pair"
            )
