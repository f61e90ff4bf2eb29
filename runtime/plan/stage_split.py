"""StageSplit: which contiguous range of decoder layers each pipeline rank owns.

Rank 0 owns the first layers plus the embedding, final norm and LM head (it
tokenizes and samples); rank r owns the layers after rank r-1's. The automatic split
balances bytes: each layer weighs its non-expert (resident) bytes plus all of its
routed-expert bytes (what the rank must hold resident or page through its cache),
and rank 0 also carries the embedding/head bytes. The split minimises the heaviest
rank (exact, by dynamic programming over contiguous partitions). A single-sequence
decode runs the stages one after another, so compute per token is the same for any
split; bytes decide whether each Mac fits and at what hit rate.

Invariants: the ranges are contiguous, non-empty, in rank order and cover every
layer exactly once; more ranks than layers is refused with the numbers in the message.
It lives in runtime.plan because the planner projects the split the runtime makes
(runtime/plan/pipeline_plan.py) and runtime.pipeline, above the planner, runs it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class StageSplit:
    ranges: tuple[tuple[int, int], ...]  # per rank: [start, end) decoder-layer indices
    weights: tuple[int, ...]  # per rank: the bytes the split balanced (resident + expert bytes)

    @property
    def n_ranks(self) -> int:
        return len(self.ranges)

    def layers(self, rank: int) -> range:
        a, b = self.ranges[rank]
        return range(a, b)

    def owner(self, layer: int) -> int:
        for r, (a, b) in enumerate(self.ranges):
            if a <= layer < b:
                return r
        raise ValueError(f"layer {layer} is outside the model's {self.ranges[-1][1]} layers")

    def describe(self) -> str:
        return ", ".join(f"rank {r}: layers {a}-{b - 1}" for r, (a, b) in enumerate(self.ranges))


def layer_of(tensor_name: str) -> int | None:
    """The decoder-layer index in a tensor name ('model.layers.3.self_attn...' -> 3); None outside layers."""
    m = _LAYER.search(tensor_name)
    return int(m.group(1)) if m else None


def layer_bytes(resident: dict[str, int], expert_bytes: dict[int, int], n_layers: int) -> tuple[list[int], int]:
    """Per-layer bytes (resident + routed experts) and the bytes outside layers (embedding, norm, head)."""
    per_layer = [0] * n_layers
    outside = 0
    for name, nbytes in resident.items():
        l = layer_of(name)
        if l is None or l >= n_layers:
            outside += nbytes
        else:
            per_layer[l] += nbytes
    for l, nbytes in expert_bytes.items():
        per_layer[l] += nbytes
    return per_layer, outside


def check_ranks(n_ranks: int, n_layers: int) -> None:
    if n_ranks > n_layers:
        raise ValueError(f"{n_ranks} pipeline ranks but the model has {n_layers} decoder layers; a pipeline needs "
                         f"at least one layer per rank (launch with -n {n_layers} or fewer)")
    if n_ranks < 1:
        raise ValueError(f"{n_ranks} pipeline ranks; expected at least 1")


def balanced_split(per_layer: list[int], n_ranks: int, rank0_extra: int = 0) -> StageSplit:
    """Contiguous split of layers over ranks minimising the heaviest rank (rank 0 also carries `rank0_extra`)."""
    n = len(per_layer)
    check_ranks(n_ranks, n)
    prefix = [0]
    for w in per_layer:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[r][i]: the heaviest rank when ranks r.. cover layers i..n-1; cut[r][i]: where rank r ends
    best = [[inf] * (n + 1) for _ in range(n_ranks + 1)]
    cut = [[0] * (n + 1) for _ in range(n_ranks + 1)]
    best[n_ranks][n] = 0
    for r in range(n_ranks - 1, -1, -1):
        extra = rank0_extra if r == 0 else 0
        for i in range(n - 1, -1, -1):
            for j in range(i + 1, n - (n_ranks - r - 1) + 1):  # leave a layer for every later rank
                cost = max(prefix[j] - prefix[i] + extra, best[r + 1][j])
                if cost < best[r][i]:
                    best[r][i], cut[r][i] = cost, j
    ranges, i = [], 0
    for r in range(n_ranks):
        j = cut[r][i]
        ranges.append((i, j))
        i = j
    weights = tuple(prefix[b] - prefix[a] + (rank0_extra if r == 0 else 0) for r, (a, b) in enumerate(ranges))
    return StageSplit(tuple(ranges), weights)


def explicit_split(counts: list[int], per_layer: list[int], rank0_extra: int = 0) -> StageSplit:
    """The split given as layers per rank (`--pipeline-split 3,5`)."""
    n = len(per_layer)
    check_ranks(len(counts), n)
    if any(c < 1 for c in counts) or sum(counts) != n:
        raise ValueError(f"--pipeline-split {','.join(map(str, counts))}: expected one positive layer count per rank "
                         f"summing to the model's {n} layers")
    ranges, a = [], 0
    for c in counts:
        ranges.append((a, a + c))
        a += c
    weights = tuple(sum(per_layer[a:b]) + (rank0_extra if r == 0 else 0) for r, (a, b) in enumerate(ranges))
    return StageSplit(tuple(ranges), weights)


def parse_split(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--pipeline-split {text!r}: expected layer counts per rank, e.g. 3,5") from None
