"""runtime: running an mlx-lm MoE model whose routed experts live on disk.

The public API, in mlx-lm's shape (runtime/api.py; its statistics in runtime/run_stats.py):

    from runtime import load, stream_generate, generate, batch_generate

Sub-packages, one concept each (each __init__ lists what it exports):
    cache/        the expert cache: slots, policies, budget, the cache-backed SwitchGLU, memory governor,
                  trace replay and the per-layer slot split
    decode/       OffloadedModel, families, plain and speculative decoding, one-sync pass, drafter
    observe/      telemetry, routing traces and their analysis, the host-sync probe, --json/console writers
    tune/         cache sweeps, the tuner, tuning.json, drafter->target calibration, the profiling workload
    plan/         model costs, Mac profiles, the planner's projections, the pipeline's layer split
    serve/        the OpenAI/Anthropic-compatible HTTP server and chat sessions
    pipeline/     one model over several machines (stages over mx.distributed)
    doctor/       `specmoe doctor`: the machine, its measurements, the planner beside them
    macos/        settings the engine applies on macOS only (wired limit, command buffers, fast-synch)
    checkpoints/  tiny real-layout checkpoints, the embedded trained pair, weight fingerprints
    cli/          the `specmoe` command line, one module per command group

Imports point down the layers of docs/architecture.md (tests/test_architecture.py). It never
parses safetensors itself: byte ranges come from `storage`; forecasts come from `predictor`; the
dedup verify kernel from `metal`.
"""

_API = ("load", "generate", "stream_generate", "Engine", "GenerationResponse", "RunStats", "PhaseStats",
        "SpeculativeStats", "Totals", "DraftSettings")
_BATCH_API = ("batch_generate", "BatchResponse")  # runtime/batch_api.py
__all__ = list(_API) + list(_BATCH_API)


def __getattr__(name: str):
    # Lazy, so `import runtime.plan` (or `specmoe --help`) does not pay for MLX model imports.
    if name in _API:
        from runtime import api

        return getattr(api, name)
    if name in _BATCH_API:
        from runtime import batch_api

        return getattr(batch_api, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
