"""`specmoe generate --pipeline`: the generate flags turned into a PipelineRun on every rank.

Invariant: flags mean the same as without --pipeline, except --budget, which is per rank
(a share is of that rank's expert bytes), and the predictors, which are spmoe or none.
"""

from __future__ import annotations

import sys

from runtime.observe import err_console


def generate_pipeline(opts: dict) -> int:
    from runtime.pipeline import PipelineRun, StageConfig, parse_split, run_generate

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
    max_mb = opts["max_prefetch_mb"]
    run = PipelineRun(
        model=opts["model"], prompt=opts["prompt"], max_tokens=opts["max_tokens"], temp=opts["temp"], top_p=opts["top_p"],
        seed=opts["seed"], chat=opts["chat"], draft=opts["draft"], num_draft=num_draft or 4, predictor=predictor or "spmoe",
        cutoff=cutoff, projection=opts["projection"], forecast_k=opts["forecast_k"],
        max_prefetch_bytes=None if max_mb is None else int(max_mb * 1e6),
        stage=StageConfig(budget=opts["budget"], policy=policy or "lru", threads=opts["threads"], io_mode=opts["io_mode"],
                          verify_checksums=opts["verify"], split=tuple(split) if split else None,
                          routers=opts["draft"] is not None and (predictor or "spmoe") == "spmoe"),
        timeout_s=opts["pipeline_timeout"], fault=opts["pipeline_fault"], json_path=opts["json_path"])

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    return run_generate(run, write)
