"""Using tuning.json in `specmoe generate`: flags given on the command line win, then the
tuned setting for exactly this model, drafter, budget and machine, then built-in defaults."""

from __future__ import annotations

import json
from pathlib import Path

from predictor.projection import config_digest
from runtime.cache import DEFAULT_POLICY
from runtime.tune.tuner import load_tuning, tuning_key

DEFAULTS = {"num_draft": 3,  # = runtime.cli.options.DEFAULT_NUM_DRAFT (mlx-lm's --num-draft-tokens default)
             "predictor": "spmoe", "cutoff": None, "policy": DEFAULT_POLICY}


def _config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # loading the model reports a missing or broken config properly


def resolve_settings(model: Path, draft: Path, budget: str, num_draft, predictor, cutoff, policy):
    """Returns (num_draft, predictor, cutoff, policy, note for the user or None)."""
    given = {"num_draft": num_draft, "predictor": predictor, "cutoff": cutoff, "policy": policy}
    key = tuning_key(config_digest(_config(model)), config_digest(_config(draft)), budget)
    tuned, note = load_tuning(model, key)
    out = dict(DEFAULTS)
    if tuned is not None:
        out.update(num_draft=tuned.num_draft, predictor=tuned.predictor, cutoff=tuned.cutoff, policy=tuned.policy)
        overridden = [k for k, v in given.items() if v is not None]
        note = (f"using tuned settings from {Path(model) / 'tuning.json'}: K={tuned.num_draft}, predictor {tuned.predictor}, "
                f"cutoff {tuned.cutoff}, policy {tuned.policy}"
                + (f" (overridden: {', '.join(overridden)})" if overridden else ""))
    out.update({k: v for k, v in given.items() if v is not None})
    return out["num_draft"], out["predictor"], out["cutoff"], out["policy"], note
