"""One CLI: `--version` wherever `-h` works, every error in the one-line format (click's usage errors
too), a missing path-like `-m` named as such (never a hub lookup), and tables that fit 80 columns."""

from __future__ import annotations

import huggingface_hub
import pytest

from runtime.checkpoints import resolve_model
from runtime.cli.app import command
from tests.conftest import run_cli
from tests.test_cli_consistency import COMMANDS

ERROR = "specmoe: error: "


def _one_error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR), err
    assert "Traceback" not in err and "Usage:" not in err
    return lines[0]


@pytest.mark.parametrize("path", [()] + sorted({p[:i] for p, _ in COMMANDS for i in range(1, len(p) + 1)}),
                         ids=lambda p: " ".join(p) or "specmoe")
def test_version_works_wherever_help_does(path):
    code, out, _ = run_cli([*path, "-h"])
    assert code == 0 and "--version" in out, out
    code, out, err = run_cli([*path, "--version"])
    assert code == 0 and out.startswith("specmoe ") and len(out.splitlines()) == 1, (path, out, err)


@pytest.mark.parametrize("args, needles", [
    (["generate", "-m", ".", "-p", "hi", "-n", "0"], ["'--max-tokens'", "greater than or equal to 1", "generate -h"]),
    (["serve", "-m", ".", "--port", "70000"], ["'--port'", "less than or equal to 65535"]),
    (["tune", "-m", ".", "--draft", ".", "--prompts", "p", "--measure-tokens", "0"], ["'--measure-tokens'", "1", "tune -h"]),
    (["generate", "-m", ".", "-p", "hi", "--top-p", "abc"], ["'--top-p'", "valid number"]),
    (["generate", "-p", "hi"], ["Missing option '--model'"]),
    (["generate", "--no-such-flag"], ["--no-such-flag"]),
    (["no-such-command"], ["no-such-command", "specmoe -h"]),
    (["sweep", "cutoff", "--repeats", "0"], ["'--repeats'", "sweep cutoff -h"]),
    (["plan", "-m", "qwen3.5-35b-a3b", "--mac", "m99-1gb"], ["m99"]),
    (["plan", "-m", "qwen3.5-35b-a3b", "--mac", "m4-16gb", "--context", "-5"], ["--context"]),
    (["doctor", "--dir", "/no/such/dir"], ["--dir", "/no/such/dir"]),
])
def test_every_error_is_one_line_in_one_format(args, needles):
    line = _one_error_line(*run_cli(args)[::2])
    for needle in needles:
        assert needle in line, (needle, line)


def test_debug_shows_a_usage_error_as_raised():
    with pytest.raises(Exception, match="--max-tokens|max_tokens|greater"):
        run_cli(["--debug", "generate", "-m", ".", "-p", "hi", "-n", "0"])


