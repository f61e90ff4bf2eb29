"""Setting up speculative generation from the CLI, the API and benches: drafter, predictor, oracle replay.

The oracle needs the routing of an identical earlier run: we make that run first
with prefetch off (it computes the same tokens; only reads differ) and replay it.
Invariant: the measured run starts from an empty expert cache whatever the
predictor; the recording run's experts are evicted before it (else the oracle
would be measured warm, with fewer misses than any real run could have).
"""

from __future__ import annotations

from pathlib import Path

from predictor.oracle import RoutingRecorder
from runtime.decode.pairing import build_predictor, load_drafter, make_drafter
from runtime.decode.speculative import SpecConfig, SpeculativeDecoder


def speculative_decoder(om, draft_dir: Path, ids: list[int] | None, *, max_tokens: int, num_draft: int, predictor: str,
                        cutoff: int | None, projection: Path | None = None, temp: float = 0.0, top_p: float = 1.0,
                        top_k: int = 0, min_p: float = 0.0, seed: int = 0, eos_ids=(), draft_model=None,
                        draft_config=None, one_sync: str = "auto", forecast_limit: int | None = None,
                        adaptive_k: bool = True, warm: str | None = None, route: str = "auto") -> SpeculativeDecoder:
    """A SpeculativeDecoder for `om` and the drafter in `draft_dir` (or `draft_model`), ready to stream.

    `ids` and `max_tokens` are needed only by the oracle, which records the same run first.
    Call `release_decoder(decoder)` when done: it removes the drafter's taps."""
    if draft_model is None:
        draft_model, draft_config = load_drafter(draft_dir, om)
    cfg = SpecConfig(num_draft=num_draft, cutoff=cutoff, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                     one_sync=one_sync, adaptive_k=adaptive_k, warm=warm,
                     route=route)
    recording = None
    if predictor == "oracle":
        if ids is None:
            raise ValueError("--predictor oracle replays a recorded run; it needs the prompt up front")
        recorder = RoutingRecorder()
        rec_cfg = SpecConfig(num_draft=num_draft, cutoff=0, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                             adaptive_k=adaptive_k)
        SpeculativeDecoder(om, make_drafter(draft_model, "none"), recorder, rec_cfg).generate(ids, max_tokens, eos_ids)
        recording = recorder.rounds
        om.empty_cache()  # the measured run must start as cold as every other variant
    pred = build_predictor(predictor, om, draft_model, draft_config, projection=projection, recording=recording,
                           limit=forecast_limit)
    drafter = make_drafter(draft_model, predictor if cutoff != 0 else "none")
    try:
        return SpeculativeDecoder(om, drafter, pred, cfg)
    except BaseException:
        release_drafter(drafter)
        raise


def release_drafter(drafter) -> None:
    """Undo what make_drafter attached to the drafter model (its hidden-state taps)."""
    if drafter.taps:
        drafter.taps.remove()


def run_speculative(om, draft_dir: Path, ids: list[int], *, max_tokens: int, num_draft: int, predictor: str,
                    cutoff: int | None, eos_ids=(), on_token=None, **options):
    """Returns (tokens, SpecStats, the MoE layers that were prefetched for). `options`: speculative_decoder's."""
    decoder = speculative_decoder(om, draft_dir, ids, max_tokens=max_tokens, num_draft=num_draft, predictor=predictor,
                                  cutoff=cutoff, eos_ids=eos_ids, **options)
    try:
        tokens = decoder.generate(ids, max_tokens, eos_ids, on_token)
    finally:
        release_drafter(decoder.drafter)
    return tokens, decoder.stats, decoder.prefetch_layers
