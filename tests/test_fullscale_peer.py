"""bench/fullscale_peer.py: specmoe against mlx-vlm's expert offload under one cgroup cap.

The schedule, the reference tokens, the per-pair ratios and the table run here without mlx-vlm; the end-to-end
comparison on a toy-width checkpoint (the peer launched with a python that has mlx-vlm, SPECMOE_PEER_PYTHON,
default /tmp/venv-vlm/bin/python) runs in the long tier and is skipped with its reason where that python or a
memory cgroup is missing. The project itself never imports mlx-vlm."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.bench_scripts import BENCH

sys.path.insert(0, str(BENCH.parent))
from bench import fullscale_peer
from bench.fullscale_cgroup import CappedResult, available
from bench.result_header import write_result

Run = fullscale_peer.Run
PEER_PYTHON = os.environ.get("SPECMOE_PEER_PYTHON", "/tmp/venv-vlm/bin/python")


def _runs() -> list:
    """Three pairs as the driver records them (pair 2 with the peer first); pair 3's peer was OOM-killed."""
    return [Run("specmoe", 0, True, 0, False, tok_s=0.30, ttft_s=20.0, cgroup_peak_gb=6.1, rss_peak_gb=5.1,
                hit_rate=0.23, mb_per_token=868.0, tokens_equal="yes"),
            Run("peer", 0, False, 0, False, tok_s=0.20, ttft_s=30.0, cgroup_peak_gb=8.0, rss_peak_gb=5.5,
                hit_rate=0.20, mb_per_token=900.0, tokens_equal="yes"),
            Run("peer", 1, True, 0, False, tok_s=0.25, ttft_s=40.0, cgroup_peak_gb=7.9, rss_peak_gb=5.6,
                hit_rate=0.20, tokens_equal="no"),
            Run("specmoe", 1, False, 0, False, tok_s=0.20, ttft_s=25.0, cgroup_peak_gb=6.0, rss_peak_gb=5.1,
                hit_rate=0.23, tokens_equal="yes"),
            Run("specmoe", 2, True, 0, False, tok_s=0.40, ttft_s=10.0, cgroup_peak_gb=6.2, rss_peak_gb=5.2,
                hit_rate=0.23, tokens_equal="yes"),
            Run("peer", 2, False, -9, True, cgroup_peak_gb=8.0, rss_peak_gb=7.9)]


def _check_summary(summary: dict) -> None:
    # Pairs 1-2 are complete: specmoe/peer 0.30/0.20 = 1.5 and 0.20/0.25 = 0.8; pair 3 has no peer run.
    assert summary["n_pairs"] == 2
    assert summary["tok_s_ratio"] == pytest.approx({"median": 1.15, "min": 0.8, "max": 1.5, "n": 2})
    assert summary["ttft_ratio"] == pytest.approx({"median": (1.5 + 1.6) / 2, "min": 1.5, "max": 1.6, "n": 2})
    spec, peer = summary["engines"]["specmoe"], summary["engines"]["peer"]
    assert spec["tok_s"] == pytest.approx({"median": 0.30, "min": 0.20, "max": 0.40, "n": 3})
    assert peer["tok_s"] == pytest.approx({"median": 0.225, "min": 0.20, "max": 0.25, "n": 2})  # the killed run is out
    assert (spec["ok"], spec["runs"], peer["ok"], peer["runs"], peer["oom_killed"]) == (3, 3, 2, 3, 1)
    assert spec["tokens_equal"] == "yes" and peer["tokens_equal"] == "no"


def test_pairs_alternate_which_engine_goes_first():
    assert fullscale_peer.schedule(3) == [("specmoe", "peer"), ("peer", "specmoe"), ("specmoe", "peer")]


def test_summary_pairs_runs_by_repeat_and_drops_failed_runs():
    _check_summary(fullscale_peer.summarize(_runs()))


