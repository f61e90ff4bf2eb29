"""Peak memory follows the budget, not the model's expert bytes."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.checkpoints.tiny import make_tiny
from tests.conftest import greedy_ids


@pytest.fixture(scope="module")
def expert_heavy(tmp_path_factory):
    # Experts are ~95% of the bytes, as in a 35B-A3B model.
    return make_tiny(tmp_path_factory.mktemp("heavy") / "m", "qwen3_moe", seed=4, layers=4, n_experts=64,
                     top_k=4, hidden=128, expert_hidden=128)


def _peak(path, budget: str | None) -> tuple[int, int]:
    mx.clear_cache()
    mx.reset_peak_memory()
    if budget is None:
        model, tok = load(str(path))
        greedy_ids(model, tok.encode("Experts live on disk."), 8)
        return mx.get_peak_memory(), 0
    om = OffloadedModel.load(path, OffloadConfig(budget=budget))
    try:
        greedy_ids(om.model, om.tokenizer.encode("Experts live on disk."), 8)
        return mx.get_peak_memory(), om.store.expert_bytes_total
    finally:
        om.close()


def test_peak_memory_grows_with_budget_not_expert_bytes(expert_heavy):
    stock, _ = _peak(expert_heavy, None)
    full, experts = _peak(expert_heavy, "100%")
    quarter, _ = _peak(expert_heavy, "25%")
    eighth, _ = _peak(expert_heavy, "12.5%")
    # Going from 100% to 25% saves about 75% of the expert bytes ...
    assert full - quarter > 0.6 * experts, (full, quarter, experts)
    # ... and halving the budget again saves about another 12.5%.
    assert quarter - eighth > 0.08 * experts, (quarter, eighth, experts)
    # The stock model holds every expert; at 25% we hold far less than that.
    assert quarter < stock - 0.6 * experts, (quarter, stock, experts)
