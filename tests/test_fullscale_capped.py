"""The capped-run harness (bench/capped_run.py) on a toy-width checkpoint: stock resident, specmoe at 100%
and specmoe at 50% under a real cgroup memory cap, each row judged against the compute + I/O limit."""

from __future__ import annotations

import json
import sys

import pytest

from tests.bench_scripts import BENCH

sys.path.insert(0, str(BENCH.parent))
from bench import capped_run  # noqa: E402
from bench.fullscale_cgroup import available  # noqa: E402
from bench.fullscale_checkpoint import write_checkpoint  # noqa: E402


def test_limits_are_compute_plus_reads_over_bandwidth():
    assert capped_run.decode_limit_s(2.0, 147.0, 2e9) == pytest.approx(2.0735)
    assert capped_run.ttft_limit_s(1.0, 2_700_000_000, 2e9) == pytest.approx(2.35)
    with pytest.raises(ValueError, match="--caps '40%'"):
        capped_run.parse_gb("40%")


def test_capped_run_rows_on_a_small_checkpoint(tmp_path, capsys):
    model = write_checkpoint(tmp_path / "ckpt", "qwen3-30b-a3b", small=True, layers=2)["out"]
    caps = "1GB" if available() is None else ""
    out = tmp_path / "fullscale.txt"
    assert capped_run.main(["--model", model, "--caps", caps, "--budgets", "50%", "-n", "5",
                            "--bandwidth-gbps", "2.0", "--io-compare", "buffered", "--io-repeats", "1",
                            "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# capped_run:") and "load average before" in lines[0]
    summary = json.loads(lines[-1])
    rows = {r["run"] + (f" @ {r['cap_gb']}" if r["cap_gb"] else ""): r for r in summary["rows"]}
    assert all(r["exit_code"] == 0 for r in rows.values())
    assert rows["specmoe 100%"]["tokens_equal"] == "yes" and rows["specmoe 100%"]["hit_rate"] == 1.0
    compute = summary["compute_s_per_token"]
    assert compute == pytest.approx(min(1 / rows["specmoe 100%"]["tok_s"], 1 / rows["stock resident"]["tok_s"]))
    if caps:
        capped = rows["specmoe 50% @ 1.0"]
        assert capped["tokens_equal"] == "yes" and capped["hit_rate"] < 1.0 and capped["mb_per_token"] > 0
        assert 0 < capped["cgroup_peak_gb"] <= 1.0 and capped["rss_peak_gb"] > 0 and not capped["oom_killed"]
        assert capped["limit_tok_s"] == pytest.approx(1 / (compute + capped["mb_per_token"] * 1e6 / 2e9))
        assert capped["ratio"] == pytest.approx(capped["tok_s"] / capped["limit_tok_s"])
        assert capped["ttft_limit_s"] > summary["prefill_compute_s"]  # the prompt's unique experts are read
        pair = [r for r in summary["rows"] if r["run"] in ("specmoe 50% direct", "specmoe 50% buffered")]
        assert sorted(r["run"] for r in pair) == ["specmoe 50% buffered", "specmoe 50% direct"]
        assert all(r["tokens_equal"] == "yes" and r["cap_gb"] == 1.0 for r in pair)
        assert any(n.startswith("io pairs (50%, interleaved): direct ") and "buffered/direct" in n for n in summary["notes"])
    assert "specmoe 100%" in capsys.readouterr().out


def test_paired_ratios_use_each_rounds_own_resident_compute():
    def row(tok_s):
        return capped_run.Row("specmoe 4GB", 8.0, 0, False, tok_s=tok_s, mb_per_token=200.0)

    # Round 1 ran twice as slow resident (a loaded machine) and capped: paired, its ratio stays near round 0's
    # (0.84 vs 0.88) where one global compute would put it at 0.44.
    rounds = [({"tokens_per_s": 0.5}, [(row(0.4), {"tokens": [1]})]),
              ({"tokens_per_s": 0.25}, [(row(0.2), {"tokens": [1]})]),
              (None, [(row(0.1), {"tokens": [1]})])]  # no resident run this round: not paired
    (note,) = capped_run.paired_notes(rounds, 1e9)
    limit0 = 1 / (2.0 + 0.2)
    assert note.startswith("paired by round (specmoe 4GB @ 8.0 GB, 2 rounds): 0.300 tok/s [0.200-0.400]")
    assert note.endswith(f"ratio to the limit 0.86 ({0.2 * 4.2:.2f}-{0.4 / limit0:.2f})")
    # A round whose resident run paged (the governor shrank its cache) measured no compute: left out, and said.
    paged = rounds + [({"tokens_per_s": 0.1, "hit_rate": 0.9}, [(row(0.4), {"tokens": [1]})])]
    note, left_out = capped_run.paired_notes(paged, 1e9)
    assert "2 rounds" in note and left_out == "paired by round: 1 round(s) left out, their resident run paged (hit rate below 100%)"


def test_capped_run_refuses_bad_input(tmp_path, capsys):
    assert capped_run.main(["--model", str(tmp_path), "--caps", "8GB"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert capped_run.main(["--model", str(tmp_path), "--caps", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--caps 'lots'" in err
    (tmp_path / "config.json").write_text("{}")
    assert capped_run.main(["--model", str(tmp_path), "--caps", "", "--repeats", "0"]) == 2
    assert "--repeats 0: expected >= 1" in capsys.readouterr().err


def test_the_resident_row_runs_without_the_memory_governor(tmp_path):
    """The uncapped 100% row measures compute: with the governor on, a checkpoint that nearly fills the machine pages
    (Qwen3.5's 21.7 GB on 24 GB did, at 74-81% hits) and the row measures reads. Capped rows keep the default."""
    resident = capped_run.specmoe_cmd(tmp_path, "p", 4, "100%", "direct", tmp_path / "a.json", resident=True)
    capped = capped_run.specmoe_cmd(tmp_path, "p", 4, "100%", "direct", tmp_path / "a.json")
    assert resident == capped + ["--no-memory-governor"]
