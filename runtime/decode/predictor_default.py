"""The default predictor of a drafter/target pair: spmoe where it can run, else one that needs nothing.

spmoe feeds the drafter's hidden states to the target's routers, so a drafter of another width
(a 0.6B-class drafter, width 1024, beside a 30B-A3B target, width 2048) needs a projection fitted
for exactly this pair (`specmoe calibrate`). Fitting one when the pair is first loaded was measured
against falling back (bench/results/predictor_default.txt, 2026-12-06, load 5-9): the fit is a
teacher-forced target pass over at least 512 calibration tokens, and with the experts paged from disk
each 256-token chunk read 88% of the expert bytes of a checkpoint with Qwen3-30B-A3B's widths cut to
4 layers; that fit took 557 s here (a 48-layer model: 12x the reads and compute) before the first
token, and for a random drafter calibrate's check refused the result (held-out R^2 < 0). What a fit
buys shows only while the drafter is accepted. So without a projection file the default falls back
to `FALLBACK` and says so in one note; an explicit `--predictor spmoe` without a projection is still
refused (runtime/decode/pairing.py).

Invariant: the choice depends only on the widths, whether a projection file for the pair exists,
and whether the predictor was asked for; it never changes tokens, only which experts are read early.
"""

from __future__ import annotations

from pathlib import Path

from runtime.decode.families import text_config
from runtime.decode.pairing import default_projection_path

FALLBACK = "none"  # no forecast: the drafter still drafts, verify windows read each unique expert once


def default_predictor(name: str, explicit: bool, target_dir: Path, target_config: dict, draft_dir: Path,
                      draft_config: dict, projection: Path | None) -> tuple[str, str | None]:
    """(the predictor to run, a one-line note or None). `explicit`: the user named `name` (never replaced)."""
    if explicit or name != "spmoe" or projection is not None:
        return name, None
    t_width = text_config(target_config)["hidden_size"]
    d_width = text_config(draft_config)["hidden_size"]
    if t_width == d_width or default_projection_path(target_dir, draft_config).exists():
        return name, None
    return FALLBACK, (f"predictor {FALLBACK} (prefetch off): drafter width {d_width} differs from the target's {t_width} "
                      f"and no projection is fitted for this pair; `specmoe calibrate --model {target_dir} "
                      f"--draft {draft_dir}` fits one for the spmoe forecast")