@pytest.fixture()
def no_hub(monkeypatch, tmp_path):
    """The hub must never be consulted; the working directory is an empty tmp dir."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("hub consulted"))


@pytest.mark.parametrize("ref", ["./models/q3", "../models/q3", "/abs/models/q3", "~/models/q3", "models/q3/4bit",
                                 "q3", "models/config.json", "owner/model.safetensors"])
def test_a_missing_path_is_named_not_looked_up_on_the_hub(no_hub, ref):
    line = _one_error_line(*run_cli(["generate", "-m", ref, "-p", "hi"])[::2])
    assert "no such model directory" in line and f"--model {ref}" in line, line
    code, _, err = run_cli(["generate", "-m", "/", "-p", "hi", "--draft", ref])
    assert "no such model directory" in _one_error_line(code, err) and "--draft" in err


def test_an_existing_relative_directory_wins(no_hub, tmp_path):
    (tmp_path / "models" / "q3").mkdir(parents=True)
    assert resolve_model("models/q3").resolve() == tmp_path / "models" / "q3"
    assert resolve_model("./models/q3").resolve() == tmp_path / "models" / "q3"


def test_owner_name_missing_locally_and_offline_names_both_readings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _one_error_line(*run_cli(["generate", "-m", "models/q3", "-p", "hi"])[::2])
    assert "no such model directory ./models/q3" in line and "Hugging Face" in line and "HF_HUB_OFFLINE" in line


def test_owner_name_missing_everywhere_online_names_both_readings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("runtime.checkpoints.hub.hub_offline", lambda: False)

    def unreachable(repo, **kwargs):
        raise OSError("Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ValueError, match=r"could not download .* no such model directory \./models/q3"):
        resolve_model("models/q3")


def _width(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("args", [["plan", "-m", "qwen3.5-35b-a3b", "--mac", "m4-16gb"],
                                  ["plan", "-m", "qwen3.5-35b-a3b", "--mac", "m4-16gb", "--cost-model", "v1"],
                                  ["plan-pipeline", "-m", "qwen3.5-35b-a3b", "--mac", "m4-16gb", "--ranks", "1,2,3,4"]])
def test_plan_tables_fit_80_columns_with_nothing_cut(args, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(args)
    assert code == 0, err
    assert "…" not in out, out
    table = "\n".join(line for line in out.splitlines() if line[:1] in "┏┃┡│└")  # the prose lines may soft-wrap
    assert table and _width(out if args[0] == "plan" else table) <= 80, out
    if args[0] == "plan":
        for header in ("tok/s", "ms/token", "dense", "experts", "hidden", "base", "spec+pf"):
            assert header in out, header
        assert "spec = speculative" in out  # the legend for the abbreviations
    else:
        assert "3.9/5.2/5.2/5.2" in out  # a 4-rank list is whole


def test_plan_piped_without_columns_is_never_cut(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, _ = run_cli(["plan", "-m", "qwen3.5-35b-a3b", "--mac", "m4-16gb"])  # stdout is a StringIO here
    assert code == 0 and "…" not in out and _width(out) <= 80


def test_doctor_names_the_disk_not_a_model():
    from runtime.doctor import render_report

    report = {"doctor_version": 1, "quick": True, "elapsed_s": 1.0,
              "machine": {"ssd_model": None, "ssd_size_bytes": 2e11}, "mlx": {}, "selfcheck": {}, "host_sync": {"error": "skipped"}, "ssd": {"error": "skipped"}}
    text = render_report(report)
    disk = next(line for line in text.splitlines() if line.startswith("- disk:"))
    assert "model" not in disk and "name unknown" in disk and "200.0 GB" in disk
    report["machine"]["ssd_model"] = "APPLE SSD AP0512Z"
    assert "- disk: APPLE SSD AP0512Z, 200.0 GB" in render_report(report)


def test_the_command_tree_is_built_once():
    assert command() is command()


def test_demo_tables_fit_80_columns():
    import io

    from rich.console import Console

    from runtime.cli.demo import demo_tables

    row = {"tokens_per_s": 119.3, "tokens_per_s_min": 117.8, "tokens_per_s_max": 1120.8, "vs_plain": 12.09,
           "vs_plain_min": 1.7, "vs_plain_max": 12.69, "verdict": "within noise", "hit_rate": 0.854,
           "misses_per_token": 12.88, "mb_read_per_token": 10.115, "prefetch_mb_per_token": 10.077,
           "unique_per_layer_per_verify": 10.88, "pairs_per_layer_per_verify": 16.0, "acceptance": 0.56,
           "tokens_per_verify": 2.67}
    rows = [dict(row, variant=name) for name in ("plain", "spec, no prefetch", "spec + spmoe prefetch")]
    result = {"rows": rows, "repeats": 3, "identical_outputs": True, "cache_fraction": 0.39}
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=False)
    for part in demo_tables(result):
        console.print(part)
    out = buf.getvalue()
    assert _width(out) <= 80 and "…" not in out, out
    assert "within noise" in out and "spec+pf" in out and "10.9/16" in out
