"""`specmoe serve`: an OpenAI-compatible HTTP server for one offloaded model (runtime/serve).

The port is bound before the model loads: a busy port is one line and exit 2, before any announcement.
Access (--host, --cors-origin, --api-key) and bounds (--max-body-bytes, --body-timeout, --max-queue,
--max-connections, --request-timeout) are described in docs/serve.md, "Security".
"""

from __future__ import annotations

from pathlib import Path

import typer

from runtime.checkpoints import resolve_model
from runtime.serve import DEFAULT_MAX_BODY_BYTES
from runtime.cli import engine_options as eo
from runtime.cli import options as opt
from runtime.observe import err_console

API_KEY_ENV = "SPECMOE_API_KEY"


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        model: str = opt.model_option(resolve=False),
        draft: Path = opt.draft_option(),
        budget: str = opt.budget_option(),
        host: str = typer.Option("127.0.0.1", "--host",
                                 help="Address to bind. Loopback (the default) answers only to Host localhost, "
                                      "127.0.0.1 or [::1]; any other address exposes the server to the network: "
                                      "set --api-key."),
        port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on."),
        max_tokens: int = opt.max_tokens_option(help="max_tokens for requests that give none (every request is "
                                                     "also capped at the context its prompt leaves)."),
        temp: float = opt.temp_option(),
        top_p: float = opt.top_p_option(),
        top_k: int = opt.top_k_option(),
        min_p: float = opt.min_p_option(),
        seed: int = opt.seed_option(help="PRNG seed set once at start-up (a request's 'seed' reseeds for that request)."),
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
        io_mode: str = eo.io_mode_option(),
        governor: bool = eo.governor_option(),
        memory_limit: str = eo.memory_limit_option(),
        kv_bits: int = eo.kv_bits_option(),
        cors_origin: list[str] = typer.Option(None, "--cors-origin",
                                              help="A browser origin allowed to call the server, e.g. "
                                                   "http://localhost:3000 (repeatable; * allows any). Default: none; "
                                                   "requests carrying any other Origin get 403."),
        api_key: str = typer.Option(None, "--api-key", envvar=API_KEY_ENV,
                                    help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route "
                                         "but /health (also read from SPECMOE_API_KEY)."),
        max_body_bytes: int = typer.Option(DEFAULT_MAX_BODY_BYTES, "--max-body-bytes", min=1,
                                           help="Largest request body; larger ones get 413 before they are read."),
        body_timeout: float = typer.Option(30.0, "--body-timeout", min=0.001,
                                           help="Seconds a request body may take to arrive; slower ones get 408."),
        max_queue: int = typer.Option(16, "--max-queue", min=1,
                                      help="Requests waiting or running at once; more get 429 with Retry-After."),
        max_connections: int = typer.Option(64, "--max-connections", min=1,
                                            help="Open connections (uvicorn's limit_concurrency); requests beyond "
                                                 "get 503."),
        max_batch: int = typer.Option(4, "--max-batch", min=1,
                                      help="Concurrent requests decoded together, each step reading the union of "
                                           "their experts once (1: one at a time). Default 4: 2.15x the aggregate "
                                           "tokens/s of one at a time at a 25% budget, median latency 1.15x "
                                           "(bench/results/batch.txt, row 25% B=4). Plain decoding only: with "
                                           "--draft or --kv-bits requests run one at a time."),
        request_timeout: float = typer.Option(None, "--request-timeout", min=0.001,
                                              help="Seconds a generation may run; then it stops with finish_reason "
                                                   "'length' and the text so far (default: no limit)."),
        log_level: str = typer.Option("warning", "--log-level",
                                      help="uvicorn log level: critical, error, warning, info (logs each request), "
                                           "debug."),
        pipeline: bool = opt.pipeline_option("serve"),
        pipeline_split: str = opt.pipeline_split_option(),
        pipeline_timeout: float = opt.pipeline_timeout_option(),
    ):
        """Serve the model over OpenAI- and Anthropic-compatible HTTP APIs (chat, messages, tools, streaming)."""
        from runtime.serve import RequestLimits, SamplingDefaults, ServeConfig, bind, run_server

        eo.check_kv_bits(kv_bits, draft)
        if log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"--log-level {log_level!r}; expected critical, error, warning, info or debug")
        path = resolve_model(model)
        _check_kv_bits_serves(path, kv_bits, max_prompt_tokens)
        defaults = SamplingDefaults(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
        limits = RequestLimits(max_body_bytes=max_body_bytes, body_timeout_s=body_timeout, max_queue=max_queue,
                               request_timeout_s=request_timeout, max_connections=max_connections)
        settings = dict(model_ref=model, model_path=path, host=host, port=port, defaults=defaults,
                        max_prompt_tokens=max_prompt_tokens, log_level=log_level,
                        prompt_cache_size=prompt_cache_size, cors_origins=tuple(cors_origin or ()),
                        api_key=api_key or None, limits=limits, kv_bits=kv_bits, seed=seed,
                        max_batch=max_batch)
        if pipeline:
            from runtime.cli.pipeline import serve_pipeline

            config = ServeConfig(**settings)
            return serve_pipeline({**locals(), "model": path, "verify": True}, config)
        config = ServeConfig(**settings, sock=bind(host, port))  # before loading: a busy port fails in a second
        engine = eo.load_engine(path, budget=budget, draft=draft, num_draft=num_draft, predictor=predictor,
                                cutoff=cutoff, policy=policy, io_mode=io_mode, governor=governor,
                                memory_limit=memory_limit, kv_bits=kv_bits)
        run_server(engine, config, log=lambda line: err_console.print(line, highlight=False, markup=False))


def _check_kv_bits_serves(path, kv_bits: int | None, max_prompt_tokens: int | None) -> None:
    """--kv-bits on a model whose quantized KV cache would fail past mlx-lm's quantized_kv_start: refused before
    loading (a request that long would otherwise fail mid-reply), one line naming what to change."""
    import json

    from runtime.api import check_kv_bits_fits
    from runtime.serve import context_limit

    config_file = path / "config.json"
    if not kv_bits or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    try:
        check_kv_bits_fits(config, kv_bits, max_prompt_tokens or context_limit(config))
    except ValueError as e:
        raise ValueError(f"--kv-bits {kv_bits}: requests up to the context length would fail ({e}); drop --kv-bits "
                         "or set --max-prompt-tokens below the quantization start") from None