def test_summary_check_catches_a_mean_in_place_of_the_median(monkeypatch):
    """The ratios of three pairs (1.5, 0.8, 0.6) have median 0.8 and mean 0.967: a summary that averaged would pass
    a check on two pairs only, so this one uses three."""
    runs = _runs()[:4] + [Run("specmoe", 2, True, 0, False, tok_s=0.12, ttft_s=10.0),
                          Run("peer", 2, False, 0, False, tok_s=0.20, ttft_s=10.0)]
    assert fullscale_peer.summarize(runs)["tok_s_ratio"]["median"] == pytest.approx(0.8)
    monkeypatch.setattr(fullscale_peer, "statistics", types.SimpleNamespace(median=statistics.mean))
    assert fullscale_peer.summarize(runs)["tok_s_ratio"]["median"] != pytest.approx(0.8)


def test_make_run_reads_specmoe_detail_and_the_peer_fields():
    capped = CappedResult(exit_code=0, wall_s=90.0, cgroup_peak_bytes=6_000_000_000, rss_peak_bytes=5_000_000_000,
                          oom_killed=False, limit_bytes=8_000_000_000)
    spec = fullscale_peer.make_run("specmoe", 0, True, capped, {"tokens": [1, 2, 3], "detail": {
        "tokens_per_s": 0.3, "prefill_s": 20.0, "hit_rate": 0.25, "mb_read_per_token": 868.0}}, [1, 2, 3, 4])
    peer = fullscale_peer.make_run("peer", 0, False, capped, {"tokens": [1, 2, 9], "tokens_per_s": 0.2, "prefill_s": 30.0,
                                                            "hit_rate": 0.2, "mb_read_per_token": 900.0}, [1, 2, 3, 4])
    failed = fullscale_peer.make_run("peer", 1, True, CappedResult(-9, 10.0, 8_000_000_000, 7_900_000_000, True, 0),
                                     None, [1, 2, 3])
    assert (spec.tok_s, spec.ttft_s, spec.hit_rate, spec.tokens_equal, spec.cgroup_peak_gb) == (0.3, 20.0, 0.25, "yes", 6.0)
    assert (peer.tok_s, peer.ttft_s, peer.tokens_equal, peer.rss_peak_gb, peer.mb_per_token) == (0.2, 30.0, "no", 5.0, 900.0)
    assert spec.mb_per_token == 868.0
    assert (failed.exit_code, failed.oom_killed, failed.tok_s, failed.tokens_equal) == (-9, True, 0.0, "n/a")
    assert fullscale_peer.tokens_equal([1, 2, 3, 4, 5], [1, 2, 3, 4]) == "n/a"  # longer than the reference
    assert fullscale_peer.tokens_equal([1], None) == "n/a"


def test_table_lists_every_run_then_the_ratio(tmp_path):
    runs = _runs()
    text = fullscale_peer.table(runs, fullscale_peer.summarize(runs))
    lines = text.splitlines()
    assert len([line for line in lines if not line.startswith("#")]) == 1 + len(runs)
    assert lines[3].split()[:4] == ["2", "peer", "yes", "0"] and lines[6].endswith("OOM-killed")
    assert "# specmoe/peer decode tok/s: median 1.15x [0.80-1.50] over 2 pairs" in text
    assert "# peer: tok/s 0.225 [0.200-0.250]" in text and "MB/token 450 [0-900]" in text and "2/3 runs ok; tokens equal to stock: no" in text
    killed = [Run("specmoe", 0, True, 0, False, tok_s=0.3, ttft_s=20.0), Run("peer", 0, False, -9, True)]
    text = fullscale_peer.table(killed, fullscale_peer.summarize(killed))
    assert "# peer: no successful run (1 runs, 1 OOM-killed)" in text and "# no complete pair: no ratio" in text


