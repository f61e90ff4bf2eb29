"""The tuner: choose speculative/prefetch settings from measurements. No hidden state.

- analytic_cutoff_bound(): SP-MoE's constraints narrow the cutoff grid before
  anything is measured: prefetching F experts for each of the first L layers must
  fit in the slots a layer can spare beside a verify window, and must finish within
  the drafting time at the measured per-expert load time over `threads` readers.
- choose(): the fastest measured setting only if it is faster outside the noise:
  each measurement carries a band (the min-max of its repeated passes, at least
  +-rel_noise around its median; a setting measured once gets at least the median
  half-width of the repeated ones in the same call, since one pass shows no spread
  of its own and the run's repeats say how wide the noise is); a setting whose band reaches the best one's
  median, or whose median lies in the best one's band, counts as a tie, and among ties the simplest wins (prefetch off, then the
  smallest cutoff, then the fewest draft tokens) — so a flat or noisy curve picks
  "off", and the reason says it was a tie.
- choose_paired(): the final say, on interleaved rounds (every finalist once per round, a fresh order): a
  finalist replaces the simplest one (the baseline) only if it was faster in every round (a sign test) and
  luck alone would give the finalists such a winner at most ALPHA of the time (runtime/tune/sign_test.py).
  Pass ranges of separately timed passes let a setting slower than the baseline win (measured:
  bench_tuned.py, 8 trials, found such a pick slower than three simpler settings; README, "specmoe tune").
- Tuning files: tuning.json next to the model/store holds entries keyed by model
  digest, drafter digest, budget and machine; lookups ignore foreign or stale
  entries and say why.
"""

from __future__ import annotations

import json
import math
import statistics
import os
import platform
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from runtime.cache import DEFAULT_POLICY
from runtime.tune.sign_test import ALPHA, chance_of_a_verdict

TUNING_FILE = "tuning.json"
TUNING_VERSION = 1


@dataclass(frozen=True)
class Setting:
    cutoff: int  # MoE layers prefetched for (0 = prefetch off)
    predictor: str  # forecaster name
    num_draft: int  # K
    policy: str  # cache eviction policy

    def simplicity(self) -> tuple:
        """Smaller is simpler: prefetch off first, then small cutoffs, short drafts, the default policy."""
        return (self.cutoff > 0, self.cutoff, self.num_draft, self.policy != DEFAULT_POLICY, self.predictor)


@dataclass(frozen=True)
class Measurement:
    setting: Setting
    tokens_per_s: float  # median over prompts
    misses_per_token: float  # demand misses per emitted token
    prefetch_used_mb: float  # MB of prefetched experts that a verify pass used
    prefetch_wasted_mb: float  # MB prefetched and never used (evicted or cancelled)
    recall: float  # forecast recall over the prefetched layers
    acceptance: float  # draft acceptance rate
    tokens_per_s_min: float | None = None  # lowest pass (median over prompts) when measured more than once
    tokens_per_s_max: float | None = None  # highest pass
    n_passes: int = 1

    def band(self, rel_noise: float) -> tuple[float, float]:
        """Where this setting's tok/s may lie: its passes' min-max, at least +-rel_noise of its median."""
        lo, hi = self.tokens_per_s * (1 - rel_noise), self.tokens_per_s * (1 + rel_noise)
        return min(lo, self.tokens_per_s_min or lo), max(hi, self.tokens_per_s_max or hi)


@dataclass(frozen=True)
class Choice:
    setting: Setting
    measurement: Measurement
    reason: str  # one line: why this one


def median_measurement(ms: list[Measurement]) -> Measurement:
    """Several passes of one setting -> one measurement (medians field by field)."""
    import statistics

    if not ms or len({m.setting for m in ms}) != 1:
        raise ValueError("median_measurement needs passes of exactly one setting")
    fields = ("tokens_per_s", "misses_per_token", "prefetch_used_mb", "prefetch_wasted_mb", "recall", "acceptance")
    tps = [m.tokens_per_s for m in ms]
    return Measurement(ms[0].setting, *(statistics.median(getattr(m, f) for m in ms) for f in fields),
                       tokens_per_s_min=min(tps), tokens_per_s_max=max(tps), n_passes=len(ms))


