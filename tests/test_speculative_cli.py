"""`specmoe generate --draft` and `specmoe calibrate`: results and bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.checkpoints.tiny import make_tiny, write_tokenizer
from tests.conftest import TINY, run_cli


@pytest.fixture(scope="module")
def drafter_dir(calibrated):
    return calibrated["drafter"]  # the session's calibrated pair (tests/conftest.py)


def _error_line(err: str) -> str:
    errors = [l for l in err.splitlines() if l.startswith("specmoe: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_speculative_generate_reports_acceptance_and_prefetch(tiny_dirs, drafter_dir, tmp_path):
    out = tmp_path / "r.json"
    code, stdout, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "The quick brown fox", "-n", "12",
                                 "--draft", str(drafter_dir), "--num-draft", "3", "--predictor", "spmoe",
                                 "--budget", "50%", "--json", str(out), "--raw-prompt"])
    assert code == 0, err
    assert "acceptance" in err and "tokens/verify" in err and "forecast recall" in err and "prefetch used" in err
    assert "one-sync verifies" in err
    result = json.loads(out.read_text())
    assert len(result["tokens"]) == 12 and result["predictor"] == "spmoe"
    assert result["detail"]["n_rounds"] >= 1 and 0 <= result["detail"]["recall"] <= 1
    assert 0 <= result["detail"]["one_sync_fallbacks"] <= result["detail"]["one_sync_tries"] <= result["detail"]["n_rounds"]
    plain = tmp_path / "p.json"
    run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "The quick brown fox", "-n", "12",
             "--budget", "50%", "--json", str(plain), "--raw-prompt"])
    assert json.loads(plain.read_text())["tokens"] == result["tokens"]


def test_drafter_with_another_tokenizer(tiny_dirs, drafter_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(drafter_dir, other)
    write_tokenizer(other, vocab_size=290)
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "hi", "--draft", str(other)])
    assert code == 2 and "tokenizer differs" in _error_line(err)


@pytest.mark.parametrize("args,needle", [
    (["--num-draft", "0"], "--num-draft 0"),
    (["--cutoff", "99"], "--cutoff 99 is beyond the model's 3 MoE layers"),
    (["--predictor", "psychic"], "--predictor 'psychic'"),
])
def test_bad_speculative_flags(tiny_dirs, drafter_dir, args, needle):
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "hi", "--draft", str(drafter_dir), *args])
    assert code == 2 and needle in _error_line(err)


def test_projection_for_another_model_is_refused(tiny_dirs, drafter_dir, calibrated, tmp_path):
    proj = calibrated["projection"]
    assert calibrated["code"] == 0 and proj.exists(), calibrated["err"]
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "hi", "-n", "2", "--draft",
                            str(drafter_dir), "--projection", str(proj)])
    assert code == 0, err  # the right pair uses it
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["mixtral"]), "-p", "hi", "--draft", str(drafter_dir),
                            "--projection", str(proj)])
    assert code == 2 and "projection file was made for target qwen3_moe" in _error_line(err)
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "hi", "--draft", str(drafter_dir),
                            "--projection", str(tmp_path / "junk.safetensors")])
    assert code == 2 and "not a specmoe projection file" in _error_line(err)


def test_width_mismatch_needs_a_projection(tiny_dirs, tmp_path):
    narrow = make_tiny(tmp_path / "narrow", "qwen3", seed=6, layers=2, hidden=32)
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "hi", "--draft", str(narrow),
                            "--predictor", "spmoe"])  # asked for; the default falls back (tests/test_predictor_default.py)
    assert code == 2 and "specmoe calibrate" in _error_line(err)
    proj = tmp_path / "p.safetensors"
    code, _, err = run_cli(["calibrate", "-m", str(tiny_dirs["qwen3_moe"]), "--draft", str(narrow), "--out", str(proj),
                            "--tokens", "1024"])
    assert code == 0, err
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "hi", "-n", "6", "--draft", str(narrow),
                            "--projection", str(proj)])
    assert code == 0, err


def test_projection_for_other_weights_of_the_same_architecture_is_refused(tiny_dirs, drafter_dir, calibrated, tmp_path):
    proj = calibrated["projection"]
    assert calibrated["code"] == 0, calibrated["err"]
    retrained = make_tiny(tmp_path / "retrained", "qwen3", seed=123, layers=TINY["layers"])  # same config, new weights
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", "hi", "--draft", str(retrained),
                            "--projection", str(proj)])
    assert code == 2 and "fitted for other weights" in _error_line(err)
