"""runtime.decode: turning an offloaded model into tokens, plainly or speculatively.

Owns: `OffloadedModel` (an mlx-lm model whose routed experts are paged through `runtime.cache`),
the supported families, plain generation, the device pass (a forward whose expert lookups run on the
device: one host sync, repaired from the first layer that missed), the drafter and its hidden-state taps, drafter/target pairing, sampling and
acceptance rules, and `SpeculativeDecoder` (draft -> forecast -> prefetch -> verify -> accept ->
rewind).

Invariants kept at this boundary: greedy tokens equal the resident mlx-lm model's; sampled tokens
follow the target's distribution; KV and recurrent state after a rejected draft equal a run that
never saw it.
"""

from runtime.decode.batch import BatchDecoder, BatchStepStats, BatchTotals
from runtime.decode.drafter import DraftResult, Drafter, ModelDrafter
from runtime.decode.families import check_supported, text_config, top_k
from runtime.decode.moe_blocks import describe_expert_module, find_expert_modules, lazy_structure, match_expert_modules
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.device_pass import DevicePass, PassStats
from runtime.decode.offloaded_step import offloaded_generate_step
from runtime.decode.pairing import default_projection_path, load_drafter, make_drafter
from runtime.decode.predictor_default import default_predictor
from runtime.decode.prefill import PrefillMeter, PrefillStats
from runtime.decode.prompt_cache import PromptCache, common_prefix
from runtime.decode.plain import GenerationStats, encode_prompt, generate_tokens, holds_every_expert, stream_tokens
from runtime.decode.sampling import Sampling, accept_greedy, accept_sampled, probabilities, sample
from runtime.decode.draft_length import DraftLength
from runtime.decode.speculative import SpecConfig, SpecStats, SpeculativeDecoder
from runtime.decode.speculative_run import release_drafter, run_speculative, speculative_decoder
from runtime.decode.taps import HiddenTaps
from runtime.decode.layer_replay import LayerReplay
from runtime.decode.window_reads import WindowReads
from runtime.decode.window_routes import REPAIR_EXTRA as ROUTE_REPAIR_EXTRA, SYNC_COST as ROUTE_SYNC_COST

__all__ = [
    "BatchDecoder", "BatchStepStats", "BatchTotals",
    "common_prefix",
    "describe_expert_module", "find_expert_modules", "lazy_structure", "match_expert_modules",
    "DraftResult", "Drafter", "ModelDrafter", "check_supported", "text_config", "top_k", "OffloadConfig",
    "OffloadedModel", "DevicePass", "PassStats", "offloaded_generate_step", "default_projection_path", "load_drafter",
    "make_drafter", "PrefillMeter", "PrefillStats", "PromptCache", "GenerationStats", "encode_prompt", "generate_tokens", "holds_every_expert",
    "SpecConfig", "SpecStats", "SpeculativeDecoder", "run_speculative", "speculative_decoder", "release_drafter",
    "stream_tokens", "HiddenTaps", "Sampling", "accept_greedy", "accept_sampled", "probabilities", "sample", "DraftLength",
    "LayerReplay", "WindowReads", "default_predictor", "ROUTE_REPAIR_EXTRA", "ROUTE_SYNC_COST",
]