def pooled_noise(measurements: list[Measurement], rel_noise: float = 0.03) -> float:
    """The relative half-width a single pass is given: the median over the repeated measurements
    of (max - min) / 2 / median, at least rel_noise (rel_noise when nothing was repeated)."""
    widths = [(m.tokens_per_s_max - m.tokens_per_s_min) / 2 / m.tokens_per_s for m in measurements
              if m.n_passes > 1 and m.tokens_per_s > 0 and m.tokens_per_s_min is not None and m.tokens_per_s_max is not None]
    return max(rel_noise, statistics.median(widths)) if widths else rel_noise


def choose(measurements: list[Measurement], rel_noise: float = 0.03) -> Choice:
    if not measurements:
        raise ValueError("the tuner needs at least one measurement")
    single = pooled_noise(measurements, rel_noise)
    # Compare with every single pass widened to the run's noise; report the measurement as measured.
    banded = {id(m): (m if m.n_passes > 1 else _widened(m, single)) for m in measurements}
    band = lambda m: banded[id(m)].band(rel_noise)  # noqa: E731
    best = max(measurements, key=lambda m: m.tokens_per_s)
    best_lo = band(best)[0]
    # A tie within the noise: the other setting's band reaches the best's median, or the best's band its median.
    close = [m for m in measurements if band(m)[1] >= best.tokens_per_s or best_lo <= m.tokens_per_s]
    pick = min(close, key=lambda m: m.setting.simplicity())
    fmt = lambda m: f"{m.tokens_per_s:.2f} tok/s [{band(m)[0]:.2f}-{band(m)[1]:.2f}] over {m.n_passes} pass(es)"  # noqa: E731
    if pick is best and len(close) == 1:
        reason = f"fastest measured, outside the noise of every other setting ({fmt(best)})"
    elif pick is best:
        reason = f"fastest measured and the simplest of {len(close)} settings within its noise ({fmt(best)})"
    else:
        reason = (f"no winner outside the noise: the fastest ({best.setting}, {fmt(best)}) overlaps this simpler "
                  f"setting ({fmt(pick)}); keeping the simpler one")
    if single > rel_noise:
        reason += f"; a single pass counts as +-{single:.0%} (the median spread of this run's repeats)"
    if pick.setting.cutoff == 0:
        reason += "; prefetch does not pay here"
    return Choice(pick.setting, pick, reason)


def choose_paired(rounds: dict[Setting, list[float]], baseline: Setting, measured: dict[Setting, Measurement],
                  alpha: float = ALPHA) -> Choice:
    """The finalists' interleaved rounds (tok/s per round, every finalist once per round) -> the finalist faster than
    `baseline` in every round with the highest median ratio, if luck alone gives such a winner at most `alpha` of the
    time; else the baseline. `measured` holds each finalist's measurement (all its passes) for the report."""
    others = [s for s in rounds if s != baseline]
    if not others:
        return Choice(baseline, measured[baseline], "the only finalist")
    n = len(rounds[baseline])
    if n < 1 or any(len(v) != n for v in rounds.values()):
        raise ValueError("choose_paired needs the same number (>= 1) of rounds for every finalist")
    ratios = {s: [a / b for a, b in zip(rounds[s], rounds[baseline])] for s in others}
    chance = chance_of_a_verdict(len(others), n)
    always = [s for s in others if min(ratios[s]) > 1]
    how = (f"{n} interleaved rounds of {len(rounds)} finalists; {len(others)} compared with the simplest, a winner by "
           f"luck alone {chance:.1%} of the time")
    if always and chance <= alpha:
        best = max(always, key=lambda s: statistics.median(ratios[s]))
        r = ratios[best]
        reason = (f"faster than the simplest finalist in every round: {statistics.median(r):.2f}x "
                  f"[{min(r):.2f}-{max(r):.2f}] ({how})")
        pick = best
    else:
        lucky = f"; faster in every round but within chance: {', '.join(map(str, always))}" if always else ""
        reason = f"no finalist beat the simplest one in every round beyond chance ({how}){lucky}"
        pick = baseline
    if pick.cutoff == 0:
        reason += "; prefetch does not pay here"
    return Choice(pick, measured[pick], reason)


