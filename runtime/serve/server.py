"""Starting `specmoe serve`: load the engine once, then run the Starlette app under uvicorn.

`bind` takes the port first -- before the engine loads -- so a busy port is one line and exit 2,
never an announcement followed by a failure; uvicorn then listens on that socket.

Invariants: binds 127.0.0.1 unless --host says otherwise; the engine is loaded before the port
listens (bound early, it refuses connections until then, so /health answering means the model is
ready); binding beyond loopback without an API key prints a warning; on shutdown the queue's worker
is stopped before the engine (and its loader threads and files) is closed.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runtime.serve.app import ServerState, build_app
from runtime.serve.backend import Backend
from runtime.serve.limits import RequestLimits
from runtime.serve.queue import GenerationQueue
from runtime.serve.security import AccessPolicy, is_loopback
from runtime.serve.validation import SamplingDefaults

__all__ = ["ServeConfig", "run_server", "serve_backend", "context_limit", "vocab_size", "bind", "exposure_warning"]


@dataclass(frozen=True)
class ServeConfig:
    model_ref: str  # as the user typed it: a path or a hub id (what /v1/models lists)
    model_path: Path  # the resolved local directory
    host: str = "127.0.0.1"
    port: int = 8080
    defaults: SamplingDefaults = SamplingDefaults()
    max_prompt_tokens: int | None = None  # None: the model's context length
    log_level: str = "warning"
    prompt_cache_size: int = 2  # conversations whose KV is kept (plain decoding)
    cors_origins: tuple[str, ...] = ()  # --cors-origin: browser origins allowed (default none)
    api_key: str | None = None  # --api-key / SPECMOE_API_KEY
    limits: RequestLimits = field(default_factory=RequestLimits)
    kv_bits: int | None = None  # --kv-bits (plain decoding)
    seed: int | None = None  # --seed: the PRNG seeded once at start-up
    max_batch: int = 1  # --max-batch: concurrent plain requests decoded together (1: one at a time)
    sock: object = None  # the socket `bind` took for host:port (None: serve_backend binds it)

    def __post_init__(self):
        self.policy()  # --cors-origin and --api-key are checked here, before the model loads

    def policy(self) -> AccessPolicy:
        return AccessPolicy(bind_host=self.host, port=self.port, cors_origins=self.cors_origins, api_key=self.api_key)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening; ValueError naming --host/--port if it cannot be."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror}); expected an address or a host name") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot bind {host}:{port} ({e.strerror}); is another server using it? "
                         "Pick another port with --port") from None
    sock.set_inheritable(True)
    return sock


def exposure_warning(config: ServeConfig) -> str | None:
    """The warning for a server reachable beyond this machine with no API key (None when there is none)."""
    if is_loopback(config.host) or config.api_key:
        return None
    return (f"WARNING: --host {config.host} exposes this server to the network with no API key: anyone who can "
            "reach the port can run the model and read its stats. Set --api-key (or SPECMOE_API_KEY), or bind "
            "127.0.0.1.")


def vocab_size(config: dict) -> int | None:
    """The vocabulary size from config.json (text_config for multimodal wrappers), None if absent."""
    cfg = config.get("text_config", config)
    value = cfg.get("vocab_size")
    return value if isinstance(value, int) and value > 0 else None


def context_limit(config: dict) -> int:
    """The model's context length from config.json (text_config for multimodal wrappers)."""
    cfg = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return cfg[key]
    return 32768


def run_server(engine, config: ServeConfig, log=print) -> None:
    if config.seed is not None:
        import mlx.core as mx

        mx.random.seed(config.seed)
    backend = Backend(engine, prompt_cache_size=config.prompt_cache_size,
                      kv_bits=config.kv_bits)
    serve_backend(backend, config, engine.model.config, log, close=engine.close)


def serve_backend(backend, config: ServeConfig, model_config: dict, log=print, close=None, note: str = "") -> None:
    """Serve `backend` (a Backend, or runtime.pipeline's PipelineBackend) until uvicorn stops; then
    the queue's worker, then `close` (the engine, or the pipeline's STOP to every rank)."""
    import uvicorn

    from runtime.serve.protocol import headers_within

    sock = config.sock if config.sock is not None else bind(config.host, config.port)
    limits = config.limits
    gen_queue = GenerationQueue(backend, max_queue=limits.max_queue, request_timeout_s=limits.request_timeout_s,
                                max_batch=config.max_batch)
    context = context_limit(model_config)
    limit = config.max_prompt_tokens or context
    aliases = frozenset({str(config.model_path), str(config.model_path.resolve()), config.model_path.name})
    policy = config.policy()
    state = ServerState(backend, gen_queue, config.model_ref, aliases, config.defaults, limit, context_tokens=context,
                        vocab_size=vocab_size(model_config), policy=policy, limits=limits)
    app = build_app(state)
    warning = exposure_warning(config)
    if warning:
        log(warning)
    access = ("API key required" if policy.api_key else "no API key") + (
        "; Host checked" if policy.checks_host else "") + (
        f"; CORS for {', '.join(policy.cors_origins)}" if policy.cors_origins else "; no CORS")
    running = (f"up to {gen_queue.max_batch} requests batched" if gen_queue.batching else "one request at a time")
    log(f"specmoe serve: {config.model_ref} on http://{config.host}:{config.port}/v1 "
        f"(OpenAI and Anthropic APIs; {running}; prompts up to {limit} tokens{note}; {access}; Ctrl-C stops)")
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level,
                                           access_log=config.log_level in ("info", "debug"),
                                           timeout_graceful_shutdown=3, limit_concurrency=limits.max_connections,
                                           timeout_keep_alive=5, http=headers_within(limits.header_timeout_s)))
    try:
        server.run(sockets=[sock])
    finally:
        gen_queue.close()
        if close is not None:
            close()
        sys.stderr.flush()
