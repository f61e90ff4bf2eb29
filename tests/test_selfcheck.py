"""`specmoe selfcheck`: the report, its PASS/FAIL/SKIPPED verdict and exit codes, coverage cases,
unsupported --bits reported as skipped, and bad shapes refused in one line."""

from __future__ import annotations

import json

import mlx.core as mx
import typer
from typer.testing import CliRunner

METAL = mx.metal.is_available()


def test_selfcheck_command_prints_a_report(tmp_path):
    from runtime.cli.selfcheck import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `selfcheck` a named subcommand
    out = tmp_path / "report.json"
    res = CliRunner().invoke(app, ["selfcheck", "--window", "3", "--experts-per-tok", "4", "--d-model", "128", "--hidden", "64",
                                   "--slots", "8", "--trials", "1", "--json", str(out), "--no-coverage"])
    # Without Metal the kernel is skipped: SKIPPED with its own exit code, never PASS.
    assert res.exit_code == (0 if METAL else 3), res.output
    for needle in ("device", "reference vs stock", "kernel vs reference", "timings", "PASS" if METAL else "SKIPPED"):
        assert needle in res.output
    assert METAL or "PASS" not in res.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["n_pairs"] == 12 and report["timings_ms"]["stock"] > 0
    assert report["metal_available"] == METAL and report["overall"] == ("PASS" if METAL else "SKIPPED")


def test_selfcheck_coverage_cases_and_unsupported_bits(monkeypatch):
    from metal.selfcheck import SelfCheckConfig, coverage_configs, overall_result, run_coverage, run_selfcheck

    config = SelfCheckConfig(tokens=3, top_k=4, d_model=128, hidden=64, n_slots=8, trials=1, dtype="float32")
    cases = coverage_configs(config)
    reports = run_coverage(config)
    assert reports["groups over 8 rows"].max_group_rows > 8
    assert reports["window under 8 pairs"].n_pairs < 8
    assert cases["float16"].dtype == "float16"
    assert (cases["float32 x, bf16 scales"].dtype, cases["float32 x, bf16 scales"].scale_dtype) == ("float32", "bfloat16")
    assert all(r.reference_error <= r.reference_tolerance for r in reports.values())
    if not METAL:
        assert all(r.reference_error == 0 for r in reports.values())  # bit-exact on the CPU backend
        assert overall_result(reports.values()) == "SKIPPED"
    # A --bits the kernel cannot run is skipped with the reason, even where Metal exists (faked here:
    # the kernel must not even be launched, or it would fail and report an error).
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    r = run_selfcheck(SelfCheckConfig(tokens=3, top_k=4, d_model=128, hidden=64, n_slots=8, trials=1,
                                      dtype="float32", bits=3))
    assert r.kernel_status.startswith("skipped") and "3-bit" in r.kernel_status and r.status == "SKIPPED", r.kernel_status


def test_selfcheck_command_rejects_bad_shapes():
    from runtime.cli.selfcheck import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["selfcheck", "--d-model", "100"])
    assert res.exit_code != 0 and isinstance(res.exception, ValueError) and "d_model" in str(res.exception)
