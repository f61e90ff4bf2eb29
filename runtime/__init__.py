"""runtime: running an mlx-lm MoE model whose routed experts live on disk.

The public API, in mlx-lm's shape (runtime/api.py):

    from runtime import load, stream_generate, generate

Sub-packages, one concept each (each __init__ lists what it exports):
    cache/        the expert cache: slots, policies, budget, the cache-backed SwitchGLU, memory governor
    decode/       OffloadedModel, families, plain and speculative decoding, one-sync pass, drafter
    observe/      telemetry, routing traces and their analysis, profile, --json/console writers
    tune/         cache replay and sweeps, the tuner, tuning.json, drafter->target calibration
    plan/         model costs, Mac profiles, the planner's projections
    checkpoints/  tiny real-layout checkpoints, the embedded trained pair, weight fingerprints
    cli/          the `specmoe` command line, one module per command group

It never parses safetensors itself: byte ranges come from `storage`; forecasts come from
`predictor`; the dedup verify kernel from `metal`.
"""

_API = ("load", "generate", "stream_generate", "Engine", "GenerationResponse", "RunStats", "DraftSettings")
__all__ = list(_API)


def __getattr__(name: str):
    # Lazy, so `import runtime.plan` (or `specmoe --help`) does not pay for MLX model imports.
    if name in _API:
        from runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