def test_reference_tokens_from_a_capped_run_file(tmp_path):
    out = tmp_path / "fullscale.txt"
    write_result(out, "capped_run", ["--model", "m"], 0.0, "1.00 1.00 1.00",
                 "run ...\n" + json.dumps({"tokens": {"stock resident": [5, 6, 7], "specmoe 100%": [5, 6, 7]}}))
    assert fullscale_peer.reference_tokens(out) == [5, 6, 7]
    for bad in (tmp_path / "missing.txt", out.with_name("bad.txt")):
        if bad.name == "bad.txt":
            bad.write_text("# header\n" + json.dumps({"tokens": {"stock resident": None}}) + "\n")
        with pytest.raises(ValueError, match=r"--reference .*stock resident"):
            fullscale_peer.reference_tokens(bad)
    assert fullscale_peer.reference_tokens(fullscale_peer.DEFAULT_REFERENCE)[:3] == [832, 1119, 185]


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats 0: expected at least 1"),
    (["--cap", "40%"], "--cap '40%': expected a size like 8GB"),
    (["-n", "1"], "-n 1: expected at least 2 tokens"),
    (["--expert-cache-gb", "0"], "--expert-cache-gb 0.0: expected a positive size"),
    (["--python", "/nonexistent/python"], "--python /nonexistent/python: expected an executable python"),
    (["--offload", "."], "--offload .: expected a repack output"),
])
def test_bad_compare_arguments_exit_2_in_one_line(tmp_path, capsys, args, message):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "offload_index.json").write_text("{}")
    base = {"--model": str(model), "--offload": str(tmp_path / "off"), "--python": sys.executable, "--reference": ""}
    base.update(dict(zip(args[::2], args[1::2])))
    code = fullscale_peer.main(["compare", *[x for kv in base.items() for x in kv]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: " + message) and err.count("\n") == 1


def test_the_runner_names_a_missing_mlx_vlm_or_repack(tmp_path, capsys):
    code = fullscale_peer.main(["run", "--offload", str(tmp_path), "--json", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert ("has no mlx-vlm" in err) or ("expected a repack output (offload_index.json)" in err)
    assert not (tmp_path / "o.json").exists()


def _peer_python_skip() -> str | None:
    if not Path(PEER_PYTHON).is_file():
        return f"no python with mlx-vlm at {PEER_PYTHON} (set SPECMOE_PEER_PYTHON)"
    probe = subprocess.run([PEER_PYTHON, "-c", "import mlx_vlm.moe_offload"], capture_output=True, text=True, check=False)
    if probe.returncode:
        return f"{PEER_PYTHON} cannot import mlx_vlm.moe_offload"
    return available()


@pytest.mark.long
def test_compare_under_a_cap_on_a_small_checkpoint(tmp_path):
    why = _peer_python_skip()
    if why:
        pytest.skip(why)
    from bench.fullscale_checkpoint import write_checkpoint
    from bench.fullscale_stock import stock_run

    model = Path(write_checkpoint(tmp_path / "ckpt", "qwen3-30b-a3b", small=True, layers=2)["out"])
    prompt = "The history of the city begins"
    stock = stock_run(str(model), prompt, 6)["tokens"]
    reference = tmp_path / "ref.txt"
    write_result(reference, "capped_run", [], 0.0, "0 0 0", json.dumps({"tokens": {"stock resident": stock}}))
    offload = tmp_path / "offload"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    subprocess.run([PEER_PYTHON, "-m", "bench.fullscale_peer", "repack", "--model", str(model), "--out", str(offload)],
                   check=True, capture_output=True, env=env)
    out = tmp_path / "peer.txt"
    assert fullscale_peer.main(["compare", "--model", str(model), "--offload", str(offload), "--python", PEER_PYTHON,
                                "--cap", "1GB", "--budget", "50%", "--expert-cache-gb", "0.0002", "--repeats", "2",
                                "-n", "6", "--prompt", prompt, "--reference", str(reference), "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# fullscale_peer: compare") and "load average before" in lines[0]
    summary = json.loads(lines[-1])
    assert [(r["engine"], r["first"]) for r in summary["runs"]] == [("specmoe", True), ("peer", False),
                                                                    ("peer", True), ("specmoe", False)]
    for r in summary["runs"]:
        assert r["exit_code"] == 0 and r["tokens_equal"] == "yes" and r["tok_s"] > 0
        assert 0 < r["cgroup_peak_gb"] <= 1.0 and r["hit_rate"] < 1.0 and r["mb_per_token"] > 0  # a small cache misses
    assert summary["n_pairs"] == 2 and summary["tok_s_ratio"]["min"] > 0
