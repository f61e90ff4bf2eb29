"""Measuring this machine for bench/bench_planner_self.py: memory copy bandwidth, the disk's own
read rate, expert reads as the runtime issues them, and decode-shaped gather_qmm throughput.

Each probe returns a rate (GB/s or GFLOP/s) and may be re-sampled: the CPU is shared with other
jobs, so the bench takes medians over passes. Nothing here predicts; bench_planner_self does.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np


def memory_gbps(nbytes: int = 256 << 20, trials: int = 5) -> float:
    """Copy bandwidth of a large numpy array, counting bytes read plus bytes written (STREAM's rule)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(trials):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def device_gbps(directory: Path, record_bytes: int, file_bytes: int = 128 << 20, threads: int = 4) -> float:
    """The disk's own figure, for reference: cold reads of whole expert-sized records, `threads` in flight
    (the doctor's probe: O_DIRECT, or F_NOCACHE / dropped pages where that is missing)."""
    from runtime.doctor import cold_read_gbps

    return cold_read_gbps(directory, file_bytes, record_bytes, depths=(threads,))["depths"][str(threads)]["gbps"]


class ExpertReads:
    """Expert reads as the runtime issues them: the store's ranges, one expert at a time, random order.

    "buffered" reads go through the page cache (every expert is read once first, so it is hot);
    "direct" reads bypass it (O_DIRECT; buffered where the filesystem refuses it).
    """

    def __init__(self, store, io_mode: str):
        from storage import ExpertKey
        from storage.reader import RangeReader

        self.store, self.reader = store, RangeReader(io_mode)
        self.keys = [ExpertKey(l, e) for l in store.moe_layers for e in range(store.layout(l).n_experts)]
        self.views = [np.empty(t.nbytes, np.uint8) for t in store.layout(self.keys[0].layer).tensors]
        self.expert_bytes = store.layout(self.keys[0].layer).expert_bytes
        self.rng = np.random.default_rng(0)
        if io_mode == "buffered":
            for key in self.keys:
                store.read_into(key, self.views, self.reader)

    def gbps(self, n_reads: int) -> float:
        order = self.rng.permutation(len(self.keys))[:n_reads]
        t0 = time.perf_counter()
        for i in order:
            self.store.read_into(self.keys[i], self.views, self.reader)
        return len(order) * self.expert_bytes / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.reader.close()


class GatherRate:
    """Decode-shaped gather_qmm chains (gate, up, down of top_k experts), float32 activations."""

    def __init__(self, layout, top_k: int, n_calls: int = 100):
        import mlx.core as mx

        self.mx, self.n_calls = mx, n_calls
        quant = layout.quant["gate_proj"]
        self.kwargs = dict(transpose=True, group_size=quant.group_size, bits=quant.bits)
        shapes = {t.name: t.shape for t in layout.tensors}  # per expert: weight (out, in * bits / 32)
        self.weights = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out_dims, packed = shapes[f"{proj}.weight"]
            dense = mx.random.normal((layout.n_experts, out_dims, packed * 32 // quant.bits), key=mx.random.key(0))
            self.weights[proj] = mx.quantize(dense * 0.02, group_size=quant.group_size, bits=quant.bits)
        self.hidden = shapes["gate_proj.weight"][1] * 32 // quant.bits
        self.inds = mx.array([list(range(0, layout.n_experts, layout.n_experts // top_k))[:top_k]], dtype=mx.uint32)
        self.flops_per_call = 2 * top_k * sum(o * p * 32 // quant.bits for name, (o, p) in shapes.items()
                                              if name.endswith(".weight"))
        mx.eval(self.weights)

    def gflops(self) -> float:
        mx = self.mx
        x = mx.random.normal((1, 1, 1, self.hidden), key=mx.random.key(1))
        mx.eval(x)
        t0 = time.perf_counter()
        for _ in range(self.n_calls):
            gate = mx.gather_qmm(x, *self.weights["gate_proj"], rhs_indices=self.inds, **self.kwargs)
            up = mx.gather_qmm(x, *self.weights["up_proj"], rhs_indices=self.inds, **self.kwargs)
            down = mx.gather_qmm(gate * up, *self.weights["down_proj"], rhs_indices=self.inds, **self.kwargs)
            x = down.sum(axis=1, keepdims=True) * 0.01  # feeds the next call: one chain, one eval
        mx.eval(x)
        return self.flops_per_call * self.n_calls / (time.perf_counter() - t0) / 1e9
