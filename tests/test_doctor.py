"""`specmoe doctor`: the quick run end to end, its pieces, and the Mac settings' switch logic."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from runtime.cli import doctor as doctor_cli
from runtime.cli.plan import build_plan, measured_from_doctor
from runtime.doctor.decode_probe import _syncs
from runtime.doctor.ssd_probe import cold_read_gbps
from runtime.macos import apply_settings, parse_switches, plan_settings
from runtime.macos.startup import apply_at_startup


@pytest.fixture()
def run_doctor_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_HOME", str(tmp_path / "home"))
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    doctor_cli.register(app)
    return lambda *args: CliRunner().invoke(app, ["doctor", *args])


def test_quick_doctor_reports_every_check_and_feeds_the_planner(run_doctor_cli, tmp_path):
    out = tmp_path / "doctor.json"
    result = run_doctor_cli("--quick", "--json", str(out), "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["kind"] == "specmoe-doctor" and report["elapsed_s"] < 120
    assert report["machine"]["ram_bytes"] > 0 and report["mlx"]["backend"] in ("cpu", "metal")
    metal = report["mlx"]["backend"] == "metal"
    assert report["selfcheck"]["status"] in (("PASS", "FAIL") if metal else ("SKIPPED",))
    sync = report["host_sync"]
    assert sync["default"]["env"]["MLX_METAL_FAST_SYNCH"] == "0" and sync["fast_synch"]["env"]["MLX_METAL_FAST_SYNCH"] == "1"
    assert sync["default"]["sync_us"] >= 0 and sync["fast_synch"]["sync_us"] >= 0
    ssd = report["ssd"]
    assert set(ssd["depths"]) == {"1", "4"} and all(d["gbps"] > 0 for d in ssd["depths"].values())
    if sys.platform.startswith("linux"):
        assert ssd["cache_bypass"] in ("O_DIRECT", "buffered (pages dropped)")
        assert any("MLX_METAL_FAST_SYNCH" in reason for reason in report["skipped"])
    rows = report["decode"]
    assert {(r["budget"], r["mode"]) for r in rows} == {(b, m) for b in ("100%", "25%") for m in ("plain", "speculative")}
    for row in rows:
        assert "error" not in row, row
        assert row["tokens_match_first_run"] and row["syncs_per_token"] >= 1 and row["tokens_per_s"] > 0
        # Against stock mlx-lm running the same target resident: the same tokens (lossless), a decode-speed ratio.
        assert row["tokens_match_stock"] and row["stock_tokens_per_s"] > 0
        assert row["vs_stock"] == pytest.approx(row["tokens_per_s"] / row["stock_tokens_per_s"], rel=0.01)
    assert all(0 <= r["acceptance"] <= 1 for r in rows if r["mode"] == "speculative")
    assert [p["kind"] for p in report["projection"]["rows"]] == ["projection"] * 4
    assert "Decoding on the embedded pair" in result.stdout and "selfcheck:" in result.stdout
    assert "| vs stock |" in result.stdout and "| tokens = stock |" in result.stdout
    assert (tmp_path / "home" / "doctor-last.json").exists()
    assert [s["name"] for s in report["mac_settings"]] == ["wired_limit", "command_buffers", "fast_synch"]
    # The report is what `specmoe plan --from-doctor` reads.
    measured = measured_from_doctor(out)
    assert measured["default_sync_us"] == sync["default"]["sync_us"]
    plan = build_plan(model_ref="qwen3-30b-a3b", mac_name="m4-16gb", measured=measured)
    assert plan["engine"]["sync_us"] == sync["default"]["sync_us"]
    assert list(tmp_path.glob("specmoe-doctor-*")) == []  # the SSD probe cleaned up


def test_decode_rows_report_tokens_that_differ_from_stock(monkeypatch):
    """The lossless column can fail: stock tokens that differ from the engine's are reported, not hidden."""
    from runtime.doctor import decode_probe
    from runtime.doctor.render import render_report

    real = decode_probe._Stock.run

    def last_token_changed(self):
        tps, tokens = real(self)
        return tps, tokens[:-1] + [tokens[-1] + 1]

    monkeypatch.setattr(decode_probe._Stock, "run", last_token_changed)
    rows = decode_probe.decode_rows(max_tokens=6, budgets=("100%",))
    assert [r["mode"] for r in rows] == ["plain", "speculative"]
    assert all(r["tokens_match_first_run"] and r["tokens_match_stock"] is False for r in rows)
    text = render_report({"doctor_version": 1, "quick": True, "elapsed_s": 0, "decode": rows})
    assert "| yes | NO |" in text


def test_a_stock_run_that_fails_leaves_the_engines_rows(monkeypatch):
    from runtime.doctor import decode_probe
    from runtime.doctor.render import render_report

    calls = []

    def fail(self):
        calls.append(1)
        if len(calls) > 1:  # the warm-up passes; the measured run fails
            raise RuntimeError("stock broke")
        return 1.0, []

    monkeypatch.setattr(decode_probe._Stock, "run", fail)
    rows = decode_probe.decode_rows(max_tokens=4, budgets=("100%",))
    assert all("error" not in r and r["tokens_per_s"] > 0 and r["stock_error"] == "RuntimeError: stock broke"
               and "vs_stock" not in r for r in rows)
    text = render_report({"doctor_version": 1, "quick": True, "elapsed_s": 0, "decode": rows})
    assert "stock mlx-lm could not run the target: RuntimeError: stock broke" in text


