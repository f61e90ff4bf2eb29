"""Decoding on the embedded pair (runtime.checkpoints.embedded_pair) at 100/50/25% budgets, plain and
speculative, with host syncs and repairs per token.

Runs go through the public API (`runtime.load` / `stream_generate`), greedy, same prompt, in a fixed
order; every run's tokens must equal the first run's (the lossless check doctor reports).

Host syncs and repairs: when the run's stats carry them (the hot-path measure: plain
`host_syncs_per_token` / `repairs_per_token`, speculative `host_syncs` / `repairs`), those are used
("counted"). Otherwise they are derived from the one-sync counters that exist
today ("derived"): a forward that succeeded as one pass costs 1 sync; one that fell back costs the
failed pass plus a per-layer forward (MoE layers + 2); one not tried costs MoE layers + 1; a fallback
is counted as a repair. Speculative rounds add one sync per drafted token.

Against stock mlx-lm: the embedded target also runs resident in stock mlx-lm (`mlx_lm.stream_generate`, the same
prompt, tokens and greedy sampling) once per budget, right after that budget's plain run: each row's `vs_stock` is
its decode tok/s over that stock run's (the hot-path measure, here one pair per budget: noisy, where
bench/bench_decode.py pairs 16 trials), and `tokens_match_stock` says whether it decoded stock's tokens (lossless).
Stock is warmed up once before the first run, so neither side starts cold.

Invariant: the doctor never raises out of a decode run; a failure is reported in the row.
"""

from __future__ import annotations

import time

__all__ = ["decode_rows", "PROMPT"]

PROMPT = "Enter the king, with his lords. The king speaks:"


def _syncs(detail, n_moe: int, forwards: int, tries: int, fallbacks: int, extra: float) -> tuple[float, float, str]:
    """(host syncs, repairs, how they were obtained) over `forwards` forwards (see the module docstring).

    Counted, when the stats carry them: plain runs report `host_syncs_per_token` and
    `repairs_per_token` (per decoded token = per forward), speculative runs `host_syncs` and `repairs`
    of their verify passes, to which `extra` (one sync per drafted token) is added."""
    per_token = getattr(detail, "host_syncs_per_token", None)
    if per_token is not None and getattr(detail, "repairs_per_token", None) is not None:
        return float(per_token) * forwards, float(detail.repairs_per_token) * forwards, "counted"
    host_syncs, repairs = getattr(detail, "host_syncs", None), getattr(detail, "repairs", None)
    if host_syncs is not None and repairs is not None:
        return float(host_syncs) + extra, float(repairs), "counted (+1 per drafted token)"
    ok = tries - fallbacks
    untried = max(0, forwards - tries)
    syncs = ok * 1 + fallbacks * (n_moe + 2) + untried * (n_moe + 1) + extra
    return float(syncs), float(fallbacks), "derived from one-sync counters"


def _run(target, drafter, budget: str, max_tokens: int, num_draft: int) -> dict:
    from runtime import load, stream_generate

    engine = load(str(target), budget=budget, draft=None if drafter is None else str(drafter),
                  num_draft=num_draft if drafter else None, predictor="spmoe" if drafter else None,
                  cutoff=None, memory_governor=False)
    try:
        n_moe = len(engine.model.modules)
        t0 = time.perf_counter()
        tokens, last = [], None
        for response in stream_generate(engine, PROMPT, max_tokens=max_tokens):
            tokens.append(response.token)
            last = response
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    stats, detail = last.stats, last.detail
    decoded = max(1, stats.generation_tokens - 1)
    row = {"tokens_per_s": round(stats.generation_tps, 2), "hit_rate": round(stats.hit_rate, 4),
           "misses": stats.misses, "wall_s": round(wall, 2), "tokens": tokens, "n_moe_layers": n_moe}
    if drafter is None:
        forwards = decoded
        syncs, repairs, how = _syncs(detail, n_moe, forwards, getattr(detail, "one_sync_tries", 0),
                                     getattr(detail, "one_sync_fallbacks", 0), 0.0)
        row.update(syncs_per_token=round(syncs / decoded, 2), repairs_per_token=round(repairs / decoded, 3))
    else:
        rounds = max(1, detail.n_rounds)
        syncs, repairs, how = _syncs(detail, n_moe, rounds, detail.one_sync_tries, detail.one_sync_fallbacks,
                                     float(detail.n_drafted))
        emitted = max(1, detail.n_tokens)
        row.update(syncs_per_token=round(syncs / emitted, 2), repairs_per_token=round(repairs / emitted, 3),
                   acceptance=round(detail.acceptance, 3), tokens_per_round=round(detail.tokens_per_verify, 2),
                   forecast_recall=round(detail.recall(), 3))
    row["sync_counts"] = how
    return row


class _Stock:
    """The embedded target resident in stock mlx-lm: decode tok/s and tokens of the doctor's prompt."""

    def __init__(self, target, max_tokens: int):
        from mlx_lm import load

        self.model, self.tokenizer = load(str(target))
        self.max_tokens = max_tokens
        self.run()  # warm-up: kernels built and caches touched before any measured run

    def run(self) -> tuple[float, list[int]]:
        from mlx_lm import stream_generate

        tokens, last = [], None
        for response in stream_generate(self.model, self.tokenizer, PROMPT, max_tokens=self.max_tokens):
            tokens.append(response.token)
            last = response
        return last.generation_tps, tokens


def decode_rows(max_tokens: int = 32, budgets: tuple[str, ...] = ("100%", "50%", "25%"),
                num_draft: int = 3) -> list[dict]:
    """One row per (budget, plain|speculative) on the embedded pair, each against stock mlx-lm (the module
    docstring); rows carry an "error" on failure."""
    from runtime.checkpoints import embedded_pair

    pair = embedded_pair()
    stock, stock_error = None, None
    try:
        stock = _Stock(pair.target, max_tokens)
    except Exception as error:  # noqa: BLE001 - the engine's rows are still worth having
        stock_error = f"{type(error).__name__}: {error}"
    rows, reference = [], None
    for budget in budgets:
        paired = None  # (stock tok/s, stock tokens) of this budget: run right after its first run that worked
        for mode, drafter in (("plain", None), ("speculative", pair.default_drafter)):
            try:
                row = _run(pair.target, drafter, budget, max_tokens, num_draft)
            except Exception as error:  # noqa: BLE001 - reported in the row, the doctor goes on
                rows.append({"budget": budget, "mode": mode, "error": f"{type(error).__name__}: {error}"})
                continue
            if stock is not None and paired is None:
                try:
                    paired = stock.run()
                except Exception as error:  # noqa: BLE001 - stock's failure, not the engine's
                    stock, stock_error = None, f"{type(error).__name__}: {error}"
            tokens = row.pop("tokens")
            reference = tokens if reference is None else reference
            row.update(budget=budget, mode=mode, tokens_match_first_run=tokens == reference)
            if paired is None:
                row["stock_error"] = stock_error
            else:
                row.update(stock_tokens_per_s=round(paired[0], 2), vs_stock=round(row["tokens_per_s"] / paired[0], 3),
                           tokens_match_stock=tokens == paired[1])
            rows.append(row)
    return rows
