"""runtime.tune: choosing settings from measurements (cutoff layer, cache policy, projections).

Owns: `specmoe sweep cache` (over runtime.cache's trace replay: policies, Belady's MIN, miss
curves, the per-layer slot split, re-exported here) and `sweep cutoff`, the setting runner that
measures real runs on fresh caches, the tuner (a pure function of measurements), `tuning.json` and
how `generate` resolves settings from it, drafter->target projection fitting (`calibrate`), the
sweep plots, and the profiling workload (`run_workload`).

Invariants kept at this boundary: the tuner has no hidden state; every measured variant starts from
an empty cache; replaying a trace gives the counts the live cache gives.
"""

from runtime.cache import allocate_slots, belady, coarse_miss_curve, miss_curve, replay, split_by_miss_curves
from runtime.tune.cache_sweep import cache_sweep
from runtime.tune.calibrate import CalibrationReport, calibrate
from runtime.tune.forecast_replay import PrefetchReplayResult, replay_prefetch
from runtime.tune.frequency_oracle import future_frequency_misses
from runtime.tune.measure import SettingRunner, Workload
from runtime.tune.plots import plot_cache, plot_cutoff
from runtime.tune.profile_run import run_workload
from runtime.tune.run import run_tune
from runtime.tune.settings import resolve_settings
from runtime.tune.tuner import Setting, choose, cutoff_grid, load_tuning, median_measurement, refine, save_tuning

__all__ = [
    "split_by_miss_curves", "coarse_miss_curve", "PrefetchReplayResult", "replay_prefetch", "future_frequency_misses",
    "cache_sweep", "CalibrationReport", "calibrate", "SettingRunner", "Workload", "plot_cache", "plot_cutoff",
    "allocate_slots", "belady", "miss_curve", "replay", "run_tune", "resolve_settings", "run_workload",
    "Setting", "choose",
    "cutoff_grid", "load_tuning", "median_measurement", "refine", "save_tuning",
]
