"""RunStats (runtime/run_stats.py) checked against the decoders' own records and the bytes read.

`phase_problems` is the check: the decode part agrees with the plain decoder's own decode-only
numbers (host syncs per token) and the prefill part with its prefill meter (bytes read); in every
phase, bytes read = (demand misses + prefetch reads) x bytes per expert. Each test also plants the
fault the check exists for and shows it is reported: prefill mixed into the decode numbers, and
prefetch reads left out of the counts.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import runtime.api as api
import runtime.run_stats as run_stats
from runtime import load, stream_generate
from runtime.checkpoints import embedded_pair

PROMPT = "Enter the king, with his lords."


def _run(draft=None, budget: str = "50%", n: int = 12):
    pair = embedded_pair()
    with load(pair.target, budget=budget, draft=pair.default_drafter if draft else None) as engine:
        responses = list(stream_generate(engine, PROMPT, max_tokens=n))
        plan, n_experts = engine.plan, engine.model.config["num_experts"]
    return responses, plan.expert_bytes_total // (len(plan.slots) * n_experts)


def phase_problems(responses, expert_bytes: int) -> list[str]:
    last = responses[-1]
    stats, detail, bad = last.stats, last.detail, []
    if stats.speculative is None:
        if stats.host_syncs_per_token != pytest.approx(detail.host_syncs_per_token):
            bad.append(f"host syncs/token {stats.host_syncs_per_token} vs the decoder's {detail.host_syncs_per_token}")
        if stats.prefill.bytes_read != detail.prefill.bytes_read:
            bad.append(f"prefill bytes {stats.prefill.bytes_read} vs the meter's {detail.prefill.bytes_read}")
    for name in ("prefill", "decode"):
        phase = getattr(stats, name)
        if phase.bytes_read != (phase.misses + phase.prefetch_reads) * expert_bytes:
            bad.append(f"{name}: {phase.bytes_read} bytes for {phase.misses} misses + {phase.prefetch_reads} prefetches")
    return bad


class _PrefillInDecode(run_stats.RunMeter):
    """The planted fault: decode numbers counted from the call's start, prefill included."""

    def stats(self, n_emitted, spec=None):
        s = super().stats(n_emitted, spec)
        mixed = run_stats.PhaseStats.between(self.c0, run_stats.Totals.of(self.om), n_emitted - 1,
                                             time.perf_counter() - self.t0)
        return dataclasses.replace(s, decode=mixed)


def test_plain_decode_numbers_leave_the_prefill_out(monkeypatch):
    responses, expert_bytes = _run()
    assert phase_problems(responses, expert_bytes) == []
    assert responses[-1].stats.prefill.misses > 0  # the prompt read experts: mixing them in would show
    monkeypatch.setattr(api, "RunMeter", _PrefillInDecode)
    broken, _ = _run()
    assert [t.token for t in broken] == [t.token for t in responses]
    assert any(p.startswith("host syncs/token") for p in phase_problems(broken, expert_bytes))


def test_speculative_phases_count_prefetch_reads(monkeypatch):
    responses, expert_bytes = _run(draft=True)
    stats = responses[-1].stats
    assert phase_problems(responses, expert_bytes) == []
    assert stats.decode.prefetch_reads > 0 and stats.prefetch_reads_per_token > 0  # the drafter's forecasts
    real = run_stats.Totals.of
    monkeypatch.setattr(run_stats.Totals, "of", classmethod(lambda cls, om: dataclasses.replace(real(om), prefetch_reads=0)))
    broken, _ = _run(draft=True)
    assert any(p.startswith("decode:") for p in phase_problems(broken, expert_bytes))
