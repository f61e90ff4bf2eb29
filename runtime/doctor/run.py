"""`run_doctor`: every doctor check in order, each timed, each allowed to fail or be skipped alone.

Checks: machine and MLX; selfcheck (PASS / FAIL / SKIPPED); host-sync latency with the default fence
and with fast-synch (a subprocess); cold SSD reads at queue depth 1 and 4; decoding on the embedded
pair at 100/50/25%, plain and speculative; the planner's projection beside the measurements. `quick`
shrinks every check (fewer tokens, smaller files, two budgets) for tests.

Invariants: the result is JSON-ready and has kind "specmoe-doctor"; a check that raises is recorded
with its error and the rest still run; a check that cannot run on this machine is listed in
"skipped" with the reason; `planner_inputs` holds exactly what `specmoe plan --from-doctor` reads.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from runtime.doctor.machine import machine_info, mlx_info

__all__ = ["run_doctor", "DOCTOR_VERSION"]

DOCTOR_VERSION = 1
_FAST_PAYS = 0.8  # fast-synch "pays" when its crossing costs under 80% of the default fence's


def _selfcheck(metal: bool) -> dict:
    from metal.selfcheck import SelfCheckConfig, run_selfcheck

    config = SelfCheckConfig(tokens=4, top_k=4, d_model=256, hidden=128, n_slots=16, trials=1,
                             dtype="bfloat16" if metal else "float32")
    report = run_selfcheck(config)
    status = getattr(report, "status", None)  # the truth helper's explicit status, when present
    if status is None:
        if report.kernel_status.startswith("skipped"):
            status = "SKIPPED" if report.reference_error <= report.reference_tolerance else "FAIL"
        else:
            status = "PASS" if report.passed else "FAIL"
    return {"status": str(status).upper(), "kernel": report.kernel_status,
            "reference_error": report.reference_error, "device": report.device}


def _timed(results: dict, name: str, check: Callable[[], object]) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = check()
    except Exception as error:  # noqa: BLE001 - one failing check must not hide the others
        results[name] = {"error": f"{type(error).__name__}: {error}"}
    results.setdefault("timings_s", {})[name] = round(time.perf_counter() - t0, 2)


def run_doctor(*, quick: bool = False, data_dir: Path | None = None, decode: bool = True,
               progress: Callable[[str], None] = lambda message: None) -> dict:
    """Run every check; see the module docstring. `data_dir` holds the SSD probe's temporary file."""
    from runtime.doctor.decode_probe import decode_rows
    from runtime.doctor.projection import machine_rates, project_rows
    from runtime.doctor.ssd_probe import cold_read_gbps
    from runtime.observe import FAST_SYNCH_ENV, host_sync_us_subprocess

    t0 = time.perf_counter()
    data_dir = Path(data_dir or tempfile.gettempdir())
    results: dict = {"kind": "specmoe-doctor", "doctor_version": DOCTOR_VERSION, "quick": quick,
                     "platform": sys.platform, "skipped": []}
    progress("machine")
    _timed(results, "machine", lambda: machine_info(data_dir).to_json())
    _timed(results, "mlx", mlx_info)
    metal = results["mlx"].get("backend") == "metal" if isinstance(results["mlx"], dict) else False
    progress("selfcheck")
    _timed(results, "selfcheck", lambda: _selfcheck(metal))
    if results["selfcheck"].get("status") == "SKIPPED":
        results["skipped"].append("selfcheck kernel: no Metal device (the pure-MLX reference was compared)")
    progress("host sync")
    rounds = 11 if quick else 31
    # Both in fresh processes: this one may already run with fast-synch (runtime/macos settings).
    _timed(results, "host_sync", lambda: {
        "default": host_sync_us_subprocess({FAST_SYNCH_ENV: "0"}, rounds=rounds),
        "fast_synch": host_sync_us_subprocess({FAST_SYNCH_ENV: "1"}, rounds=rounds)})
    sync = results["host_sync"]
    default_us = sync.get("default", {}).get("sync_us") if "error" not in sync else None
    fast_us = sync.get("fast_synch", {}).get("sync_us") if "error" not in sync else None
    if metal and default_us and fast_us is not None:
        sync["fast_synch_pays"] = fast_us < _FAST_PAYS * default_us
    else:
        sync["fast_synch_pays"] = None
        results["skipped"].append(f"{FAST_SYNCH_ENV}: no effect on the CPU backend (both figures are the same "
                                  "code path; their difference is noise)")
    progress("SSD")
    _timed(results, "ssd", lambda: cold_read_gbps(data_dir, file_bytes=(32 if quick else 256) << 20))
    rows: list[dict] = []
    if decode:
        progress("decode")
        budgets = ("100%", "25%") if quick else ("100%", "50%", "25%")
        _timed(results, "decode", lambda: decode_rows(max_tokens=12 if quick else 40, budgets=budgets))
        rows = results["decode"] if isinstance(results["decode"], list) else []
    else:
        results["skipped"].append("decode: turned off (--no-decode)")
    progress("projection")
    ram = (results["machine"] or {}).get("ram_bytes") or (16 << 30)
    _timed(results, "rates", lambda: machine_rates(quick))
    if rows and "error" not in results["rates"] and "error" not in results["ssd"]:
        _timed(results, "projection", lambda: project_rows(rows, results["rates"], results["ssd"],
                                                           default_us or 0.0, ram))
    else:
        results["skipped"].append("projection: needs the decode, SSD and rate measurements")
    results["planner_inputs"] = _planner_inputs(results, rows, default_us, fast_us)
    results["mac_settings"] = _mac_settings(results, metal)
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return results


def _mac_settings(results: dict, metal: bool) -> list[dict]:
    """What the engine would apply on this machine after this report (runtime/macos), with reasons."""
    from dataclasses import asdict

    from runtime.macos import parse_switches, plan_settings

    working_set = (results.get("machine") or {}).get("gpu_working_set_bytes")
    decisions = plan_settings(platform=sys.platform, metal=metal, working_set_bytes=working_set, doctor=results,
                              switches=parse_switches(None))
    return [asdict(d) for d in decisions]


def _planner_inputs(results: dict, rows: list[dict], default_us, fast_us) -> dict:
    """What `specmoe plan --from-doctor` takes: measured prices and counts (None when not measured)."""
    ok = [r for r in rows if "error" not in r]
    partial = [r for r in ok if r["budget"] != "100%"]
    spec = [r for r in partial if r["mode"] == "speculative"]
    plain = [r for r in partial if r["mode"] == "plain"]

    def median(values):
        values = sorted(values)
        return values[len(values) // 2] if values else None

    metal = isinstance(results.get("mlx"), dict) and results["mlx"].get("backend") == "metal"
    projection = results.get("projection") if isinstance(results.get("projection"), dict) else {}
    return {
        "backend": "metal" if metal else "cpu",
        "default_sync_us": default_us, "fast_synch_sync_us": fast_us if metal else None,
        "syncs_per_token": median(r["syncs_per_token"] for r in plain),
        # the per-layer share carries to a model of another depth: (syncs - 1 - repairs) / MoE layers
        "syncs_per_layer": median(round(max(0.0, (r["syncs_per_token"] - 1 - r["repairs_per_token"])
                                            / r["n_moe_layers"]), 3) for r in plain),
        "repairs_per_token": median(r["repairs_per_token"] for r in plain),
        "acceptance_rate": median(r["acceptance"] for r in spec),
        "forecast_recall": median(r["forecast_recall"] for r in spec),
        "implied_layer_us": projection.get("implied_layer_us"),
        "note": "measured on the embedded tiny pair; acceptance and recall are that pair's",
    }
