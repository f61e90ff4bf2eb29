"""The drafter's pipelined rounds: a sampled token drawn on the device is the one the host's draw would take."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm import load

from runtime.checkpoints.tiny import make_tiny
from runtime.decode.drafter import draw, drawn_from
from runtime.decode.pairing import make_drafter
from runtime.decode.sampling import Sampling, sample
from tests.conftest import TINY


def test_the_device_draw_takes_the_token_the_host_sample_takes():
    """draw(q, u) inverts q's cumulative sum as sample() does (side 'right': a zero-probability token is never
    drawn, the first token at u = 0, the last at u -> 1); a draw off by one token fails."""
    # Exact in float32: a zero-probability token at or after a boundary is skipped, as searchsorted(side="right").
    for q, u, token in (([0, 0.5, 0, 0.5], 0.0, 1), ([0, 0.5, 0, 0.5], 0.5, 3), ([0.25] * 4, 1 - 1e-7, 3)):
        assert int(draw(mx.cumsum(mx.array(q, mx.float32)), u).item()) == token == sample(np.array(q), _Fixed(u))
    rng = np.random.default_rng(0)
    for V in (2, 7, 4096):
        for _ in range(40):
            q = rng.dirichlet(np.ones(V) * 0.2).astype(np.float32)
            q[rng.random(V) < 0.3] = 0.0  # filtered tokens (top-p, top-k, min-p)
            if not q.any():
                q[0] = 1.0
            q /= q.sum()
            c = np.cumsum(q, dtype=np.float64)
            for u in (0.0, rng.random(), rng.random(), 1.0 - 1e-9):
                if np.min(np.abs(c - u * c[-1])) < 1e-5:
                    continue  # within float32 rounding of a boundary: either neighbour is right
                cumulative = mx.cumsum(mx.array(q))
                got = int(draw(cumulative, u).item())
                assert got == sample(q.astype(np.float64), _Fixed(u)), (V, u)
                assert q[got] > 0
                used = drawn_from(np.array(cumulative))  # what acceptance is given: q itself, to float32 rounding
                np.testing.assert_allclose(used, q, atol=1e-6)
                assert (used[q == 0] == 0).all()


class _Fixed:
    """A generator whose next uniform is u (sample() draws one)."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def test_a_sampled_round_is_pipelined_and_draws_from_its_q_in_step_order(tmp_path):
    """Sampled proposals are pipelined like greedy ones (on_step sees the next step queued) and read back once;
    token i is q_i's draw at the generator's i-th uniform, so a seed still fixes the round."""
    dmodel, tokenizer = load(str(make_tiny(tmp_path / "d", "qwen3", seed=9, layers=TINY["layers"])))
    sampling = Sampling(temp=1.0)
    rounds = []
    for _ in range(2):
        drafter = make_drafter(dmodel, "spmoe")  # taps on: on_step sees them
        drafter.prefill(tokenizer.encode("Once upon a time the cache was small"))
        seen = []
        result = drafter.propose(4, sampling=sampling, rng=np.random.default_rng(7),
                                 on_step=lambda taps: seen.append((taps.n_ready, taps.n_tokens)))
        drafter.taps.remove()
        assert seen == [(1, 2), (2, 3), (3, 4), (4, 4)]
        assert result.q.shape[0] == 4 and np.allclose(result.q.sum(axis=-1), 1.0, atol=1e-4)
        replay = np.random.default_rng(7)
        assert result.tokens == [sample(q, replay) for q in result.q]
        rounds.append(result.tokens)
    assert rounds[0] == rounds[1]
