"""`mlx.launch -n N --backend ring -- specmoe generate ... --pipeline` on one machine (127.0.0.1).

Few and small on purpose (each launch starts N Python processes): greedy tokens equal stock
mlx-lm in one process; speculative greedy through 3 ranks equals plain greedy; per-rank memory is
that rank's weights plus its cache; failures end every rank with an error, never a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlx_lm import load as mlx_load

from runtime.checkpoints.tiny import make_tiny
from runtime.pipeline.local import local_launch_command
from tests.conftest import greedy_ids

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "runtime" / "data" / "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog."
pytestmark = pytest.mark.long  # process launches: the long tier (`pytest -m long`; CI runs it)


def launch(n: int, args: list[str], timeout: float = 300, shell: str | None = None):
    """Run the pipeline on n local ranks; returns (stdout, stderr, seconds)."""
    cli = [sys.executable, "-m", "runtime.cli.app", "generate", *args]
    cmd = local_launch_command(n, ["bash", "-c", shell.format(cli=" ".join(cli))] if shell else cli)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    return r.stdout, r.stderr, time.perf_counter() - t0


def _stock(path: Path, n: int) -> list[int]:
    model, tok = mlx_load(str(path))
    return greedy_ids(model, list(tok.encode(PROMPT)), n)


def _run(tmp_path, n, extra, name):
    out = tmp_path / f"{name}.json"
    stdout, stderr, _ = launch(n, ["-m", str(TINY / "target"), "-p", PROMPT, "--raw-prompt", "-n", "8", "--budget", "50%",
                                   "--pipeline", "--pipeline-timeout", "120", "--json", str(out), *extra])
    assert out.exists(), stderr
    return json.loads(out.read_text()), stderr


def test_two_ranks_greedy_equals_stock_and_each_rank_holds_its_share(tmp_path):
    result, stderr = _run(tmp_path, 2, [], "plain2")
    assert result["tokens"] == _stock(TINY / "target", 8)
    ranks = result["stats"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert "2 ranks: rank 0: layers 0-3, rank 1: layers 4-7" in stderr
    # Every non-expert weight on exactly one rank; each rank's MLX memory is its weights + its cache + a
    # little (KV, activations, logits): not the other rank's layers, not the stacked experts (2.1 MB).
    from storage import ExpertStore

    store = ExpertStore.open(TINY / "target")
    assert sum(r["resident_bytes"] for r in ranks) == store.resident_bytes
    for r in ranks:
        assert r["cache_bytes"] > 0 and r["counters"]["bytes_read"] > 0
        assert r["active_bytes"] < r["resident_bytes"] + r["cache_bytes"] + 1_000_000, r
    store.close()


def test_three_ranks_speculative_greedy_equals_plain_greedy(tmp_path):
    result, _ = _run(tmp_path, 3, ["--draft", str(TINY / "drafter"), "--num-draft", "3", "--predictor", "spmoe"], "spec3")
    assert result["tokens"] == _stock(TINY / "target", 8)  # = plain greedy (previous test: pipeline plain = stock)
    stats = result["stats"]
    assert stats["n_rounds"] > 0 and stats["n_drafted"] > 0
    for r in stats["ranks"]:
        assert r["timer"]["n_forecast_keys"] > 0  # every rank got forecasts for its own layers
        assert r["counters"]["prefetch_hits"] > 0  # ...and its loader's prefetches were used
        if r["rank"] > 0:  # rank 0 also holds the drafter, its caches and the forecaster's router bank
            assert r["active_bytes"] < r["resident_bytes"] + r["cache_bytes"] + 1_000_000, r  # its share, not the model
    # the three caches split the one-process budget by layers (50% of each rank's own experts)
    from runtime.decode import OffloadConfig, OffloadedModel

    om = OffloadedModel.load(TINY / "target", OffloadConfig(budget="50%", governor=None))
    assert sum(r["cache_bytes"] for r in stats["ranks"]) == om.plan.budget_bytes
    assert [r["layers"] for r in stats["ranks"]] == [[0, 1], [2, 4], [5, 7]]
    om.close()


def test_hybrid_speculative_rewinds_through_two_ranks(tmp_path):
    """qwen3_5_moe cannot trim its recurrent state: every rank restores its snapshot and re-runs."""
    target = make_tiny(tmp_path / "target", "qwen3_5_moe", seed=3, layers=2, n_experts=16, top_k=2)
    drafter = make_tiny(tmp_path / "drafter", "qwen3", seed=4, layers=2)
    out = tmp_path / "hybrid.json"
    _, stderr, _ = launch(2, ["-m", str(target), "-p", PROMPT, "--raw-prompt", "-n", "6", "--budget", "50%", "--pipeline",
                              "--draft", str(drafter), "--num-draft", "2", "--predictor", "none", "--json", str(out)])
    assert out.exists(), stderr
    result = json.loads(out.read_text())
    assert result["tokens"] == _stock(target, 6)
    assert sum(r["timer"]["n_reruns"] for r in result["stats"]["ranks"]) > 0


def test_more_ranks_than_layers_fails_on_every_rank(tmp_path):
    model = make_tiny(tmp_path / "m", "qwen3_moe", seed=1, layers=2, n_experts=16, top_k=2)
    _, stderr, secs = launch(3, ["-m", str(model), "-p", "hi", "-n", "2", "--pipeline", "--pipeline-timeout", "60"])
    for rank in range(3):
        assert f"specmoe (rank {rank}): error: " in stderr and "3 pipeline ranks but the model has 2 decoder layers" in stderr


def test_stores_that_differ_fail_on_every_rank(tmp_path):
    make_tiny(tmp_path / "m0", "qwen3_moe", seed=1, layers=2, n_experts=16, top_k=2)
    make_tiny(tmp_path / "m1", "qwen3_moe", seed=2, layers=2, n_experts=16, top_k=2)
    args = ["-m", str(tmp_path) + "/m$MLX_RANK", "-p", "hi", "-n", "2", "--pipeline", "--pipeline-timeout", "60"]
    _, stderr, _ = launch(2, [], shell="exec {cli} " + " ".join(args))
    for rank in range(2):
        assert f"specmoe (rank {rank}): error: the ranks' stores differ from rank 0's" in stderr
    assert "rank 1: " in stderr


@pytest.mark.parametrize("fault,expect", [
    ("die", "rank 1"),  # a crash: connection lost (or mlx.launch stops the others)
    ("hang", "no message from rank 1 within 5s"),  # alive but silent: the receive times out
])
def test_a_rank_that_dies_or_hangs_stops_every_rank(tmp_path, fault, expect):
    model = make_tiny(tmp_path / "m", "qwen3_moe", seed=1, layers=2, n_experts=16, top_k=2)
    stdout, stderr, secs = launch(2, ["-m", str(model), "-p", PROMPT, "-n", "6", "--pipeline", "--pipeline-timeout", "5",
                                      "--pipeline-fault", f"{fault}:1:3"], timeout=240)
    assert "specmoe (rank 0): error: " in stderr, stderr
    # The ranks share stderr: another rank's output may precede rank 0's message on its line.
    line = next(l[l.index("specmoe (rank 0): error: "):] for l in stderr.splitlines() if "specmoe (rank 0): error: " in l)
    if fault == "die" and "stopped by mlx.launch" in line:
        # mlx.launch saw rank 1 exit before rank 0 noticed the lost connection: rank 0 says so and points to it.
        assert "because another rank exited" in line and "see that rank's error" in line
    else:
        assert expect in line
    if fault == "hang":
        assert "specmoe (rank 1): error: stopped by mlx.launch" in stderr
