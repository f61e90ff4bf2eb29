"""Host-sync latency: what one CPU<->GPU crossing costs in MLX on this machine, with MLX's default
fence and with MLX_METAL_FAST_SYNCH=1.

A crossing is priced by difference, so op dispatch is not counted: N tiny steps each followed by
`mx.eval` (N syncs), against the same N steps evaluated once (1 sync); the sync cost is the
difference over N - 1. The fast-synch figure needs the variable set before MLX creates its Metal
device, so it runs in a subprocess with the variable in its environment.

Invariants: medians of repeated rounds; the subprocess is bounded by a timeout and its failure is
reported, not raised. On the CPU backend the variable changes nothing (the report says so).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["host_sync_us", "host_sync_us_subprocess", "FAST_SYNCH_ENV"]

FAST_SYNCH_ENV = "MLX_METAL_FAST_SYNCH"


def host_sync_us(steps: int = 64, rounds: int = 31) -> dict:
    """Median microseconds per host sync (and the spread) measured in this process."""
    import mlx.core as mx

    x = mx.zeros((16,))
    mx.eval(x)

    def chain(sync_every_step: bool) -> float:
        y = x
        t0 = time.perf_counter()
        for _ in range(steps):
            y = y + 1.0
            if sync_every_step:
                mx.eval(y)
        mx.eval(y)
        return time.perf_counter() - t0

    chain(True), chain(False)  # warm up kernels and the allocator
    synced, once = [], []
    for _ in range(rounds):  # interleaved, so load from other jobs hits both sides alike
        synced.append(chain(True))
        once.append(chain(False))
    per_sync = (statistics.median(synced) - statistics.median(once)) / (steps - 1) * 1e6
    quartiles = statistics.quantiles(synced, n=4)
    return {"sync_us": round(max(0.0, per_sync), 2),
            "step_with_sync_us_iqr": [round(q / steps * 1e6, 2) for q in (quartiles[0], quartiles[2])],
            "rounds": rounds, "steps": steps, "env": {FAST_SYNCH_ENV: os.environ.get(FAST_SYNCH_ENV)}}


def host_sync_us_subprocess(env_updates: dict[str, str], steps: int = 64, rounds: int = 31,
                            timeout: float = 60.0) -> dict:
    """The same measurement in a fresh Python with `env_updates` applied before MLX starts."""
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the runtime package
    env = dict(os.environ, **env_updates)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = ("import json; from runtime.observe.sync_probe import host_sync_us; "
            f"print(json.dumps(host_sync_us({int(steps)}, {int(rounds)})))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return {"error": f"subprocess failed: {error!r}"}
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"subprocess exit {out.returncode}: {tail}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": "subprocess printed no measurement"}
