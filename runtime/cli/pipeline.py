"""`specmoe generate --pipeline` and `specmoe serve --pipeline`: the flags turned into a PipelineRun on every rank.

Invariant: flags mean the same as without --pipeline, except --budget, which is per rank
(a share is of that rank's expert bytes), and the predictors, which are spmoe or none. Each
rank's window runs as one device pass (StageConfig's default; its synced path is for comparisons).
"""

from __future__ import annotations

import sys

from runtime.observe import err_console


def pipeline_run(opts: dict):
    """The PipelineRun of `generate`'s or `serve`'s flags (serve has no prompt, seed, chat, json or fault flags)."""
    from runtime.pipeline import PipelineRun, StageConfig, parse_split

    num_draft, predictor, cutoff, policy = opts["num_draft"], opts["predictor"], opts["cutoff"], opts["policy"]
    if num_draft is not None and num_draft < 1:
        raise ValueError(f"--num-draft {num_draft}; expected K >= 1")
    if opts["draft"] is not None:
        from runtime.tune import resolve_settings

        num_draft, predictor, cutoff, policy, note = resolve_settings(opts["model"], opts["draft"], opts["budget"], num_draft,
                                                                      predictor, cutoff, policy)
        if note:
            err_console.print(note, highlight=False)
    split = parse_split(opts["pipeline_split"])
    opts = {"prompt": "", "seed": 0, "chat": True, "temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "projection": None,
            "forecast_k": None, "pipeline_fault": None, "json_path": None, "verify": True, **opts}
    return PipelineRun(
        model=opts["model"], prompt=opts["prompt"], max_tokens=opts["max_tokens"], temp=opts["temp"], top_p=opts["top_p"],
        top_k=opts["top_k"], min_p=opts["min_p"], seed=opts["seed"], chat=opts["chat"], draft=opts["draft"],
        num_draft=num_draft or 4, predictor=predictor or "spmoe",
        cutoff=cutoff, projection=opts["projection"], forecast_k=opts["forecast_k"],
        stage=StageConfig(budget=opts["budget"], policy=policy or "lru", io_mode=opts["io_mode"],
                          verify_checksums=opts["verify"], split=tuple(split) if split else None,
                          routers=opts["draft"] is not None and (predictor or "spmoe") == "spmoe"),
        timeout_s=opts["pipeline_timeout"], fault=opts["pipeline_fault"], json_path=opts["json_path"])


def generate_pipeline(opts: dict) -> int:
    from runtime.pipeline import run_generate

    run = pipeline_run(opts)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    return run_generate(run, write)


def serve_pipeline(opts: dict, config) -> int:
    """Every rank: rank 0 serves `config` (a runtime.serve.ServeConfig), the others run their stage."""
    from runtime.pipeline import run_serve

    return run_serve(pipeline_run(opts), config, log=lambda line: err_console.print(line, highlight=False, markup=False))
