"""The planner prices mlx's quantization modes as mx.quantize lays the bytes out.

Affine keeps a scale and a bias per group (16-bit in checkpoints); the microscaled modes keep one
uint8 scale per group and no bias. A config.json's own `quantization` block is used unless flags
override it, and `specmoe plan --quant-mode` refuses an unknown mode with the flag named.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from runtime.cli.plan import resolve_quantization
from runtime.plan import config_quantization, load_model_config, model_costs
from runtime.plan.model_costs import bytes_per_weight
from tests.conftest import run_cli


@pytest.mark.parametrize("mode, bits, group", [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32),
                                               ("affine", 4, 64), ("affine", 8, 32)])
def test_bytes_per_weight_match_mx_quantize(mode, bits, group):
    w = mx.random.normal((32, 512)).astype(mx.bfloat16)  # checkpoints keep 16-bit affine scales
    parts = [a for a in mx.quantize(w, group_size=group, bits=bits, mode=mode) if a is not None]
    assert sum(a.nbytes for a in parts) / w.size == pytest.approx(bytes_per_weight(bits, group, mode))


def test_gpt_oss_in_mxfp4_reads_the_published_expert_size():
    _, config, _ = load_model_config("gpt-oss-20b")
    mxfp4 = model_costs(config, mode="mxfp4")
    affine = model_costs(config)
    # Godwit RESULTS.md (peers-and-limits): 13.2 MB per gpt-oss-20b MXFP4 expert.
    assert mxfp4.expert_bytes / 1e6 == pytest.approx(13.2, abs=0.1)
    assert affine.expert_bytes / mxfp4.expert_bytes == pytest.approx(0.5625 / 0.53125, rel=0.01)
    assert (mxfp4.bits, mxfp4.group_size, mxfp4.quant_mode) == (4, 32, "mxfp4")


def test_a_checkpoints_own_quantization_is_used_unless_flags_say_otherwise():
    own = {"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}
    assert config_quantization(own) == (4, 32, "mxfp4")
    assert config_quantization({"quantization": {"group_size": 128, "bits": 8}}) == (8, 128, "affine")
    assert config_quantization({}) is None
    assert resolve_quantization(own, None, None, None) == (4, 32, "mxfp4")
    assert resolve_quantization(own, 8, None, None) == (8, 64, "affine")  # flags describe an affine model
    assert resolve_quantization({}, None, None, None) == (4, 64, "affine")


def test_plan_refuses_an_unknown_mode_naming_the_flag(tmp_path):
    code, _, err = run_cli(["plan", "-m", "gpt-oss-20b", "--mac", "m4-16gb", "--quant-mode", "fp3"])
    assert code == 2 and "--quant-mode must be one of affine, mxfp4, nvfp4, mxfp8" in err
    assert "Traceback" not in err
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "-m", "gpt-oss-20b", "--mac", "m4-16gb", "--quant-mode", "mxfp4", "--json", str(out)])
    assert code == 0, err
    assert json.loads(out.read_text())["model"]["quant_mode"] == "mxfp4"
