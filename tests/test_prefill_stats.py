"""Prefill you can see: the progress display and the prefill stats of `generate` and its --json."""

from __future__ import annotations

import io
import json

from runtime.observe import PrefillProgress
from tests.conftest import PROMPT, run_cli


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_silent_for_a_short_prefill_then_plain_lines_when_not_a_tty():
    clock, out = _Clock(), io.StringIO()
    p = PrefillProgress(1000, stream=out, tty=False, every_s=5.0, clock=clock)
    clock.t = 0.5
    p.update(0.6)
    assert out.getvalue() == ""  # under a second: nothing
    clock.t = 1.5
    p.update(0.7)
    clock.t = 2.0
    p.update(0.8)  # within every_s of the last line: no new line
    p.update(0.1)  # backwards: ignored
    clock.t = 7.0
    p.update(0.9)
    p.close()
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == ["prefill: 70% of 1000 tokens, 1.5 s", "prefill: 90% of 1000 tokens, 7.0 s",
                     "prefill: 1000 tokens in 7.0 s (143 tok/s)"]


def test_quick_prefill_prints_nothing():
    clock, out = _Clock(), io.StringIO()
    p = PrefillProgress(10, stream=out, tty=False, clock=clock)
    clock.t = 0.2
    p.update(1.0)
    p.close()
    assert out.getvalue() == ""


def test_generate_reports_prefill_tokens_per_s_bytes_and_reads_per_routed_expert(tiny_dirs, tmp_path):
    out = tmp_path / "run.json"
    code, _, err = run_cli(["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", (PROMPT + " ") * 4, "-b", "25%",
                            "-n", "3", "--raw-prompt", "--json", str(out)])
    assert code == 0, err
    stats = json.loads(out.read_text())["detail"]
    pre = stats["prefill"]
    assert pre["n_tokens"] == stats["n_prompt_tokens"] > 64
    assert pre["tokens_per_s"] > 0 and pre["seconds"] > 0
    assert pre["reads"] > 0 and pre["bytes_read"] == pre["reads"] * (pre["unique_bytes"] // pre["unique_experts"])
    # Expert-major prefill reads no expert twice within a call.
    assert 0 < pre["reads_per_unique_expert"] <= 1.0
    assert f"prefill {pre['n_tokens']} tok" in err and "per routed expert" in err


def test_api_stream_carries_the_prefill_bytes_and_stats(tiny_dirs):
    from runtime import load, stream_generate

    with load(tiny_dirs["qwen3_moe"], budget="25%") as engine:
        responses = list(stream_generate(engine, (PROMPT + " ") * 4, max_tokens=3))
    last = responses[-1]
    pre = last.detail.prefill
    assert last.stats.prefill.bytes_read == pre.bytes_read > 0
    assert pre.n_tokens == last.stats.prompt_tokens == last.stats.prefill.tokens and 0 < pre.reads_per_unique_expert <= 1.0


def test_progress_bar_on_a_terminal_ends_with_the_summary_line():
    clock, out = _Clock(), io.StringIO()
    p = PrefillProgress(100, stream=out, tty=True, clock=clock)
    clock.t = 2.0
    p.update(0.5)
    assert p.shown
    clock.t = 4.0
    p.close()
    assert out.getvalue().endswith("prefill: 100 tokens in 4.0 s (25 tok/s)\n")
