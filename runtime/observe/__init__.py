"""runtime.observe: what each token cost, reported rather than guessed from tokens/s.

Owns: `Telemetry` (per forward and MoE layer: tokens, unique experts, hits, misses, bytes, stalls),
routing traces (`RoutingTrace`, zstd on disk), routing analysis against baselines (overlap,
unique experts per window, independence and uniform references), closed-form routing maths, the
host-sync latency probe, the profile report and its plot, and the `--json` / console writers every command shares.

Invariants kept at this boundary: telemetry memory is bounded (a fixed number of rounds); observing
never changes what the model computes; a `--json` file is written whole or not at all.
"""

from runtime.observe.analysis import layer_report
from runtime.observe.profile import analyse, read_prompts, trace_of
from runtime.observe.profile_plot import plot_profile, pyplot
from runtime.observe.prefill_progress import PrefillProgress
from runtime.observe.progress import LineProgress, progress_bar
from runtime.observe.report import console, err_console, fail, write_json
from runtime.observe.routing_math import (
    expected_tokens_per_round,
    fit_power_law_exponent,
    power_law_hit_rate,
    uniform_unique_experts,
)
from runtime.observe.sync_probe import FAST_SYNCH_ENV, host_sync_us, host_sync_us_subprocess
from runtime.observe.telemetry import Telemetry, read_summary
from runtime.observe.trace import RoutingTrace

__all__ = [
    "layer_report", "PrefillProgress", "analyse", "read_prompts", "trace_of", "plot_profile", "pyplot",
    "LineProgress", "progress_bar", "console",
    "err_console", "fail", "write_json", "expected_tokens_per_round", "fit_power_law_exponent",
    "power_law_hit_rate", "uniform_unique_experts", "Telemetry", "RoutingTrace", "read_summary",
    "host_sync_us", "host_sync_us_subprocess", "FAST_SYNCH_ENV",
]
