"""The default predictor of a drafter of another width (runtime/decode/predictor_default.py): the pair starts
with one note, decodes the stock tokens, and an explicitly asked spmoe without a projection is still refused."""

from __future__ import annotations

import json

import pytest

from runtime import load, stream_generate
from runtime.checkpoints.tiny import make_tiny
from runtime.decode.predictor_default import FALLBACK, default_predictor
from tests.conftest import PROMPT, TINY, greedy_ids, run_cli

N = 16


@pytest.fixture(scope="module")
def narrow_drafter(tmp_path_factory):
    """A random dense drafter of width 32 beside the width-64 tiny target (the same tokenizer)."""
    return make_tiny(tmp_path_factory.mktemp("narrow") / "d", "qwen3", seed=11, layers=TINY["layers"], hidden=32)


def test_the_api_starts_a_pair_of_other_widths_with_one_note_and_stock_tokens(tiny_dirs, narrow_drafter):
    target = tiny_dirs["qwen3_moe"]
    with load(target, budget="50%", draft=narrow_drafter) as engine:
        assert engine.draft.predictor == FALLBACK
        assert len(engine.notes) == 1
        note = engine.notes[0]
        assert "\n" not in note and "width 32" in note and "target's 64" in note and "specmoe calibrate" in note
        tokens = [r.token for r in stream_generate(engine, PROMPT, max_tokens=N)]
        expected = greedy_ids(engine.model.model, engine.tokenizer.encode(PROMPT), N)
    assert tokens == expected


def test_an_asked_spmoe_without_a_projection_is_refused(tiny_dirs, narrow_drafter):
    with load(tiny_dirs["qwen3_moe"], budget="50%", draft=narrow_drafter, predictor="spmoe") as engine:
        assert engine.draft.predictor == "spmoe" and engine.notes == []
        with pytest.raises(ValueError, match="drafter width 32 differs from the target's 64: spmoe needs a projection"):
            next(stream_generate(engine, PROMPT, max_tokens=2))


def test_the_default_keeps_spmoe_where_it_runs_as_is(tiny_dirs, tmp_path):
    from runtime.decode.pairing import default_projection_path

    t_cfg = json.loads((tiny_dirs["qwen3_moe"] / "config.json").read_text())
    same = dict(t_cfg, model_type="qwen3")
    other = dict(same, hidden_size=32)
    args = (tiny_dirs["qwen3_moe"], t_cfg, tmp_path / "d")
    assert default_predictor("spmoe", False, args[0], t_cfg, args[2], same, None) == ("spmoe", None)  # equal widths
    assert default_predictor("spmoe", True, args[0], t_cfg, args[2], other, None) == ("spmoe", None)  # asked for
    assert default_predictor("popularity", False, args[0], t_cfg, args[2], other, None) == ("popularity", None)
    assert default_predictor("spmoe", False, args[0], t_cfg, args[2], other, tmp_path / "p.safetensors")[1] is None
    target = tmp_path / "t"
    target.mkdir()
    assert default_predictor("spmoe", False, target, t_cfg, args[2], other, None)[0] == FALLBACK
    default_projection_path(target, other).write_bytes(b"")  # a projection fitted for this pair: spmoe runs
    assert default_predictor("spmoe", False, target, t_cfg, args[2], other, None) == ("spmoe", None)


def test_the_cli_starts_the_pair_with_one_notice_line(tiny_dirs, narrow_drafter, tmp_path):
    target = str(tiny_dirs["qwen3_moe"])
    out, plain = tmp_path / "s.json", tmp_path / "p.json"
    code, _, err = run_cli(["generate", "-m", target, "-p", PROMPT, "-n", str(N), "--draft", str(narrow_drafter),
                            "--budget", "50%", "--json", str(out), "--raw-prompt"])
    assert code == 0, err
    notices = [line for line in err.splitlines() if "no projection is fitted for this pair" in line]
    assert len(notices) == 1 and notices[0].startswith(f"predictor {FALLBACK}"), err
    assert "Traceback" not in err and "error" not in err
    run_cli(["generate", "-m", target, "-p", PROMPT, "-n", str(N), "--budget", "50%", "--json", str(plain), "--raw-prompt"])
    result = json.loads(out.read_text())
    assert result["predictor"] == FALLBACK and result["tokens"] == json.loads(plain.read_text())["tokens"]