def test_doctor_bad_paths_are_refused_before_anything_runs(run_doctor_cli, tmp_path):
    result = run_doctor_cli("--json", str(tmp_path / "missing" / "d.json"))
    assert result.exit_code == 2 and "--json" in result.output
    result = run_doctor_cli("--dir", str(tmp_path / "nope"))
    assert result.exit_code == 2 and "--dir" in result.output


def test_syncs_derived_from_one_sync_counters_or_taken_as_counted():
    # 10 forwards over 8 MoE layers: 6 one-pass successes, 2 fallbacks, 2 not tried.
    syncs, repairs, how = _syncs(SimpleNamespace(), 8, forwards=10, tries=8, fallbacks=2, extra=0.0)
    assert (syncs, repairs, how) == (6 * 1 + 2 * 10 + 2 * 9, 2.0, "derived from one-sync counters")
    plain = SimpleNamespace(host_syncs_per_token=1.25, repairs_per_token=0.25)
    assert _syncs(plain, 8, 10, 8, 2, 0.0) == (12.5, 2.5, "counted")
    spec = SimpleNamespace(host_syncs=11, repairs=1)
    assert _syncs(spec, 8, 10, 8, 2, 6.0) == (17.0, 1.0, "counted (+1 per drafted token)")


def test_ssd_probe_reads_a_fresh_uncached_file_at_two_depths(tmp_path):
    result = cold_read_gbps(tmp_path, file_bytes=8 << 20, record_bytes=1 << 20)
    assert result["record_bytes"] % 4096 == 0 and set(result["depths"]) == {"1", "4"}
    assert result["hot_gbps"] > 0 and list(tmp_path.iterdir()) == []


def test_measured_from_doctor_refuses_other_json(tmp_path):
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"kind": "specmoe-plan"}))
    with pytest.raises(ValueError, match="--from-doctor"):
        measured_from_doctor(other)


# --- Mac settings -------------------------------------------------------------------------------

PAYS = {"host_sync": {"default": {"sync_us": 180.0}, "fast_synch": {"sync_us": 5.0}, "fast_synch_pays": True}}
NO_PAY = {"host_sync": {"default": {"sync_us": 180.0}, "fast_synch": {"sync_us": 170.0}, "fast_synch_pays": False}}


def _decide(doctor=None, switches="auto", environ=None, platform="darwin", metal=True):
    decisions = plan_settings(platform=platform, metal=metal, working_set_bytes=11_453_246_122, doctor=doctor,
                              switches=parse_switches(switches), environ={} if environ is None else environ)
    return {d.name: d for d in decisions}


def test_settings_apply_only_on_macos_with_metal():
    for platform, metal in (("linux", False), ("linux", True), ("darwin", False)):
        assert not any(d.apply for d in _decide(PAYS, platform=platform, metal=metal).values())
    environ, calls = {}, []
    decisions = list(_decide(PAYS).values())
    assert apply_settings(decisions, platform="linux", environ=environ, set_wired_limit=calls.append) == []
    assert environ == {} and calls == []


def test_fast_synch_follows_the_doctor_and_the_switches():
    assert _decide(PAYS)["fast_synch"].apply and "pays here" in _decide(PAYS)["fast_synch"].reason
    assert not _decide(NO_PAY)["fast_synch"].apply and "does not pay" in _decide(NO_PAY)["fast_synch"].reason
    assert not _decide(None)["fast_synch"].apply and "specmoe doctor" in _decide(None)["fast_synch"].reason
    assert _decide(NO_PAY, "fast_synch=on")["fast_synch"].apply
    assert not _decide(PAYS, "fast_synch=off")["fast_synch"].apply
    assert not any(d.apply for d in _decide(PAYS, "off").values())
    assert not _decide(PAYS, environ={"MLX_METAL_FAST_SYNCH": "0"})["fast_synch"].apply  # the user's choice wins


def test_apply_sets_env_and_wired_limit_on_macos_without_overriding_the_user():
    environ, calls = {"MLX_MAX_MB_PER_BUFFER": "64"}, []
    decisions = _decide(PAYS, environ=environ)
    assert not decisions["command_buffers"].apply  # one of its variables is the user's
    environ = {}
    done = apply_settings(list(_decide(PAYS, environ=environ).values()), platform="darwin", environ=environ,
                          set_wired_limit=calls.append)
    assert environ == {"MLX_MAX_OPS_PER_BUFFER": "200", "MLX_MAX_MB_PER_BUFFER": "200", "MLX_METAL_FAST_SYNCH": "1"}
    assert calls == [11_453_246_122] and "wired limit 11453246122" in done
    assert not _decide(PAYS, "wired_limit=off")["wired_limit"].apply


@pytest.mark.parametrize("text", ["bogus", "fast_synch=maybe", "speed=on"])
def test_bad_switches_are_refused(text):
    with pytest.raises(ValueError, match="--mac-settings"):
        parse_switches(text)


def test_startup_is_a_no_op_off_macos():
    decisions, applied = apply_at_startup("auto", platform="linux")
    assert applied == [] and not any(d.apply for d in decisions)


def test_cli_refuses_a_bad_mac_settings_switch(capsys):
    from runtime.cli.app import main

    assert main(["--mac-settings", "bogus", "plan", "--model", "qwen3-30b-a3b", "--mac", "m4-16gb"]) == 2
    assert "--mac-settings" in capsys.readouterr().err
