"""Expert-major MoE calls: a call of many tokens reads each routed expert once.

A prefill chunk of N tokens routes to many more experts than a budgeted cache holds. Split
token by token, groups of tokens evict each other's experts and the same expert is read
again and again. Here the call is computed expert by expert instead:

1. the router's (N, k) choice is on the host (the module's one sync for the call);
2. the call's unique experts are ordered: resident ones first (nothing to read), then the
   absent ones;
3. they are taken in batches of at most `batch_cap` experts. A batch is ensured (each absent
   expert read once, the batch's slots pinned), its (token, expert) pairs are computed with
   the module's own SwitchGLU projections and handed to MLX with async_eval; while that runs,
   the next batch's reads proceed on the loader threads; the batch's output is then
   evaluated and its slots unpinned;
4. the pair outputs go back to (token, k) order with one gather.

Arithmetic: the pairs are stock SwitchGLU's. When a call has >= 64 (token, expert) pairs,
mlx-lm sorts them by expert id (a stable argsort), runs gather_qmm/gather_mm with
sorted_indices=True and unsorts with a gather. Each batch here is a set of whole runs of that
sorted order -- each expert's rows intact, in the same order -- through the same projections
with the same sorted_indices flag (False below 64 pairs, as stock); the rest are exact
gathers. On MLX's CPU backend every pair's product is independent of its neighbours, so the
output is bit-identical to the stock module (tests/test_expert_major.py checks it, for every
family and budget, against stock mlx-lm).

Invariants:
- every unique expert of a call is ensured exactly once: at most one read per expert per call;
- slots pinned by the call never exceed 2 * batch_cap <= usable slots (one batch computing,
  one loading); with fewer than 2 usable slots batches run one after the other;
- a batch's output is evaluated before its slots are unpinned, so the returned array reads no
  slab and the module has nothing pending afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

PREFILL_MIN_TOKENS = 64  # calls of at least this many tokens with an absent expert go expert-major (verify windows are far smaller)
SORT_MIN_PAIRS = 64  # mlx-lm's SwitchGLU sorts its (token, expert) pairs from this many on


@dataclass(frozen=True)
class ExpertBatch:
    experts: np.ndarray  # expert ids (ascending)
    rows: np.ndarray  # indices into the flattened (token, k) pairs, runs of the stock sorted order


def wants_expert_major(cache, layer: int, flat: np.ndarray, min_tokens: int = PREFILL_MIN_TOKENS) -> bool:
    """Should the call with expert ids `flat` (N, k) go expert-major? Yes when its unique experts
    exceed the usable slots (token groups would evict each other), or when it has at least
    `min_tokens` tokens and some expert to read (reads then overlap compute)."""
    unique = np.unique(flat)
    if len(unique) > cache.usable_slots(layer):
        return True
    return flat.shape[0] >= min_tokens and len(cache.absent(layer, unique)) > 0


def plan_batches(flat: np.ndarray, absent: np.ndarray, batch_cap: int) -> list[ExpertBatch]:
    """Batches of at most `batch_cap` experts, resident experts first, each holding its experts'
    runs of the stable sort of the flattened pairs by expert id. Within each group the least used
    come first, so the call ends with its most used experts loaded last: they stay resident for the
    next calls (the prompt's last token, the first decode steps), which most often route to them."""
    if batch_cap < 1:
        raise ValueError(f"batch_cap {batch_cap}; expected >= 1")
    pairs = flat.reshape(-1)
    order = np.argsort(pairs, kind="stable")
    sorted_ids = pairs[order]
    unique, starts, counts = np.unique(sorted_ids, return_index=True, return_counts=True)
    is_absent = np.isin(unique, absent)
    by_use = np.argsort(counts, kind="stable")  # least used first
    sequence = np.concatenate([by_use[~is_absent[by_use]], by_use[is_absent[by_use]]])
    batches = []
    for i in range(0, len(sequence), batch_cap):
        sel = np.sort(sequence[i : i + batch_cap])
        rows = np.concatenate([order[starts[j] : starts[j] + counts[j]] for j in sel])
        batches.append(ExpertBatch(unique[sel], rows))
    return batches


def switch_rows(switch, x_rows: mx.array, slot_idx: mx.array, sort: bool) -> mx.array:
    """SwitchGLU's body on pairs already gathered: x_rows (P, 1, D), slot_idx (P,) -> (P, 1, D)."""
    if type(switch).__call__ is SwitchGLU.__call__:  # stock SwitchGLU's body, mirrored
        up = switch.up_proj(x_rows, slot_idx, sorted_indices=sort)
        gate = switch.gate_proj(x_rows, slot_idx, sorted_indices=sort)
        return switch.down_proj(switch.activation(up, gate), slot_idx, sorted_indices=sort)
    return switch(x_rows[:, 0, :], slot_idx[:, None])  # a family's own module: its own call, (P, 1, D)


def expert_major_call(cache, layer: int, switch, x: mx.array, ids: np.ndarray) -> tuple[mx.array, list]:
    """The output of `switch` on x (..., D) routed to expert ids (..., k), computed expert-major
    from `cache`'s slots of `layer`; returns (output (..., k, D), [CallStats per batch])."""
    k, D = ids.shape[-1], x.shape[-1]
    flat = ids.reshape(-1, k)
    unique = np.unique(flat)
    usable = cache.usable_slots(layer)
    overlap = usable >= 2
    batches = plan_batches(flat, cache.absent(layer, unique), max(1, usable // 2) if overlap else usable)
    sort = flat.size >= SORT_MIN_PAIRS
    xf = x.reshape(-1, 1, D)
    calls, outs = [], []
    pending = None  # (output, slots) of the batch computing
    try:
        for b in batches:
            if pending is not None and not overlap:
                done, pending = pending, None
                _finish(cache, layer, done)
            slots, stats = cache.ensure(layer, b.experts)  # reads overlap the pending batch's compute
            calls.append(stats)
            try:
                slot_of = np.full(int(b.experts.max()) + 1, -1, np.int64)
                slot_of[b.experts] = slots
                idx = mx.array(slot_of[flat.reshape(-1)[b.rows]].astype(np.uint32))
                out = switch_rows(switch, xf[mx.array(b.rows // k)], idx, sort)
                mx.async_eval(out)
            except BaseException:
                cache.unpin(layer, slots)
                raise
            done, pending = pending, (out, slots)
            outs.append(out)
            if done is not None:
                _finish(cache, layer, done)
        if pending is not None:
            done, pending = pending, None
            _finish(cache, layer, done)
    finally:
        if pending is not None:  # an error: let the pending graph finish before its slots may be reused
            try:
                mx.eval(pending[0])
            except Exception:
                pass
            cache.unpin(layer, pending[1])
    perm = np.concatenate([b.rows for b in batches])
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(len(perm))
    out = mx.concatenate(outs, axis=0)[mx.array(inverse)]
    return out.reshape(*ids.shape, D), calls


def _finish(cache, layer: int, pending: tuple[mx.array, np.ndarray]) -> None:
    out, slots = pending
    try:
        mx.eval(out)
    finally:
        cache.unpin(layer, slots)
