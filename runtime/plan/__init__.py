"""runtime.plan: projections for Macs — will a MoE model fit, and how fast will it run.

Owns: model costs computed from a config.json (bytes per expert, resident bytes, KV growth), Mac
hardware profiles with their sources (`data/macs.json`), the planner's cost model, and how a pipeline
splits layers over ranks (`balanced_split`, `StageSplit`), which runtime.pipeline runs.

Invariants kept at this boundary: every figure the planner prints is a projection and is labelled
so; every constant it uses names its source.
"""

from runtime.plan.engine_costs import (
    DEFAULT_LAYER_US,
    MLX_DEFAULT_FENCE_US,
    MLX_FAST_SYNCH_US,
    EngineProfile,
    specmoe_engine,
)
from runtime.plan.mac_profiles import MacProfile, mac_profile, measured_profile
from runtime.plan.model_costs import QUANT_MODES, ModelCosts, config_quantization, model_costs
from runtime.plan.model_presets import load_model_config
from runtime.plan.pipeline_plan import link_profile, project_pipeline
from runtime.plan.stage_split import (
    StageSplit,
    balanced_split,
    check_ranks,
    explicit_split,
    layer_bytes,
    layer_of,
    parse_split,
)
from runtime.plan.prefill_cost import PREFILL_ASSUMPTIONS, PrefillTime, max_context_tokens, prefill_time
from runtime.plan.planner import (
    DEFAULT_SYNC_MS_PER_LAYER,
    CostConstants,
    ForwardTime,
    HitRates,
    SpecAssumptions,
    default_headroom_bytes,
    forward_time,
    hit_rate_prior_exponent,
    hit_rates,
    plan_memory,
    project,
    projection_json,
    required_hit_rate,
)

__all__ = [
    "MacProfile", "mac_profile", "measured_profile", "ModelCosts", "QUANT_MODES", "config_quantization",
    "load_model_config", "model_costs",
    "DEFAULT_SYNC_MS_PER_LAYER", "CostConstants", "ForwardTime", "HitRates", "SpecAssumptions", "forward_time",
    "DEFAULT_LAYER_US", "MLX_DEFAULT_FENCE_US", "MLX_FAST_SYNCH_US", "EngineProfile", "specmoe_engine",
    "PREFILL_ASSUMPTIONS", "link_profile", "project_pipeline", "default_headroom_bytes",
    "PrefillTime", "prefill_time", "max_context_tokens", "hit_rate_prior_exponent", "hit_rates", "plan_memory", "project", "projection_json", "required_hit_rate",
    "StageSplit", "balanced_split", "check_ranks", "explicit_split", "layer_bytes", "layer_of", "parse_split",
]
