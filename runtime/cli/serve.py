"""`specmoe serve`: an OpenAI-compatible HTTP server for one offloaded model (runtime/serve)."""

from __future__ import annotations

from pathlib import Path

import typer

from runtime.checkpoints import resolve_model
from runtime.cli import options as opt
from runtime.cli.engine_options import load_engine
from runtime.observe import err_console


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        model: str = opt.model_option(resolve=False),
        draft: Path = opt.draft_option(),
        budget: str = opt.budget_option(),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes the server to the "
                                                             "network (it has no authentication)."),
        port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on."),
        max_tokens: int = opt.max_tokens_option(help="max_tokens for requests that give none."),
        temp: float = opt.temp_option(),
        top_p: float = opt.top_p_option(),
        top_k: int = opt.top_k_option(),
        min_p: float = opt.min_p_option(),
        num_draft: int = opt.num_draft_option(),
        predictor: str = opt.predictor_option(),
        cutoff: int = opt.cutoff_option(),
        policy: str = opt.policy_option(),
        max_prompt_tokens: int = typer.Option(None, "--max-prompt-tokens", min=1,
                                              help="Refuse longer prompts with HTTP 400 (default: the model's "
                                                   "context length)."),
        prompt_cache_size: int = typer.Option(2, "--prompt-cache-size", min=1,
                                              help="Conversations whose KV cache is kept for reuse (plain "
                                                   "decoding; each holds its context's KV)."),
        one_sync: str = typer.Option("auto", "--one-sync", help="One-host-sync decode steps: auto, on or off."),
        route_ahead: str = opt.route_ahead_option(),
        io_mode: str = typer.Option("buffered", "--io-mode", help="buffered (page cache) or direct "
                                                                  "(O_DIRECT/F_NOCACHE)."),
        threads: int = opt.threads_option(),
        governor: bool = typer.Option(True, "--memory-governor/--no-memory-governor",
                                      help="Shrink the expert cache while available RAM is low; grow it back after."),
        allowed_origins: str = typer.Option("*", "--allowed-origins",
                                            help="Comma-separated origins browsers may call from (CORS), as "
                                                 "mlx_lm.server; * allows any."),
        log_level: str = typer.Option("warning", "--log-level",
                                      help="uvicorn log level: critical, error, warning, info (logs each request), "
                                           "debug."),
        pipeline: bool = opt.pipeline_option("serve"),
        pipeline_split: str = opt.pipeline_split_option(),
        pipeline_timeout: float = opt.pipeline_timeout_option(),
        adaptive_k: bool = opt.adaptive_k_option(),
    ):
        """Serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming)."""
        from runtime.serve import SamplingDefaults, ServeConfig, run_server

        if one_sync not in ("auto", "on", "off"):
            raise ValueError(f"--one-sync {one_sync!r}; expected auto, on or off")
        if log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"--log-level {log_level!r}; expected critical, error, warning, info or debug")
        path = resolve_model(model)
        defaults = SamplingDefaults(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
        config = ServeConfig(model_ref=model, model_path=path, host=host, port=port, defaults=defaults,
                             max_prompt_tokens=max_prompt_tokens, one_sync=one_sync, log_level=log_level,
                             prompt_cache_size=prompt_cache_size,
                             allowed_origins=tuple(o.strip() for o in allowed_origins.split(",") if o.strip()))
        if pipeline:
            from runtime.cli.pipeline import serve_pipeline

            return serve_pipeline({**locals(), "model": path, "verify": True, "max_prefetch_mb": None}, config)
        engine = load_engine(path, budget=budget, draft=draft, num_draft=num_draft, predictor=predictor,
                             cutoff=cutoff, policy=policy, io_mode=io_mode, threads=threads, governor=governor,
                             route_ahead=route_ahead)
        run_server(engine, config, log=lambda line: err_console.print(line, highlight=False, markup=False))