def _widened(m: Measurement, rel: float) -> Measurement:
    """A single pass with the run's pooled noise as its band."""
    return replace(m, tokens_per_s_min=min(m.tokens_per_s_min or m.tokens_per_s, m.tokens_per_s * (1 - rel)),
                   tokens_per_s_max=max(m.tokens_per_s_max or m.tokens_per_s, m.tokens_per_s * (1 + rel)))


def analytic_cutoff_bound(*, n_layers: int, forecast_per_layer: float, slots_per_layer: int, window_unique: float,
                          load_ms_per_expert: float, threads: int, draft_ms: float) -> int:
    """The largest cutoff L that SP-MoE's memory and time constraints allow (0..n_layers)."""
    if min(n_layers, threads) < 1 or forecast_per_layer < 0 or load_ms_per_expert < 0 or draft_ms < 0:
        raise ValueError("analytic_cutoff_bound: counts must be positive and times non-negative")
    if slots_per_layer - window_unique < min(1.0, forecast_per_layer):
        return 0  # no slot to spare beside the verify window: prefetch would evict what verify needs
    if forecast_per_layer == 0 or load_ms_per_expert == 0:
        return n_layers
    per_layer_ms = forecast_per_layer * load_ms_per_expert / threads
    return max(0, min(n_layers, math.floor(draft_ms / per_layer_ms)))


def cutoff_grid(upper: int, n_layers: int) -> list[int]:
    """Coarse cutoffs: 0, the bound, and about three points between."""
    upper = max(0, min(upper, n_layers))
    pts = {0, upper} | {round(upper * f) for f in (0.25, 0.5, 0.75)}
    return sorted(pts)


def refine(best: int, measured: set[int], n_layers: int) -> list[int]:
    """Neighbours of the best cutoff not measured yet."""
    step = max(1, n_layers // 8)
    return sorted({c for c in (best - step, best - 1, best + 1, best + step) if 0 <= c <= n_layers} - measured)


def machine_key() -> dict:
    import psutil

    try:
        import mlx.core as mx

        metal = bool(mx.metal.is_available())
    except Exception:  # an odd MLX build must not break tuning lookups
        metal = False
    return {"system": platform.system(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 1e9), "metal": metal}


def tuning_key(model_digest: str, drafter_digest: str, budget: str) -> dict:
    return {"model": model_digest, "drafter": drafter_digest, "budget": budget, "machine": machine_key()}


def save_tuning(model_dir: Path, key: dict, choice: Choice, measurements: list[Measurement]) -> Path:
    """Write (or replace) this key's entry."""
    path = Path(model_dir) / TUNING_FILE
    entries = []
    if path.exists():
        try:
            data = json.loads(path.read_text())
            entries = [e for e in data.get("entries", []) if e.get("key") != key]
        except (ValueError, AttributeError):
            entries = []  # a damaged file is replaced, not merged
    entries.append({"key": key, "setting": asdict(choice.setting), "reason": choice.reason,
                    "measured": [{**asdict(m.setting), **{k: v for k, v in asdict(m).items() if k != "setting"}}
                                 for m in measurements]})
    tmp = path.with_name(f".{TUNING_FILE}.tmp")
    tmp.write_text(json.dumps({"version": TUNING_VERSION, "entries": entries}, indent=1))
    tmp.replace(path)
    return path


def load_tuning(model_dir: Path, key: dict) -> tuple[Setting | None, str | None]:
    """(the tuned setting for exactly this key, or None; a note saying why not, if a file exists)."""
    path = Path(model_dir) / TUNING_FILE
    if not path.exists():
        return None, None
    try:
        data = json.loads(path.read_text())
        if data.get("version") != TUNING_VERSION:
            return None, f"{path}: tuning format {data.get('version')!r} ignored (expected {TUNING_VERSION})"
        entries = data["entries"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, f"{path}: not a valid tuning file; ignored"
    for e in entries:
        if e.get("key") == key:
            try:  # fields of settings no longer tuned (older files) are ignored
                return Setting(**{f.name: e["setting"][f.name] for f in fields(Setting)}), None
            except (TypeError, KeyError):
                return None, f"{path}: malformed entry ignored"
    stale = [e for e in entries if e.get("key", {}).get("model") != key["model"]]
    if stale and len(stale) == len(entries):
        return None, f"{path}: tuned for another version of this model (config changed); ignored — rerun specmoe tune"
    return None, f"{path}: no entry for this drafter, budget {key['budget']!r} and machine; using defaults"
