"""Bad input: one line naming what was wrong, exit 2, no traceback, source untouched."""

from __future__ import annotations

import json
import struct

import pytest

from storage.packer import convert
from tests.conftest import run_cli, tree_digest


def _truncate(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return "model.safetensors", "beyond the file"


def _header_beyond_file(d):
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    return "model.safetensors", "runs past the end"


def _rewrite_header(d, edit):
    f = d / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob = blob + b" " * (n - len(blob))
    assert len(blob) == n, "edit must not grow the header"
    f.write_bytes(raw[:8] + blob + raw[8 + n :])


def _unknown_dtype(d):
    _rewrite_header(d, lambda h: h["model.norm.weight"].update(dtype="Q9"))
    return "model.norm.weight", "unknown dtype 'Q9'"


def _shape_mismatch(d):
    name = "model.layers.0.mlp.switch_mlp.down_proj.scales"
    _rewrite_header(d, lambda h: h[name].update(shape=[h[name]["shape"][0], h[name]["shape"][1], 3]))
    return name, "needs"


def _missing_expert(d):
    from safetensors.numpy import load_file, save_file

    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.2.mlp.switch_mlp.gate_proj.scales"]
    save_file(w, str(d / "model.safetensors"))
    return "model.layers.2.mlp.switch_mlp", "weight and scales|missing|quantization"


def _unsupported(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    return "config.json", "unsupported model_type 'llama'"


CASES = {
    "truncated file": _truncate,
    "header length beyond the file": _header_beyond_file,
    "unknown dtype": _unknown_dtype,
    "tensor shape/offset mismatch": _shape_mismatch,
    "missing expert tensor": _missing_expert,
    "unsupported model_type": _unsupported,
}


def _check_one_line_error(code, out, err, *needles):
    assert code == 2
    lines = [l for l in err.strip().splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("specmoe: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err  # progress/budget notes may precede it
    assert "Traceback" not in err + out
    for n in needles:
        assert n in errors[0], (n, errors[0])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint(case, tiny_qwen, tmp_path):
    name, message = CASES[case](tiny_qwen)
    before = tree_digest(tiny_qwen)
    code, out, err = run_cli(["generate", "--model", str(tiny_qwen), "--prompt", "hi", "-n", "2"])
    import re

    assert re.search(message, err), err
    _check_one_line_error(code, out, err, name)
    code2, _, err2 = run_cli(["convert", "-m", str(tiny_qwen), "--out", str(tmp_path / "dst")])
    assert code2 == 2 and "Traceback" not in err2
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst.partial-*"))
    assert tree_digest(tiny_qwen) == before  # the source is never modified


def test_checksum_mismatch_on_packed_record_stops_the_run(tiny_qwen, tmp_path):
    packed = convert(tiny_qwen, tmp_path / "packed")
    from storage import ExpertStore

    store = ExpertStore.open(packed)
    layer_file = store.ranges(store_key := __import__("storage").ExpertKey(store.moe_layers[0], 0))[0].path
    raw = bytearray(open(layer_file, "rb").read())
    for e in range(store.layout(store_key.layer).n_experts):  # corrupt every record of the layer
        (rng,) = store.ranges(__import__("storage").ExpertKey(store_key.layer, e))
        raw[rng.offset + 7] ^= 0x10
    open(layer_file, "wb").write(bytes(raw))
    code, out, err = run_cli(["generate", "--model", str(packed), "--prompt", "hi", "-n", "2"])
    _check_one_line_error(code, out, err, "checksum mismatch", layer_file)


def test_budget_below_minimum(tiny_qwen):
    code, out, err = run_cli(["generate", "--model", str(tiny_qwen), "--prompt", "hi", "--budget", "2KB"])
    _check_one_line_error(code, out, err, "--budget 2KB", "minimum")


def test_bad_flag_values(tiny_qwen):
    code, _, err = run_cli(["generate", "--model", str(tiny_qwen), "--prompt", "hi", "--budget", "lots"])
    _check_one_line_error(code, "", err, "--budget 'lots'")
    code, _, err = run_cli(["generate", "--model", str(tiny_qwen), "--prompt", "hi", "--policy", "fifo"])
    _check_one_line_error(code, "", err, "fifo")
    code, _, err = run_cli(["generate", "--model", str(tiny_qwen / "nope"), "--prompt", "hi"])
    _check_one_line_error(code, "", err, "nope")
    code, _, err = run_cli(["generate", "--model", str(tiny_qwen), "--prompt", "hi", "--max-tokens", "0"])
    assert code == 2 and "max-tokens" in err and "Traceback" not in err


def test_debug_shows_the_traceback(tiny_qwen):
    _unsupported(tiny_qwen)
    with pytest.raises(ValueError, match="unsupported model_type"):
        run_cli(["--debug", "generate", "--model", str(tiny_qwen), "--prompt", "hi"])


def test_convert_refuses_existing_destination_and_keeps_it(tiny_qwen, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, _, err = run_cli(["convert", "-m", str(tiny_qwen), "--out", str(dst)])
    _check_one_line_error(code, "", err, "--force")
    assert (dst / "keep.txt").read_text() == "mine"


def test_interrupted_convert_leaves_no_store(tiny_qwen, tmp_path, monkeypatch):
    from storage import packer

    calls = {"n": 0}
    real = packer._write_layer

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(packer, "_write_layer", dying)
    before = tree_digest(tiny_qwen)
    code, _, err = run_cli(["convert", "-m", str(tiny_qwen), "--out", str(tmp_path / "dst")])
    _check_one_line_error(code, "", err, "No space left")
    assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert tree_digest(tiny_qwen) == before
