"""Starting `specmoe serve`: load the engine once, then run the Starlette app under uvicorn.

Invariants: binds 127.0.0.1 unless --host says otherwise; the engine is loaded before the port
is opened (so /health answering means the model is ready); on shutdown the queue's worker is
stopped before the engine (and its loader threads and files) is closed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.serve.app import ServerState, build_app
from runtime.serve.backend import Backend
from runtime.serve.queue import GenerationQueue
from runtime.serve.validation import SamplingDefaults

__all__ = ["ServeConfig", "run_server", "serve_backend", "context_limit"]


@dataclass(frozen=True)
class ServeConfig:
    model_ref: str  # as the user typed it: a path or a hub id (what /v1/models lists)
    model_path: Path  # the resolved local directory
    host: str = "127.0.0.1"
    port: int = 8080
    defaults: SamplingDefaults = SamplingDefaults()
    max_prompt_tokens: int | None = None  # None: the model's context length
    one_sync: str = "auto"
    log_level: str = "warning"
    prompt_cache_size: int = 2  # conversations whose KV is kept (plain decoding)
    allowed_origins: tuple[str, ...] = ("*",)  # CORS origins (mlx_lm.server's default: all)


def context_limit(config: dict) -> int:
    """The model's context length from config.json (text_config for multimodal wrappers)."""
    cfg = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return cfg[key]
    return 32768


def run_server(engine, config: ServeConfig, log=print) -> None:
    backend = Backend(engine, one_sync=config.one_sync, prompt_cache_size=config.prompt_cache_size)
    serve_backend(backend, config, engine.model.config, log, close=engine.close)


def serve_backend(backend, config: ServeConfig, model_config: dict, log=print, close=None, note: str = "") -> None:
    """Serve `backend` (a Backend, or runtime.pipeline's PipelineBackend) until uvicorn stops; then
    the queue's worker, then `close` (the engine, or the pipeline's STOP to every rank)."""
    import uvicorn

    gen_queue = GenerationQueue(backend)
    limit = config.max_prompt_tokens or context_limit(model_config)
    aliases = frozenset({str(config.model_path), str(config.model_path.resolve()), config.model_path.name})
    state = ServerState(backend, gen_queue, config.model_ref, aliases, config.defaults, limit, config.allowed_origins)
    app = build_app(state)
    log(f"specmoe serve: {config.model_ref} on http://{config.host}:{config.port}/v1 "
        f"(OpenAI API; one request at a time; prompts up to {limit} tokens{note}; Ctrl-C stops)")
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           access_log=config.log_level in ("info", "debug"),
                                           timeout_graceful_shutdown=3))
    try:
        server.run()
    finally:
        gen_queue.close()
        if close is not None:
            close()
        sys.stderr.flush()
