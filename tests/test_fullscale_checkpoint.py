"""The full-size checkpoint writer (bench/fullscale_checkpoint.py) at toy widths (--small): the layout
mlx-community publishes, loadable by mlx-lm's own classes and by specmoe's store, tokens equal to stock,
the routing knobs doing what they say, and the writer holding one tensor at a time."""

from __future__ import annotations

import json
import sys
import tracemalloc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load

from tests.bench_scripts import BENCH
from tests.conftest import PROMPT, greedy_ids

sys.path.insert(0, str(BENCH.parent))
from bench import fullscale_weights  # noqa: E402
from bench.fullscale_checkpoint import main, preset_config, write_checkpoint  # noqa: E402

LAYERS = {"qwen3-30b-a3b": 2, "qwen3.5-35b-a3b": 4, "gpt-oss-20b": 2}  # qwen3.5: 3 linear-attention + 1 full


@pytest.mark.parametrize("preset", list(LAYERS))
def test_writer_output_loads_in_mlx_lm_and_specmoe_pages_it_losslessly(tmp_path, preset):
    from runtime.decode import generate_tokens
    from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
    from storage import ExpertStore

    out = tmp_path / preset
    summary = write_checkpoint(out, preset, small=True, layers=LAYERS[preset], max_shard_bytes=1 << 20)
    assert summary["files"] > 1  # sharded, with the index mlx-lm and the store follow
    index = json.loads((out / "model.safetensors.index.json").read_text())
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    routers = [k for k, v in quant.items() if isinstance(v, dict) and v.get("bits") == 8]
    assert len(routers) >= LAYERS[preset] and all(k.endswith(("mlp.gate", "mlp.router", "shared_expert_gate")) for k in routers)
    if preset == "gpt-oss-20b":
        assert quant["model.layers.0.mlp.experts.gate_proj"]["mode"] == "mxfp4"
        assert "model.layers.0.mlp.experts.gate_proj.bias" in index["weight_map"]  # experts with biases
    if preset == "qwen3.5-35b-a3b":
        assert config["text_config"]["full_attention_interval"] == 4
        assert any("shared_expert." in k for k in index["weight_map"]) and any("linear_attn" in k for k in index["weight_map"])
    assert config["specmoe_synthetic"]["scales_dtype"] == "float32"

    stock, tok = load(str(out))
    ids = tok.encode(PROMPT)
    ref = greedy_ids(stock, ids, 8)
    assert max(ref) < config["specmoe_synthetic"]["tokenizer_vocab"] and 0 not in ref  # decodable, never EOS
    store = ExpertStore.open(out)
    try:
        assert len(store.layouts()) == LAYERS[preset] and {l.n_experts for l in store.layouts().values()} == {16}
    finally:
        store.close()
    om = OffloadedModel.load(out, OffloadConfig(budget="50%"))
    try:
        got, _ = generate_tokens(om.model, ids, max_tokens=8, om=om)
    finally:
        om.close()
    assert got == ref


def test_bfloat16_scales_as_published_and_values_depend_on_seed_and_name_only(tmp_path):
    a = write_checkpoint(tmp_path / "a", "qwen3-30b-a3b", small=True, layers=1, dtype="bfloat16")
    write_checkpoint(tmp_path / "b", "qwen3-30b-a3b", small=True, layers=1, dtype="bfloat16", max_shard_bytes=1 << 19)
    one = mx.load(str(tmp_path / "a" / "model.safetensors"))
    many = {}
    for f in sorted((tmp_path / "b").glob("model-*.safetensors")):
        many.update(mx.load(str(f)))
    assert len(many) > 0 and one.keys() == many.keys()
    assert all(mx.array_equal(one[k], many[k]).item() for k in one)  # sharding changes no value
    header = json.loads((tmp_path / "a" / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (tmp_path / "a" / "model.safetensors").read_bytes()[:8], "little")])
    assert header["model.layers.0.mlp.switch_mlp.up_proj.scales"]["dtype"] == "BF16"
    assert a["dtype"] == "bfloat16"
    stock, tok = load(str(tmp_path / "a"))
    assert len(set(greedy_ids(stock, tok.encode(PROMPT), 6))) > 1


