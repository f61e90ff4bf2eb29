"""Route syncs that prefetch ahead (runtime/decode/route_ahead.py): a routed forward's layer forecasts the next
layers from its own MoE input, read back with its codes, and queues their absent experts; decoding stays
lossless, later layers find forecast experts resident, nothing stays pinned, and "auto" turns it on only
while reads are slow."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.route_ahead import RouteAhead
from tests.conftest import PROMPT, greedy_ids
from tests.pass_helpers import decode_through_pass, pass_idle

N = 16


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_routed_forwards_prefetch_ahead_losslessly(family, tiny_dirs):
    want = greedy_ids(load(str(tiny_dirs[family]))[0], load(str(tiny_dirs[family]))[1].encode(PROMPT), N)
    runs = {}
    for ahead in (False, True):
        om = OffloadedModel.load(tiny_dirs[family], OffloadConfig(budget="25%"))
        try:
            tokens, dp = decode_through_pass(om, N, segment="auto", route_ahead=ahead)
            assert tokens == want
            assert pass_idle(om) and not om.cache._protected  # every forecast's protection ended with its forward
            runs[ahead] = (dp.stats, om.counters())
        finally:
            om.close()
    (off, _), (on, c_on) = runs[False], runs[True]
    assert on.routed > 0 and off.ahead_prefetched == 0 and on.ahead_prefetched > 0
    # Forecast experts were used: later layers found them resident (prefetch hits), and read less on demand.
    assert c_on["prefetch_hits"] > 0 and on.route_reads < off.route_reads


def test_the_forecast_is_the_router_lookahead_of_later_layers(tiny_dirs):
    """The stacked forecast names what predictor/lookahead.py's RouterLookahead names, layer by layer, for the
    layers after the source only, less what already has a slot."""
    from predictor.lookahead import RouterLookahead

    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%"))
    try:
        ra, ref = RouteAhead(om, True), RouterLookahead(om.routers(), (1, 2), om.top_k)
        layer = om.moe_layers[0]
        x = 20 * mx.random.normal((1, 3, om.model.args.hidden_size), key=mx.random.key(0))  # peaked routers
        forecast = ra.forecast(layer, x)
        mx.eval(forecast[1])
        want = {(hop.target, int(e)) for hop, top in ref.forecast(layer, x) for e in ref.experts(top)}
        assert len(want) > 4 and {t for t, _ in want} == set(om.moe_layers[1:3])
        assert {(k.layer, k.expert) for k in ra.absent_keys(om.cache, forecast)} == want  # nothing resident yet
        loaded = {(om.moe_layers[1], e) for e in sorted(e for t, e in want if t == om.moe_layers[1])[:4]}
        om.cache.load_absent({om.moe_layers[1]: np.array(sorted(e for _, e in loaded))})
        assert {(k.layer, k.expert) for k in ra.absent_keys(om.cache, forecast)} == want - loaded
        assert ra.forecast(om.moe_layers[-1], x) is None  # nothing after the last layer
    finally:
        om.close()


def test_auto_turns_on_only_while_reads_are_slow(tiny_dirs):
    from runtime.decode.route_ahead import MIN_READ_MS

    om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%", inject="slow:ms=1"))
    try:
        ra = RouteAhead(om)
        assert not ra.active()  # nothing read yet: nothing measured
        om.cache.load_absent({om.moe_layers[0]: np.arange(4)})
        assert ra.active()  # every read slept 1 ms
        stats = om.loader.stats  # the rule itself, on set figures (real fast reads are too noisy to assert on)
        stats.read_ms = 0.9 * MIN_READ_MS * (stats.n_requests - stats.n_cancelled - stats.n_failed)
        assert not ra.active()
        assert RouteAhead(om, True).active() and not RouteAhead(om, False).active()
    finally:
        om.close()
    with pytest.raises(ValueError, match="route_ahead"):
        RouteAhead(None, "sometimes")


def test_the_model_config_sets_the_passes_default(tiny_dirs):
    from runtime.decode.device_pass import DevicePass

    with pytest.raises(ValueError, match="route_ahead='sometimes'"):
        OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(route_ahead="sometimes"))
    for mode, want in (("off", False), ("on", True), ("auto", "auto")):
        om = OffloadedModel.load(tiny_dirs["qwen3_moe"], OffloadConfig(budget="25%", route_ahead=mode))
        try:
            assert DevicePass(om).route_ahead.mode == want and DevicePass(om, route_ahead="on").route_ahead.mode is True
        finally:
            om.close()
    assert OffloadConfig().route_ahead == "off"  # within the noise here; "auto" would depend on the load


def test_generate_takes_route_ahead_and_refuses_a_bad_value(tiny_dirs, tmp_path):
    from tests.conftest import run_cli

    model = str(tiny_dirs["qwen3_moe"])
    base = ["generate", "-m", model, "-p", "The quick brown fox", "-n", "12", "--budget", "25%", "--raw-prompt"]
    code, out_off, _ = run_cli(base + ["--json", str(tmp_path / "off.json")])
    assert code == 0
    code, out_on, _ = run_cli(base + ["--route-ahead", "on", "--json", str(tmp_path / "on.json")])
    assert code == 0 and out_on == out_off  # lossless: the same text
    import json

    off = json.loads((tmp_path / "off.json").read_text())["stats"]
    on = json.loads((tmp_path / "on.json").read_text())["stats"]
    assert off["prefetch_reads_per_token"] == 0 and on["prefetch_reads_per_token"] > 0
    code, out, err = run_cli(base + ["--route-ahead", "sometimes"])
    assert code != 0 and "--route-ahead 'sometimes'; expected one of auto, on, off" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_take_route_ahead_too(tiny_dirs, command):
    from tests.conftest import run_cli

    code, out, _ = run_cli([command, "--help"])
    assert code == 0 and "--route-ahead" in out
    code, _, err = run_cli([command, "-m", str(tiny_dirs["qwen3_moe"]), "--route-ahead", "sometimes"])
    assert code != 0 and "--route-ahead 'sometimes'; expected one of auto, on, off" in err
    assert "Traceback" not in err


def test_the_long_running_commands_load_the_engine_with_it(tiny_dirs):
    """chat and serve load through load_engine: the setting reaches the model (device passes' default)."""
    from runtime.cli.engine_options import load_engine

    engine = load_engine(tiny_dirs["qwen3_moe"], budget="25%", draft=None, route_ahead="on")
    try:
        assert engine.model.route_ahead == "on"
    finally:
        engine.close()

