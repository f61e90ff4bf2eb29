"""The trained target/drafter pair shipped in runtime/data/tiny (made by bench/train_tiny.py).

Checks that the package data is a real, related mlx-lm pair: stock ``mlx_lm.load`` reads it, the
target keeps the MoE shape the project's benches rely on, the drafters share its tokenizer and
width, the card records how it was made and measured, and the models behave like trained ones.
"""

from __future__ import annotations

import json
import math
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load

ROOT = Path(str(files("runtime") / "data" / "tiny"))
UNIFORM_CE = math.log(4096)  # nats per token of a model that learned nothing


@pytest.fixture(scope="module")
def card() -> dict:
    return json.loads((ROOT / "card.json").read_text())


@pytest.fixture(scope="module")
def target():
    return load(str(ROOT / "target"), return_config=True)


@pytest.fixture(scope="module")
def drafter():
    return load(str(ROOT / "drafter"), return_config=True)


def drafter_dirs() -> list[Path]:
    return [p for p in (ROOT / "drafter", ROOT / "drafter_shallow", ROOT / "drafter_routed") if p.exists()]


def test_package_data_is_small():
    total = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    assert total < 20e6, f"{total / 1e6:.1f} MB of shipped weights"


def test_target_is_a_sparse_4bit_qwen3_moe(target):
    model, _, config = target
    assert config["model_type"] == "qwen3_moe"
    moe_layers = [layer for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]
    assert len(moe_layers) == len(model.layers) >= 8
    assert config["num_experts"] >= 64
    assert config["num_experts_per_tok"] * 16 <= config["num_experts"]
    assert config["quantization"]["bits"] == 4
    for layer in moe_layers:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(layer.mlp.switch_mlp, proj)
            assert linear.bits == 4 and linear.weight.dtype == mx.uint32, proj
            assert linear.num_experts == config["num_experts"]


@pytest.mark.parametrize("path", drafter_dirs(), ids=lambda p: p.name)
def test_drafters_share_tokenizer_vocab_and_width(path, target):
    _, target_tokenizer, target_config = target
    model, tokenizer, config = load(str(path), return_config=True)
    assert config["model_type"] == "qwen3"
    assert (path / "tokenizer.json").read_bytes() == (ROOT / "target" / "tokenizer.json").read_bytes()
    assert tokenizer.vocab_size == target_tokenizer.vocab_size
    assert config["vocab_size"] == target_config["vocab_size"]
    assert config["hidden_size"] == target_config["hidden_size"]
    assert config["quantization"]["bits"] == 4
    if path.name == "drafter":  # SP-MoE maps drafter layer l to target layer l
        assert len(model.layers) == len(target[0].layers)
    else:
        assert len(model.layers) < len(target[0].layers)


def test_card_records_training_and_measurements(card):
    assert "train_tiny.py" in card["training_command"]
    assert isinstance(card["seed"], int)
    assert len(card["corpus"]["sources"]) == 2 and all(s["licence"] for s in card["corpus"]["sources"])
    for name in ("target", "drafter", "drafter_routed"):
        entry = card["models"][name]
        assert entry["config"]["hidden_size"] > 0
        assert 0 < entry["heldout_ce"]["all"] < UNIFORM_CE
    for name, entry in card["models"].items():
        if name == "target":
            continue
        acceptance = entry["greedy_acceptance"]
        assert acceptance["n_draft"] == 3
        assert 0 <= acceptance["acceptance_rate"] <= 1
        assert acceptance["accepted_per_round"] == pytest.approx(3 * acceptance["acceptance_rate"], abs=0.1)
    routing = card["routing"]
    for key in ("overlap", "overlap_independent", "overlap_within_sequence_shuffle"):
        assert set(routing[key]) == {"d1", "d2", "d3", "d4"}
    assert "max_over_layers" in routing["popularity_max_over_uniform"]
    assert "total" in routing["unused_experts"]


def test_card_routing_is_realistic(card):
    """Trained routing: local (above both shuffles at d=1) and decaying with distance.

    A random-init model fakes high raw overlap through whole-sequence collapse, which the
    within-sequence shuffle exposes; the decay from d=1 to d=4 is absent there too.
    """
    routing = card["routing"]
    overlap = routing["overlap"]
    assert overlap["d1"] > routing["overlap_independent"]["d1"] + 0.05
    assert overlap["d1"] > routing["overlap_within_sequence_shuffle"]["d1"]
    assert overlap["d1"] > overlap["d2"] > overlap["d4"]
    assert routing["unique_experts_in_4_tokens"]["measured"] < routing["unique_experts_in_4_tokens"]["independent"]


def _token_losses(model, ids: list[int]) -> np.ndarray:
    tokens = mx.array(ids)[None]
    logits = model(tokens[:, :-1])
    return np.asarray(nn.losses.cross_entropy(logits, tokens[:, 1:]))[0]


def test_target_loss_on_probe_text_matches_card(card, target):
    model, tokenizer, _ = target
    for text, recorded in zip(card["probe_texts"], card["models"]["target"]["probe_ce"]):
        ce = float(_token_losses(model, tokenizer.encode(text)).mean())
        assert math.isfinite(ce)
        assert ce < UNIFORM_CE - 2, f"target loss {ce:.2f} on {text[:30]!r} is close to uniform"
        assert ce == pytest.approx(recorded, abs=0.05)


def test_drafter_and_target_agree_on_next_tokens(card, target, drafter):
    """Greedy next-token choices of the pair on English text match far above chance (1/4096)."""
    target_model, tokenizer, _ = target
    drafter_model, _, _ = drafter
    same = total = 0
    for text in card["probe_texts"]:
        tokens = mx.array(tokenizer.encode(text))[None]
        same += (mx.argmax(target_model(tokens), -1) == mx.argmax(drafter_model(tokens), -1)).sum().item()
        total += tokens.size
    assert same / total >= 0.25, f"drafter agrees with the target on {same}/{total} next tokens"


def test_routing_trained_drafter_is_cheaper_and_closer_to_the_target(card):
    """The routing-trained drafter has half the depth of the first one, agrees with the target more
    often and was measured to forecast the target's routing (teacher-forced, held out)."""
    first, routed = card["models"]["drafter"], card["models"]["drafter_routed"]
    assert routed["config"]["num_hidden_layers"] * 2 == first["config"]["num_hidden_layers"]
    assert routed["top1_agreement_with_target"] > first["top1_agreement_with_target"]
    assert routed["greedy_acceptance"]["acceptance_rate"] > first["greedy_acceptance"]["acceptance_rate"]
    assert routed["greedy_acceptance"]["matches_target_greedy"]
    recall = routed["projection"]["heldout_window4_recall_per_layer_at_2k"]
    assert len(recall) == card["models"]["target"]["config"]["num_hidden_layers"] and min(recall) > 0.9
    assert (ROOT / routed["projection"]["file"]).exists()