def _routing(path, n_tokens: int = 48) -> tuple[float, float]:
    """(share of experts a token keeps from the previous token, share of routing to the top quarter of experts),
    averaged over layers, from the router logits of one forward over random token ids."""
    model, _ = load(str(path))
    logits: list = []

    class Tap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            y = self.inner(x)
            logits.append(y)
            return y

    for layer in model.layers:
        layer.mlp.gate = Tap(layer.mlp.gate)  # this instance only
    k = model.layers[0].mlp.top_k
    model(mx.array(np.random.default_rng(0).integers(3, 4000, n_tokens))[None])
    keep, top = [], []
    for y in logits:
        sel = np.argsort(-np.array(y[0].astype(mx.float32)), -1)[:, :k]
        keep.append(np.mean([len(set(a) & set(b)) / k for a, b in zip(sel[:-1], sel[1:])]))
        counts = np.sort(np.bincount(sel.ravel(), minlength=y.shape[-1]))
        top.append(counts[-y.shape[-1] // 4:].sum() / counts.sum())
    return float(np.mean(keep)), float(np.mean(top))


def test_locality_and_skew_knobs_change_routing(tmp_path, monkeypatch):
    def made(name, **knobs):
        return write_checkpoint(tmp_path / name, "qwen3-30b-a3b", small=True, layers=4, **knobs)["out"]

    keep0, top0 = _routing(made("plain"))
    assert keep0 < 0.65  # 8 of 16 experts: 0.5 is chance
    keep_local, _ = _routing(made("local", locality=0.8))
    _, top_skewed = _routing(made("skewed", skew=2.0))
    assert keep_local > keep0 + 0.15
    assert top_skewed > top0 + 0.08
    # A writer whose knobs do nothing fails the same checks.
    monkeypatch.setattr(fullscale_weights, "_gain", lambda module, knobs: 0.5 if module.endswith("down_proj") else 1.0)
    monkeypatch.setattr(fullscale_weights, "_skew_offset", lambda module, shape, group, knobs: np.zeros(shape, np.float32))
    assert _routing(made("local-broken", locality=0.8))[0] < keep0 + 0.15
    assert _routing(made("skewed-broken", skew=2.0))[1] < top0 + 0.08


def test_writer_holds_one_tensor_at_a_time(tmp_path):
    tracemalloc.start()
    try:
        summary = write_checkpoint(tmp_path / "c", "qwen3.5-35b-a3b", small=True, layers=4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < summary["total_bytes"] / 3  # the largest tensor (the embedding) and its temporaries


def test_cli_errors_are_one_line_with_exit_2(tmp_path, capsys):
    assert main(["--preset", "llama-70b", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--preset 'llama-70b'" in err and "qwen3-30b-a3b" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["--preset", "gpt-oss-20b", "--out", str(tmp_path / "full"), "--small"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["--preset", "gpt-oss-20b", "--out", str(tmp_path / "y"), "--layers", "99"]) == 2
    capsys.readouterr()
    with pytest.raises(ValueError, match="locality"):
        write_checkpoint(tmp_path / "z", "gpt-oss-20b", small=True, locality=1.0)
    assert main(["--preset", "qwen3-30b-a3b", "--out", str(tmp_path / "w"), "--small", "--embed-rms", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--embed-rms 0.0" in err


def test_embed_rms_sets_the_embedding_rows_and_a_share_output_drafters_agreement(tmp_path):
    """--embed-rms R: embedding rows of rms R sqrt(layers), recorded in config.json; a larger R lets the token's own
    direction dominate the final state, so a --share-output drafter agrees with the target's greedy tokens more."""
    from bench.random_drafter import write_random_drafter

    agreement = {}
    for r in (1.2, 6.0):
        out = tmp_path / f"r{r}"
        write_checkpoint(out, "qwen3-30b-a3b", small=True, layers=24, embed_rms=r)
        assert json.loads((out / "config.json").read_text())["specmoe_synthetic"]["embed_rms_per_sqrt_layer"] == r
        target, tok = load(str(out))
        e = target.model.embed_tokens
        rows = mx.dequantize(e.weight, e.scales, e.biases, group_size=64, bits=4)[:512]
        rms = mx.sqrt(mx.mean(rows * rows)).item()
        assert rms == pytest.approx(r * 24**0.5, rel=0.1)
        drafter, _ = load(str(write_random_drafter(tmp_path / f"d{r}", out, layers=1, share_output=True)))
        ids = greedy_ids(target, tok.encode(PROMPT), 24)
        seq = mx.array([tok.encode(PROMPT) + ids])
        n = len(tok.encode(PROMPT)) - 1
        a, b = mx.argmax(target(seq)[0, n:-1], -1), mx.argmax(drafter(seq)[0, n:-1], -1)
        agreement[r] = (a == b).astype(mx.float32).mean().item()
    assert agreement[6.0] > agreement[1.2] + 0.15, agreement


def test_full_size_presets_have_the_published_dimensions():
    from bench.fullscale_checkpoint import model_specs

    expected = {"qwen3-30b-a3b": (48, 128, 2.65, 151936), "qwen3.5-35b-a3b": (40, 256, 1.77, 248320),
                "gpt-oss-20b": (24, 32, 13.2, 201088)}
    for preset, (layers, n_experts, expert_mb, vocab) in expected.items():
        config = preset_config(preset)
        specs, _, _ = model_specs(config, "bfloat16")  # lazily built: nothing allocated
        experts = [s for s in specs if ".switch_mlp." in s.name or ".experts." in s.name]
        per_expert = sum(s.nbytes for s in experts) / (layers * n_experts) / 1e6
        assert per_expert == pytest.approx(expert_mb, rel=0.03), preset
        embed = next(s for s in specs if s.name.endswith("embed_tokens.weight"))
        assert embed.shape[0] == vocab


def test_locality_at_full_depth_keeps_greedy_tokens_varied(tmp_path, monkeypatch):
    """48 layers (the Qwen3-30B-A3B depth) at toy widths, P = 0.5 and S = 1: consecutive tokens keep most experts
    and greedy decoding still walks through varied tokens. The writer that boosted attention in every hidden
    dimension and let lm_head read them all settled on one token (bench/results/fullscale_qwen3-30b-a3b_local.txt)."""
    def made(name):
        return write_checkpoint(tmp_path / name, "qwen3-30b-a3b", small=True, layers=48, locality=0.5, skew=1.0)["out"]

    def distinct(path):
        stock, tok = load(str(path))
        return len(set(greedy_ids(stock, tok.encode(PROMPT), 16)))

    local = made("local")
    assert _routing(local)[0] > 0.8 and distinct(local) >= 6
    monkeypatch.setattr(fullscale_weights, "_local_rows", lambda hidden: hidden)  # the boost in every dimension
    monkeypatch.setattr(fullscale_weights, "_unread_by_output", lambda hidden: 0)  # lm_head reads them all
    assert distinct(made("unsplit")) < 6
