"""Running speculative generation from the CLI (and benches): drafter, predictor, oracle replay.

The oracle needs the routing of an identical earlier run: we make that run first
with prefetch off (it computes the same tokens; only reads differ) and replay it.
"""

from __future__ import annotations

from pathlib import Path

from predictor.oracle import RoutingRecorder
from runtime.decode.pairing import build_predictor, load_drafter, make_drafter
from runtime.decode.speculative import SpecConfig, SpeculativeDecoder


def run_speculative(om, draft_dir: Path, ids: list[int], *, max_tokens: int, num_draft: int, predictor: str,
                    cutoff: int | None, projection: Path | None = None, temp: float = 0.0, top_p: float = 1.0,
                    seed: int = 0, eos_ids=(), on_token=None, max_prefetch_bytes: int | None = None,
                    draft_model=None, draft_config=None, one_sync: str = "auto", forecast_k: int | None = None,
                    forecast_limit: int | None = None):
    """Returns (tokens, SpecStats, the MoE layers that were prefetched for)."""
    if draft_model is None:
        draft_model, draft_config = load_drafter(draft_dir, om)
    cfg = SpecConfig(num_draft=num_draft, cutoff=cutoff, temp=temp, top_p=top_p, seed=seed,
                     max_prefetch_bytes=max_prefetch_bytes, one_sync=one_sync)
    recording = None
    if predictor == "oracle":
        recorder = RoutingRecorder()
        rec_cfg = SpecConfig(num_draft=num_draft, cutoff=0, temp=temp, top_p=top_p, seed=seed)
        SpeculativeDecoder(om, make_drafter(draft_model, "none"), recorder, rec_cfg).generate(ids, max_tokens, eos_ids)
        recording = recorder.rounds
    pred = build_predictor(predictor, om, draft_model, draft_config, projection=projection, recording=recording,
                           limit=forecast_limit, forecast_k=forecast_k)
    drafter = make_drafter(draft_model, predictor if cutoff != 0 else "none")
    try:
        decoder = SpeculativeDecoder(om, drafter, pred, cfg)
        tokens = decoder.generate(ids, max_tokens, eos_ids, on_token)
    finally:
        if drafter.taps:
            drafter.taps.remove()
    return tokens, decoder.stats, decoder.prefetch_layers
