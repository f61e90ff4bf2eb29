"""Every command that pages experts runs the newer families end to end: convert, info, generate
(plain and speculative, raw and packed), profile, and tune (slow). Output parity with stock
mlx-lm is the family contract's job (tests/test_family_contract.py); here the commands must
accept each family, report its structure, and agree with each other."""

from __future__ import annotations

import json

import pytest

from runtime.checkpoints.tiny import make_tiny
from tests.conftest import TINY, long_tier, run_cli

NEW_FAMILIES = ("olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")
EXPERT_MODULE = {"gpt_oss": "experts"}
MODE = {"gpt_oss": "mxfp4"}


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli_drafter") / "d", "qwen3", seed=9, layers=TINY["layers"])


# deepseek_v2 and gpt_oss (its own expert module and MXFP4) by default; the other families in the long tier.
@pytest.mark.parametrize("family", long_tier(NEW_FAMILIES, keep={"deepseek_v2", "gpt_oss"}))
def test_convert_info_generate_profile(family, tiny_dirs, drafter, tmp_path):
    src, dst = tiny_dirs[family], tmp_path / "packed"
    code, _, err = run_cli(["convert", "-m", str(src), "--out", str(dst)])
    assert code == 0, err
    for path in (src, dst):
        code, _, err = run_cli(["info", "-m", str(path), "--budget", "25%", "--json", str(tmp_path / "info.json")])
        assert code == 0, err
        facts = json.loads((tmp_path / "info.json").read_text())
        assert facts["supported"] and facts["model_type"] == family
        assert facts["expert_module"] == f"model.layers.*.mlp.{EXPERT_MODULE.get(family, 'switch_mlp')}"
        assert {q["mode"] for q in facts["quantization"].values()} == {MODE.get(family, "affine")}
        assert ("gate_proj.bias" in facts["expert_tensors"]) == (family == "gpt_oss")
        assert ("gate_proj.biases" in facts["expert_tensors"]) == (family != "gpt_oss")  # mxfp4 has no offsets
        assert facts["budget"]["slots_per_layer"] == 8
        act = "SwigluOAI" if family == "gpt_oss" else "SwiGLU"
        assert facts["expert_class"].startswith(f"SwitchGLU({act}; {MODE.get(family, 'affine')} 4-bit")
    texts = {}
    for name, path, extra in (("plain raw", src, []), ("plain packed", dst, []),
                              ("speculative packed", dst, ["--draft", str(drafter), "--predictor", "spmoe"])):
        out = tmp_path / "g.json"
        code, _, err = run_cli(["generate", "-m", str(path), "-p", "The river", "-n", "6", "--budget", "25%",
                                "--json", str(out), *extra])
        assert code == 0, (name, err)
        texts[name] = json.loads(out.read_text())["tokens"]
    assert texts["plain raw"] == texts["plain packed"] == texts["speculative packed"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The river began in the hills.\nA function should do one thing.\n")
    code, _, err = run_cli(["profile", "-m", str(dst), "--prompts", str(prompts), "--decode-tokens", "2", "--json", str(tmp_path / "p.json")])
    assert code == 0, err
    assert json.loads((tmp_path / "p.json").read_text())


@pytest.mark.slow
def test_tune_a_gpt_oss_store(tiny_dirs, drafter, tmp_path):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_dirs["gpt_oss"], target)  # tune writes tuning.json next to the model
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The river began in the hills.\n")
    code, _, err = run_cli(["tune", "-m", str(target), "--draft", str(drafter), "--prompts", str(prompts), "--measure-tokens", "4",
                            "--json", str(tmp_path / "t.json")])
    assert code == 0, err
    assert json.loads((tmp_path / "t.json").read_text())["chosen"]
    assert (target / "tuning.json").exists()


def test_expert_tensors_that_do_not_match_the_model_module_are_refused(tiny_dirs, tmp_path):
    """gpt-oss without its expert biases: the tensors alone look like valid experts, the module
    structure says each projection has a bias; convert and generate refuse in one line."""
    import shutil

    import mlx.core as mx

    from tests.test_cli_errors import _check_one_line_error

    src = tmp_path / "src"
    shutil.copytree(tiny_dirs["gpt_oss"], src)
    weights = mx.load(str(src / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        del weights[f"model.layers.1.mlp.experts.{proj}.bias"]
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "mlx"})
    code, out, err = run_cli(["convert", "-m", str(src), "--out", str(tmp_path / "dst")])
    _check_one_line_error(code, out, err, "model.layers.1.mlp.experts", "bias")
    assert not (tmp_path / "dst").exists()
    code, out, err = run_cli(["generate", "-m", str(src), "-p", "hi", "-n", "2"])
    _check_one_line_error(code, out, err, "model.layers.1.mlp.experts", "bias")
