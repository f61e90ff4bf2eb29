"""`specmoe calibrate`: scores are held-out, and a projection worse than none is not installed."""

from __future__ import annotations

import shutil
from importlib.resources import files

import numpy as np
from mlx_lm import load

from predictor.projection import ridge_fit
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.pairing import default_projection_path
from runtime.tune import calibrate
from tests.conftest import run_cli


def test_scores_are_held_out_even_with_fewer_than_ten_chunks(tiny_dirs):
    """3 chunks: the last is held out (before: every chunk was fitted and scored, labelled held-out)."""
    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="100%"))
    try:
        text = (files("runtime") / "data" / "calibration.txt").read_text()
        dmodel, dconfig = load(str(tiny_dirs["qwen3_moe"]), return_config=True)[::2]
        proj, report = calibrate(om, dmodel, dconfig, text, max_tokens=3 * 256)
        assert report.held_out_tokens == 256 and report.n_tokens == 768
        # The fit used the first two chunks only: refitting them reproduces the weights.
        from runtime.decode import HiddenTaps

        ids = list(om.tokenizer.encode(text))[:512]
        layer = om.moe_layers[0]
        taps_t, taps_d = HiddenTaps(om.model), HiddenTaps(dmodel)
        try:
            xs, ys = [], []
            for start in (0, 256):
                for taps, model, out in ((taps_t, om.model, ys), (taps_d, dmodel, xs)):
                    import mlx.core as mx

                    taps.enabled = True
                    mx.eval(model(mx.array(ids[start : start + 256])[None]))
                    taps.enabled = False
                    out.append(np.array(taps.take()[layer]["h"][0].astype(mx.float32)))
        finally:
            taps_t.remove()
            taps_d.remove()
        w = ridge_fit(np.concatenate(xs), np.concatenate(ys), 1e-2)
        assert np.allclose(w, proj.weights[layer], atol=1e-6)
        # The target itself as drafter: no projection agrees 100%, a ridge fit less: worse than none.
        assert report.baseline_agreement and all(v == 1.0 for v in report.baseline_agreement.values())
        assert report.worse_than_none() is not None and report.worse_layers()
    finally:
        om.close()


def test_a_projection_worse_than_none_is_not_installed(tiny_dirs, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3_moe"], target)
    import json

    config = json.loads((target / "config.json").read_text())
    default = default_projection_path(target, config)  # the drafter is the target itself here
    code, out, err = run_cli(["calibrate", "-m", str(target), "--draft", str(target), "--tokens", "768"])
    assert code == 0, err
    assert "not installed" in err and "below no projection" in err
    assert "scores on 256 held-out tokens" in out and "no projection" in out
    assert not default.exists()
    explicit = tmp_path / "kept.safetensors"
    code, out, err = run_cli(["calibrate", "-m", str(target), "--draft", str(target), "--tokens", "768",
                              "--out", str(explicit)])
    assert code == 0 and explicit.exists() and "because --out asked for it" in err, err
