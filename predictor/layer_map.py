"""Which drafter layer stands in for which target layer.

SP-MoE pairs drafter layer l with target layer l, which needs equal depths. For
a shallower drafter we map proportionally: target layer t of n_t goes to drafter
layer round(t * (n_d - 1) / (n_t - 1)), so first maps to first and last to last.
"""

from __future__ import annotations


def layer_map(n_target: int, n_drafter: int) -> dict[int, int]:
    if n_target < 1 or n_drafter < 1:
        raise ValueError(f"layer counts must be positive, got target={n_target}, drafter={n_drafter}")
    if n_target == n_drafter:
        return {t: t for t in range(n_target)}
    if n_target == 1:
        return {0: n_drafter - 1}
    return {t: round(t * (n_drafter - 1) / (n_target - 1)) for t in range(n_target)}
