"""Shared fixtures: tiny real-layout checkpoints built on the fly (never downloaded).

Expensive fixtures are session-scoped and built once (checkpoints, packed stores, a calibrated
projection); a test that damages what it gets asks for its own copy (`tiny_qwen`). `long_tier`
spreads a full matrix over the two tiers: the default run keeps the named cases, the long tier
(`pytest -m long`, also run by CI) the rest.
"""

from __future__ import annotations

import hashlib
import io
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from runtime.checkpoints.tiny import FAMILIES, make_tiny
from storage.packer import convert
from storage.reader import RangeReader

PROMPT = "The quick brown fox jumps over the lazy dog. Experts live on disk and the loader fetches them."
N_TOKENS = 16
TINY = dict(layers=3, n_experts=32, top_k=4)  # 25% of 32 experts (8 slots) is above the minimum (4)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny(root / fam, fam, seed=1, **TINY) for fam in FAMILIES}


@pytest.fixture(scope="session")
def stress_dirs(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoints plus the dense qwen3 drafter the stress harnesses pair with them (read only)."""
    drafter = make_tiny(tmp_path_factory.mktemp("stress") / "drafter", "qwen3", seed=9, layers=TINY["layers"])
    return {**tiny_dirs, "drafter": drafter}


@pytest.fixture(scope="session")
def packed_dirs(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packed")
    return {fam: convert(src, root / fam) for fam, src in tiny_dirs.items()}


# One family per structural kind, for per-family checks whose full matrix runs in the long tier: plain KV +
# switch_mlp; hybrid linear-attention state + shared expert; rotating KV + MXFP4 experts with biases; shared
# experts with grouped sigmoid routing.
REPRESENTATIVE_FAMILIES = ("qwen3_moe", "qwen3_next", "gpt_oss", "deepseek_v3")


def long_tier(values, keep) -> list:
    """Parameters for a full matrix: the values in `keep` run by default, the others in the long tier."""
    return [v if v in keep else pytest.param(v, marks=pytest.mark.long) for v in values]


@pytest.fixture(scope="session")
def calibrated(tiny_dirs, tmp_path_factory) -> dict:
    """`specmoe calibrate` run once: qwen3_moe target, a dense qwen3 drafter; the projection file, the
    drafter and the command's (exit code, stderr) for tests of its output."""
    root = tmp_path_factory.mktemp("calibrated")
    drafter = make_tiny(root / "d", "qwen3", seed=5, layers=TINY["layers"])
    projection = root / "proj.safetensors"
    code, _, err = run_cli(["calibrate", "-m", str(tiny_dirs["qwen3_moe"]), "--draft", str(drafter),
                            "--out", str(projection), "--tokens", "1024"])  # plenty for 64-wide layers
    return {"target": tiny_dirs["qwen3_moe"], "drafter": drafter, "projection": projection, "code": code, "err": err}


@pytest.fixture(scope="module")
def engine():
    """The embedded target through runtime.load, once per module (a module may define its own `engine`)."""
    from runtime import load
    from runtime.checkpoints import embedded_pair

    with load(embedded_pair().target) as e:
        yield e


@pytest.fixture()
def tiny_qwen(tmp_path) -> Path:
    """A fresh qwen3_moe checkpoint a test may damage."""
    return make_tiny(tmp_path / "ckpt", "qwen3_moe", seed=2, **TINY)


@pytest.fixture()
def store(packed_dirs):
    """The packed qwen3_moe store, opened for one test."""
    from storage import ExpertStore

    s = ExpertStore.open(packed_dirs["qwen3_moe"])
    yield s
    s.close()


def expert_views(store, layer: int) -> list:
    """Zeroed buffers for one expert of `layer`, one per layout tensor."""
    import numpy as np

    return [np.zeros(t.nbytes, np.uint8) for t in store.layout(layer).tensors]


def greedy_ids(model, prompt_ids: list[int], n: int = N_TOKENS) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """Run `specmoe ARGS` in-process; returns (exit code, stdout, stderr)."""
    from runtime.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


class GatedReader(RangeReader):
    """Holds every read until the test opens `gate`; records the offsets read, in order (loader and cache tests)."""

    def __init__(self):
        super().__init__("buffered")
        self.gate = threading.Event()
        self.order: list[int] = []
        self.lock = threading.Lock()

    def read(self, path, offset, buffers):
        self.gate.wait(5)
        with self.lock:
            self.order.append(offset)
        return super().read(path, offset, buffers)
