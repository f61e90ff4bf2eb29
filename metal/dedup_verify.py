"""Dedup verify: a MoE layer over a window of tokens, each unique expert's weights read once.

Shapes: T = tokens in the window (K drafted + 1), k = experts per token, P = T * k
(token, expert) pairs, U = unique experts among them, D = hidden, H = expert
intermediate, S = cache slots.
    x: (..., D), inds: (..., k) slot ids, scores: (..., k)  ->  moe_verify: (..., D)
    dedup_switch_glu(switch, x, inds)                        ->  (..., k, D), the SwitchGLU contract

A verify window routes its P pairs to far fewer experts (published: 20.4 unique for
4 tokens x top-8 of 128). mlx-lm's SwitchGLU gathers one expert matrix per pair below
64 pairs, so it streams each expert's weights once per token that picked it. Here
the pairs are grouped by expert first (`group_by_expert`: a sort of the slot ids and
CSR offsets), and each group is computed against its expert's weights once:

- Metal (`kernel_source.py`): one simdgroup dequantizes a weight word once and
  accumulates it into every row of the group; gate, up and SwiGLU in one kernel,
  down in a second; weights are read once per group of up to ROWS rows. Used for
  windows of up to KERNEL_MAX_PAIRS pairs (verify windows, short prefill chunks).
- Reference (pure MLX ops, runs everywhere, the oracle): the grouped rows go
  through `mx.gather_qmm` with `sorted_indices=True` -- exactly what stock SwitchGLU
  does for >= 64 pairs. On the CPU backend, gather_qmm computes every row against its
  expert independently (MLX's CPU qmm walks the weight row once per input row), so
  grouping buys locality (an expert's rows are consecutive, its blocks stay in cache)
  but no arithmetic; the CPU's dedup gain is in I/O, which the expert cache provides
  (one load per unique expert per window). On Metal, sorted gather_qmm may take
  mlx's grouped kernel, which needs ~4 rows per expert to pay off.

Invariants:
- The reference is bit-identical to stock SwitchGLU (+ the score-weighted sum) on
  the CPU backend (tests assert exact equality for float32 and bfloat16; float16
  holds too). Elsewhere it matches within `tolerance`.
- Kernel output is returned only for configurations whose first use in this process
  matched the reference within `tolerance` (`KernelGate`); after any mismatch or
  error the kernel is disabled for the process with a warning and the reference runs.
- Launching the kernel without Metal raises RuntimeError; it never runs elsewhere.
- Slot ids index the cache slabs as given: the module never learns expert ids.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU, SwitchLinear

from metal.kernel_source import KERNEL_BITS, ROWS, build_kernels

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Relative to the largest magnitude of the reference output: float32 allows a
# different summation order over D and H; half types a few ulps of rounding of the
# intermediate activations, which kernel and reference round at different points.
RTOL = {mx.float32: 1e-4, mx.float16: 5e-3, mx.bfloat16: 3e-2}
# Above this many pairs (a long prefill chunk) an expert has tens of rows and mlx's own
# sorted gather_qmm (a tiled grouped GEMM on Metal) beats a matvec kernel that re-walks
# the weights every ROWS rows; the reference there is that very path. A guess to tune on a Mac.
KERNEL_MAX_PAIRS = 256


@dataclass(frozen=True, eq=False)
class ProjWeights:
    weight: mx.array  # (S, out, in * bits / 32) uint32 if quantized, else (S, out, in)
    scales: mx.array | None  # (S, out, in / group_size); None: unquantized
    biases: mx.array | None  # like scales; None for modes without biases
    group_size: int | None  # elements per quantization group
    bits: int | None  # bits per quantized element
    mode: str = "affine"  # mlx quantization mode


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    gate: ProjWeights  # D -> H
    up: ProjWeights  # D -> H
    down: ProjWeights  # H -> D


@dataclass(frozen=True, eq=False)
class Grouping:
    order: mx.array  # (P,) uint32: flat pair index (token * k + j) at each sorted position
    inv_order: mx.array  # (P,) uint32: sorted position of each flat pair
    experts: mx.array  # (P,) uint32: slot id at each sorted position, non-decreasing
    rows: mx.array  # (P,) uint32: token of each sorted position
    offsets: mx.array  # (P + 1,) uint32 CSR: group g is sorted positions [offsets[g], offsets[g + 1]);
    #                    groups past the last unique expert are empty (offset P)


def weights_from_slab(slab: Mapping[str, mx.array], *, group_size: int | None, bits: int | None,
                      mode: str = "affine") -> ExpertWeights:
    """Expert weights from cache slabs keyed '<proj>.weight|scales|biases' (quantized iff scales exist)."""
    projs = {}
    for proj in PROJECTIONS:
        if f"{proj}.weight" not in slab:
            raise ValueError(f"slab has no '{proj}.weight'; expected keys like 'gate_proj.weight', got {sorted(slab)}")
        scales = slab.get(f"{proj}.scales")
        if scales is not None and (group_size is None or bits is None):
            raise ValueError(f"'{proj}.scales' is present: pass group_size and bits (got {group_size}, {bits})")
        projs[proj] = ProjWeights(slab[f"{proj}.weight"], scales, slab.get(f"{proj}.biases"),
                                  group_size if scales is not None else None, bits if scales is not None else None, mode)
    return ExpertWeights(projs["gate_proj"], projs["up_proj"], projs["down_proj"])


def weights_from_switch(switch: SwitchGLU) -> ExpertWeights | None:
    """Expert weights of a stock SwitchGLU, or None if its linears are beyond the grouped path
    (an additive bias, a global scale, or an unknown module)."""
    projs = {}
    for proj in PROJECTIONS:
        lin = getattr(switch, proj)
        if "bias" in lin or getattr(lin, "global_scale", None) is not None:
            return None
        if isinstance(lin, QuantizedSwitchLinear):
            projs[proj] = ProjWeights(lin["weight"], lin["scales"], lin.get("biases"), lin.group_size, lin.bits, lin.mode)
        elif isinstance(lin, SwitchLinear):
            projs[proj] = ProjWeights(lin["weight"], None, None, None, None)
        else:
            return None
    return ExpertWeights(projs["gate_proj"], projs["up_proj"], projs["down_proj"])


def group_by_expert(inds: mx.array) -> Grouping:
    """Sort the window's pairs by slot id and cut them into per-expert groups, on device."""
    k = inds.shape[-1]
    flat = inds.reshape(-1).astype(mx.uint32)
    n_pairs = flat.size
    order = mx.argsort(flat).astype(mx.uint32)
    experts = flat[order]
    is_start = mx.concatenate([mx.array([True]), experts[1:] != experts[:-1]])
    group = mx.cumsum(is_start.astype(mx.uint32)) - 1
    # Each group start writes its position to offsets[group]; other positions write to a
    # spill entry past the end. Untouched entries keep P, so unused groups are empty.
    target = mx.where(is_start, group, n_pairs + 1)
    positions = mx.arange(n_pairs, dtype=mx.uint32)
    offsets = mx.full((n_pairs + 2,), n_pairs, mx.uint32).at[target].minimum(positions)[: n_pairs + 1]
    return Grouping(order, mx.argsort(order).astype(mx.uint32), experts, order // k, offsets)


def window_stats(inds) -> tuple[int, int]:
    """(n_pairs, n_unique) of a window's routing (any shape; host sync if on device)."""
    ids = np.asarray(inds)
    return int(ids.size), int(np.unique(ids).size)


def _project(rows: mx.array, experts: mx.array, proj: ProjWeights) -> mx.array:
    """(P, 1, in) rows, each times its expert's matrix, as the stock Switch linears compute it."""
    if proj.scales is None:
        return mx.gather_mm(rows, proj.weight.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)
    return mx.gather_qmm(rows, proj.weight, proj.scales, proj.biases, rhs_indices=experts, transpose=True,
                         group_size=proj.group_size, bits=proj.bits, mode=proj.mode, sorted_indices=True)


def grouped_reference(x2d: mx.array, grouping: Grouping, weights: ExpertWeights, activation) -> mx.array:
    """(P, D) expert outputs in sorted order, pure MLX ops (see the module docstring)."""
    rows = x2d[grouping.rows][:, None, :]  # (P, 1, D)
    up = _project(rows, grouping.experts, weights.up)  # (P, 1, H)
    gate = _project(rows, grouping.experts, weights.gate)  # (P, 1, H)
    out = _project(activation(up, gate), grouping.experts, weights.down)  # (P, 1, D)
    return out[:, 0, :]


def kernel_unsupported(weights: ExpertWeights, activation) -> str | None:
    """Why the Metal kernel cannot compute this layer, or None if it can."""
    if type(activation) is not SwiGLU:
        return f"activation {type(activation).__name__} is not the fused SwiGLU"
    for name, proj in (("gate", weights.gate), ("up", weights.up), ("down", weights.down)):
        if proj.scales is None or proj.biases is None or proj.mode != "affine":
            return f"{name} projection is not affine-quantized with biases"
        if proj.bits not in KERNEL_BITS:
            return f"{name} projection has {proj.bits}-bit weights; the kernel takes {KERNEL_BITS}"
    if (weights.gate.bits, weights.gate.group_size) != (weights.up.bits, weights.up.group_size):
        return "gate and up projections are quantized differently"
    return None


def _result_dtype(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    return (mx.zeros((), a) + mx.zeros((), b)).dtype  # MLX's promotion, as gather_qmm applies it


@lru_cache(maxsize=1)
def _kernels():
    return build_kernels()


def grouped_metal(x2d: mx.array, grouping: Grouping, weights: ExpertWeights) -> mx.array:
    """(P, D) expert outputs in sorted order from the Metal kernels. Metal only."""
    if not mx.metal.is_available():
        raise RuntimeError("the dedup verify kernel requires a Metal device (mx.metal.is_available() is False "
                           "on this machine); use moe_verify_reference or moe_verify, which falls back to it")
    reason = kernel_unsupported(weights, SwiGLU())
    if reason is not None:
        raise ValueError(f"the dedup verify kernel cannot run this layer: {reason}")
    gate_up, down = _kernels()
    n_pairs, d_model = grouping.experts.size, x2d.shape[-1]
    hidden = weights.gate.weight.shape[1]
    h_dtype = _result_dtype(x2d.dtype, weights.gate.scales.dtype)
    y_dtype = _result_dtype(h_dtype, weights.down.scales.dtype)
    g, u, d = weights.gate, weights.up, weights.down
    h = gate_up(
        inputs=[x2d, grouping.rows, grouping.offsets, grouping.experts, g.weight, g.scales, g.biases,
                u.weight, u.scales, u.biases],
        template=[("T", h_dtype), ("D_IN", d_model), ("D_OUT", hidden), ("GS", g.group_size), ("BITS", g.bits),
                  ("ROWS", ROWS)],
        grid=(32, hidden, n_pairs), threadgroup=(32, min(8, hidden), 1),
        output_shapes=[(n_pairs, hidden)], output_dtypes=[h_dtype],
    )[0]
    return down(
        inputs=[h, grouping.offsets, grouping.experts, d.weight, d.scales, d.biases],
        template=[("T", y_dtype), ("D_IN", hidden), ("D_OUT", d_model), ("GS", d.group_size), ("BITS", d.bits),
                  ("ROWS", ROWS)],
        grid=(32, d_model, n_pairs), threadgroup=(32, min(8, d_model), 1),
        output_shapes=[(n_pairs, d_model)], output_dtypes=[y_dtype],
    )[0]


def max_error(got: mx.array, want: mx.array) -> float:
    """Largest absolute difference, in float32 (NaN if either side has a NaN)."""
    return float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item())


def tolerance(want: mx.array, compute_dtype: mx.Dtype | None = None) -> float:
    """Allowed max_error against the reference output `want`, computed in `compute_dtype`
    (default: want's dtype; pass the activation dtype when scores promoted the output)."""
    scale = float(mx.max(mx.abs(want.astype(mx.float32))).item())
    return RTOL.get(compute_dtype or want.dtype, RTOL[mx.bfloat16]) * scale + 1e-6


class KernelGate:
    """Whether the Metal kernel may serve a configuration in this process.

    Invariant: `run` returns kernel output only for keys whose first run matched the
    reference within `tolerance`; one mismatch or error disables the kernel for good.
    """

    def __init__(self):
        self.verified: set = set()  # keys whose first kernel run matched the reference
        self.disabled: str | None = None  # why the kernel is off, once it is

    def run(self, key, kernel: Callable[[], mx.array], reference: Callable[[], mx.array]) -> mx.array:
        if self.disabled is not None:
            return reference()
        if key in self.verified:
            return kernel()
        want = reference()
        try:
            got = kernel()
            mx.eval(got, want)
            err, tol = max_error(got, want), tolerance(want)
        except Exception as e:  # a kernel that fails to compile or launch must not take the model down
            self.disable(f"kernel failed on {key}: {e!r}")
            return want
        if not err <= tol:  # also catches NaN
            self.disable(f"kernel differs from the reference on {key}: max error {err:.3g} > tolerance {tol:.3g}")
            return want
        self.verified.add(key)
        return got

    def disable(self, reason: str) -> None:
        self.disabled = reason
        warnings.warn(f"dedup verify Metal kernel disabled, using the reference path: {reason}", RuntimeWarning,
                      stacklevel=3)


# The process-wide record the issue asks for ("the first time the kernel is used in a
# process"): module state on purpose, one entry per configuration and one off switch.
KERNEL_GATE = KernelGate()


def _gate_key(x2d: mx.array, weights: ExpertWeights, n_pairs: int) -> tuple:
    projs = (weights.gate, weights.up, weights.down)
    return (x2d.dtype, x2d.shape[-1], weights.gate.weight.shape[1], n_pairs,
            tuple((p.bits, p.group_size, p.scales.dtype) for p in projs))


def expert_outputs(x: mx.array, inds: mx.array, weights: ExpertWeights, activation, *,
                   use_kernel: bool = True) -> mx.array:
    """(..., k, D): every pair's expert output, computed grouped by expert, in pair order."""
    if x.shape[:-1] != inds.shape[:-1]:
        raise ValueError(f"x {x.shape} and inds {inds.shape} must share their leading (token) dimensions")
    d_model = x.shape[-1]
    x2d = x.reshape(-1, d_model)
    grouping = group_by_expert(inds)

    def reference():
        return grouped_reference(x2d, grouping, weights, activation)

    kernel_fits = inds.size <= KERNEL_MAX_PAIRS and kernel_unsupported(weights, activation) is None
    if use_kernel and kernel_fits and mx.metal.is_available():
        out = KERNEL_GATE.run(_gate_key(x2d, weights, inds.size),
                              lambda: grouped_metal(x2d, grouping, weights), reference)
    else:
        out = reference()
    return out[grouping.inv_order].reshape(*inds.shape, d_model)


def _default_swiglu(activation):
    # `activation or SwiGLU()` would be wrong: an nn.Module without parameters is an empty dict, so falsy.
    return SwiGLU() if activation is None else activation


def _combine(y: mx.array, scores: mx.array) -> mx.array:
    return (y * scores[..., None]).sum(axis=-2)  # the score-weighted sum the MoE blocks apply


def moe_verify(x: mx.array, inds: mx.array, scores: mx.array, slab: Mapping[str, mx.array], *,
               group_size: int | None, bits: int | None, mode: str = "affine", activation=None) -> mx.array:
    """(..., D): the routed-expert output of a window, each unique slot's weights read once.

    Runs the Metal kernel where available and self-checked, else the reference.
    """
    weights = weights_from_slab(slab, group_size=group_size, bits=bits, mode=mode)
    return _combine(expert_outputs(x, inds, weights, _default_swiglu(activation)), scores)


def moe_verify_reference(x: mx.array, inds: mx.array, scores: mx.array, slab: Mapping[str, mx.array], *,
                         group_size: int | None, bits: int | None, mode: str = "affine",
                         activation=None) -> mx.array:
    """(..., D): as moe_verify, in pure MLX ops only (the oracle; bit-exact to stock on CPU)."""
    weights = weights_from_slab(slab, group_size=group_size, bits=bits, mode=mode)
    return _combine(expert_outputs(x, inds, weights, _default_swiglu(activation), use_kernel=False), scores)


def dedup_switch_glu(switch: SwitchGLU, x: mx.array, slot_inds: mx.array) -> mx.array:
    """What `switch(x, slot_inds)` returns, (..., k, D), computed grouped by expert.

    Metal kernel if available and self-checked (within `tolerance` of stock, not bit-exact),
    else the reference (bit-identical to stock on the CPU backend); linears the grouped
    path cannot express (bias, global scale) and mismatched shapes go to `switch` itself.
    """
    weights = weights_from_switch(switch)
    if weights is None or slot_inds.size == 0 or x.shape[:-1] != slot_inds.shape[:-1]:
        return switch(x, slot_inds)
    return expert_outputs(x, slot_inds, weights, switch.activation)


def kernel_would_run(switch: SwitchGLU, n_pairs: int) -> bool:
    """Whether dedup_switch_glu would launch the Metal kernel for a call of n_pairs pairs."""
    if not mx.metal.is_available() or KERNEL_GATE.disabled is not None or n_pairs > KERNEL_MAX_PAIRS:
        return False
    weights = weights_from_switch(switch)
    return weights is not None and kernel_unsupported(weights, switch.activation) is None


def window_switch_glu(switch: SwitchGLU, x: mx.array, slot_inds: mx.array) -> mx.array:
    """A window's expert outputs: the dedup kernel where it runs, else the stock switch.

    Without the kernel, grouping gains no arithmetic (see the module docstring) and costs a
    sort and a scatter per layer, which at small sizes is measurable; the stock switch is used
    then, so the output is stock's exactly. With the kernel it is within `tolerance` of it.
    """
    if kernel_would_run(switch, slot_inds.size):
        return dedup_switch_glu(switch, x, slot_inds)
    return switch(x, slot_inds)

