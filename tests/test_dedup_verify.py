"""Dedup verify: the grouped reference against stock mlx-lm, the wiring entry point, the
kernel gate, the CLI report, and the Metal kernel (on Metal; off Metal: it builds, refuses
to launch, and its source runs under a C++ emulation of simdgroups)."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
import warnings
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from metal import dedup_switch_glu, group_by_expert, moe_verify, moe_verify_reference, window_stats
from metal.dedup_verify import (
    ROWS,
    KernelGate,
    expert_outputs,
    grouped_metal,
    grouped_reference,
    kernel_unsupported,
    max_error,
    tolerance,
    weights_from_slab,
    weights_from_switch,
)
from metal.kernel_source import DOWN_SOURCE, GATE_UP_SOURCE, build_kernels
from metal.selfcheck import make_routing, random_slab, stock_switch_glu

D, H, SLOTS = 128, 128, 16  # multiples of every group size swept
METAL = mx.metal.is_available()
ON_CPU = mx.default_device() == mx.cpu
needs_metal = pytest.mark.skipif(not METAL, reason="Metal is not available on this machine")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


@lru_cache(maxsize=None)
def _slab(bits: int, group_size: int, dtype: str):
    return random_slab(SLOTS, D, H, bits=bits, group_size=group_size, dtype=DTYPES[dtype], seed=bits * 1000 + group_size)


def _window(tokens: int, top_k: int, routing: str, dtype: str, seed: int = 0):
    ids, scores = make_routing(tokens, top_k, SLOTS, routing, seed=seed)
    x = mx.random.normal((1, tokens, D), key=mx.random.key(seed)).astype(DTYPES[dtype])
    return x, mx.array(ids)[None], mx.array(scores)[None]


def _assert_matches(got: mx.array, want: mx.array, compute_dtype=None) -> None:
    """Bit-exact on the CPU backend; elsewhere (Metal's gather_qmm picks other kernels) within tolerance."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if ON_CPU:
        assert mx.array_equal(got, want).item(), f"max error {max_error(got, want)}"
    else:
        assert max_error(got, want) <= tolerance(want, compute_dtype)


# -- reference vs stock ------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["random", "overlap"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens,top_k", list(itertools.product([1, 2, 4, 8, 16], [2, 4, 8])))
def test_reference_matches_stock(tokens, top_k, bits, group_size, dtype, routing):
    slab = _slab(bits, group_size, dtype)
    x, inds, scores = _window(tokens, top_k, routing, dtype, seed=tokens * 10 + top_k)
    stock = (stock_switch_glu(slab, group_size=group_size, bits=bits)(x, inds) * scores[..., None]).sum(axis=-2)
    got = moe_verify_reference(x, inds, scores, slab, group_size=group_size, bits=bits)
    _assert_matches(got, stock, DTYPES[dtype])  # float32 scores promote the combined output


def test_reference_matches_stock_unquantized():
    sw = SwitchGLU(D, H, SLOTS)  # float SwitchLinear weights: the gather_mm path
    slab = {f"{p}.weight": getattr(sw, p).weight for p in ("gate_proj", "up_proj", "down_proj")}
    for tokens in (1, 4, 16):
        x, inds, scores = _window(tokens, 4, "random", "float32", seed=tokens)
        got = moe_verify_reference(x, inds, scores, slab, group_size=None, bits=None)
        _assert_matches(got, (sw(x, inds) * scores[..., None]).sum(axis=-2))


def test_moe_verify_is_the_reference_without_metal():
    slab = _slab(4, 64, "float32")
    x, inds, scores = _window(4, 8, "random", "float32")
    got = moe_verify(x, inds, scores, slab, group_size=64, bits=4)
    want = moe_verify_reference(x, inds, scores, slab, group_size=64, bits=4)
    if METAL:
        assert max_error(got, want) <= tolerance(want)
    else:
        assert mx.array_equal(got, want).item()


def test_slab_without_group_size_is_refused():
    with pytest.raises(ValueError, match="group_size"):
        weights_from_slab(_slab(4, 64, "float32"), group_size=None, bits=4)


# -- grouping ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_group_by_expert_is_csr_of_the_pairs(seed):
    rng = np.random.default_rng(seed)
    tokens, top_k = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    ids = np.stack([rng.permutation(6)[:top_k] for _ in range(tokens)]).astype(np.uint32)
    g = group_by_expert(mx.array(ids))
    order, experts, rows = np.array(g.order), np.array(g.experts), np.array(g.rows)
    offsets, inv = np.array(g.offsets), np.array(g.inv_order)
    flat = ids.reshape(-1)
    assert (experts == flat[order]).all() and (np.diff(experts.astype(np.int64)) >= 0).all()
    assert (rows == order // top_k).all() and (order[inv] == np.arange(flat.size)).all()
    unique, counts = np.unique(flat, return_counts=True)
    assert offsets.shape == (flat.size + 1,)
    assert (np.diff(offsets[: unique.size + 1]) == counts).all() and (offsets[unique.size:] == flat.size).all()
    assert (experts[offsets[: unique.size]] == unique).all()


def test_window_stats_counts_pairs_and_unique_experts():
    assert window_stats(mx.array([[3, 1], [1, 5], [3, 0]])) == (6, 4)
    assert window_stats(np.array([[[7, 7]]])) == (2, 1)


# -- the wiring entry point -------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", ["batched", "flat"])
def test_dedup_switch_glu_returns_what_switch_returns(dtype, shape):
    slab = _slab(4, 64, dtype)
    switch = stock_switch_glu(slab, group_size=64, bits=4)
    for tokens, routing in [(1, "random"), (3, "overlap"), (5, "skewed"), (16, "random")]:
        x, inds, _ = _window(tokens, 8, routing, dtype, seed=tokens)
        if shape == "flat":  # CachedSwitchGLU's split groups call with (n, D) and (n, k)
            x, inds = x[0], inds[0]
        _assert_matches(dedup_switch_glu(switch, x, inds), switch(x, inds))


def test_dedup_switch_glu_on_a_cache_backed_switch():
    """The module CachedSwitchGLU builds over its slabs is accepted as is."""
    from runtime.cache.slab_switch import slab_switch_glu
    from storage.layout import LayerLayout, QuantSpec

    quant = {p: QuantSpec(64, 4, "affine") for p in ("gate_proj", "up_proj", "down_proj")}
    switch = slab_switch_glu(LayerLayout(0, "m.switch_mlp", SLOTS, (), quant), _slab(4, 64, "float32"),
                             stock_switch_glu(_slab(4, 64, "float32"), group_size=64, bits=4).activation)
    assert weights_from_switch(switch) is not None
    x, inds, _ = _window(4, 8, "skewed", "float32")
    _assert_matches(dedup_switch_glu(switch, x, inds.astype(mx.uint32)), switch(x, inds.astype(mx.uint32)))


def test_other_activations_go_through_the_reference():
    from mlx_lm.models.activations import SwigluOAI

    slab = _slab(4, 64, "float32")
    switch = stock_switch_glu(slab, group_size=64, bits=4)
    switch.activation = SwigluOAI()  # gpt-oss's clipped SwiGLU: no kernel, same grouped reference
    x, inds, scores = _window(4, 4, "overlap", "float32")
    _assert_matches(dedup_switch_glu(switch, x, inds), switch(x, inds))
    got = moe_verify_reference(x, inds, scores, slab, group_size=64, bits=4, activation=SwigluOAI())
    _assert_matches(got, (switch(x, inds) * scores[..., None]).sum(axis=-2))


def test_dedup_switch_glu_falls_back_to_switch_for_biased_linears():
    switch = SwitchGLU(64, 32, 8, bias=True)
    assert weights_from_switch(switch) is None
    x, inds, _ = _window(3, 2, "random", "float32")
    x = x[..., :64]
    inds = inds % 8
    assert mx.array_equal(dedup_switch_glu(switch, x, inds), switch(x, inds)).item()


# -- the kernel gate (self-check) -----------------------------------------------------------


def test_gate_serves_a_kernel_that_matches_the_reference():
    gate, want = KernelGate(), mx.array([1.0, -2.0, 3.0])
    calls = []
    out = gate.run("k", lambda: calls.append(1) or want + 1e-7, lambda: want)
    assert gate.disabled is None and "k" in gate.verified and calls == [1]
    assert max_error(out, want) < 1e-6
    gate.run("k", lambda: calls.append(2) or want, lambda: pytest.fail("verified keys skip the reference"))
    assert calls == [1, 2]


@pytest.mark.parametrize("bad", ["mismatch", "nan", "raises"])
def test_gate_disables_a_bad_kernel_with_a_warning(bad):
    gate, want = KernelGate(), mx.array([1.0, -2.0, 3.0])

    def kernel():
        if bad == "raises":
            raise RuntimeError("compile error")
        return want * (mx.array(float("nan")) if bad == "nan" else 1.5)

    with pytest.warns(RuntimeWarning, match="disabled"):
        out = gate.run("k", kernel, lambda: want)
    assert mx.array_equal(out, want).item() and gate.disabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # disabled: no further warning, no kernel call
        out = gate.run("k2", lambda: pytest.fail("the kernel is off"), lambda: want)
    assert mx.array_equal(out, want).item()


# -- the Metal kernel ---------------------------------------------------------------------


def test_kernel_source_builds_into_callables():
    gate_up, down = build_kernels()  # construction works on every MLX build; compilation needs Metal
    assert callable(gate_up) and callable(down)


@pytest.mark.skipif(METAL, reason="checks the off-Metal refusal")
def test_kernel_refuses_to_run_without_metal():
    slab = _slab(4, 64, "float32")
    x, inds, _ = _window(2, 2, "random", "float32")
    with pytest.raises(RuntimeError, match="requires a Metal device"):
        grouped_metal(x[0], group_by_expert(inds), weights_from_slab(slab, group_size=64, bits=4))


def test_kernel_applicability():
    from mlx_lm.models.activations import SwigluOAI

    w4 = weights_from_slab(_slab(4, 64, "float32"), group_size=64, bits=4)
    assert kernel_unsupported(w4, stock_switch_glu(_slab(4, 64, "float32"), group_size=64, bits=4).activation) is None
    assert "activation" in kernel_unsupported(w4, SwigluOAI())
    assert "affine" in kernel_unsupported(weights_from_switch(SwitchGLU(64, 32, 4)), SwitchGLU(8, 8, 1).activation)


@needs_metal
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 64), (2, 64)])
@pytest.mark.parametrize("tokens,top_k,routing", [(1, 8, "random"), (4, 8, "skewed"), (8, 4, "overlap"),
                                                  (16, 8, "overlap"), (16, 2, "random")])
def test_metal_kernel_matches_reference(tokens, top_k, routing, bits, group_size, dtype):
    slab = _slab(bits, group_size, dtype)
    weights = weights_from_slab(slab, group_size=group_size, bits=bits)
    x, inds, _ = _window(tokens, top_k, routing, dtype, seed=tokens)
    g = group_by_expert(inds)
    got = grouped_metal(x[0], g, weights)
    want = grouped_reference(x[0], g, weights, stock_switch_glu(slab, group_size=group_size, bits=bits).activation)
    assert max_error(got, want) <= tolerance(want)


@needs_metal
def test_metal_dedup_switch_glu_self_checks_and_matches():
    from metal import KERNEL_GATE

    slab = _slab(4, 64, "bfloat16")
    switch = stock_switch_glu(slab, group_size=64, bits=4)
    x, inds, _ = _window(5, 8, "skewed", "bfloat16")
    got = dedup_switch_glu(switch, x, inds)
    assert KERNEL_GATE.disabled is None, KERNEL_GATE.disabled
    want = switch(x, inds)
    assert max_error(got, want) <= tolerance(want)


# -- the kernel's source text, run by a C++ emulation of simdgroups (any machine with g++) ----

_HARNESS = """
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>
using uint = unsigned int;
struct uint3 { uint x, y, z; };
namespace metal { inline float exp(float v) { return std::exp(v); } }
using std::min;
#define device
typedef float T;
constexpr int BITS = %(bits)d, GS = %(gs)d, ROWS = %(rows)d;
static std::barrier<>* bar;
static float lanes[2][32];
thread_local uint my_lane, phase;
// simd_sum as Metal defines it: every lane gets the sum over the 32 lanes. Two buffers in
// turn: a lane can only refill a buffer after all lanes passed the barrier of the sum between.
static float simd_sum(float v) {
    lanes[phase][my_lane] = v; bar->arrive_and_wait();
    float s = 0.0f; for (int i = 0; i < 32; i++) s += lanes[phase][i];
    phase ^= 1u; return s;
}
namespace gu { constexpr int D_IN = %(d)d, D_OUT = %(h)d;
static void body(const float* x, const uint32_t* rows, const uint32_t* offsets, const uint32_t* experts,
    const uint32_t* wg, const float* sg, const float* bg, const uint32_t* wu, const float* su, const float* bu,
    float* h, uint3 thread_position_in_grid, uint thread_index_in_simdgroup) {
%(gate_up)s
} }
namespace dn { constexpr int D_IN = %(h)d, D_OUT = %(d)d;
static void body(const float* h, const uint32_t* offsets, const uint32_t* experts,
    const uint32_t* wd, const float* sd, const float* bd, float* y, uint3 thread_position_in_grid,
    uint thread_index_in_simdgroup) {
%(down)s
} }
template <class F> static void grid(uint ny, uint nz, F f) {  // one thread per lane, simdgroups in turn
    std::barrier<> b(32); bar = &b; std::vector<std::thread> ts;
    for (uint lane = 0; lane < 32; lane++) ts.emplace_back([=] {
        my_lane = lane;
        for (uint z = 0; z < nz; z++) for (uint y = 0; y < ny; y++) f(uint3{lane, y, z}, lane);
    });
    for (auto& t : ts) t.join();
}
extern "C" void run(uint n_pairs, const float* x, const uint32_t* rows, const uint32_t* offsets,
    const uint32_t* experts, const uint32_t* wg, const float* sg, const float* bg, const uint32_t* wu,
    const float* su, const float* bu, const uint32_t* wd, const float* sd, const float* bd, float* h, float* y) {
    grid(gu::D_OUT, n_pairs, [&](uint3 p, uint l) { gu::body(x, rows, offsets, experts, wg, sg, bg, wu, su, bu, h, p, l); });
    grid(dn::D_OUT, n_pairs, [&](uint3 p, uint l) { dn::body(h, offsets, experts, wd, sd, bd, y, p, l); });
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20) to emulate simdgroups")
@pytest.mark.parametrize("bits,group_size,tokens,top_k,routing", [(4, 64, 10, 3, "overlap"), (8, 32, 4, 4, "random")])
def test_kernel_source_emulated_on_cpu_matches_reference(tmp_path, bits, group_size, tokens, top_k, routing):
    d, h = 2 * group_size, group_size  # small: the emulation runs 32 threads per simdgroup
    slab = random_slab(6, d, h, bits=bits, group_size=group_size, dtype=mx.float32, seed=3)
    src = tmp_path / "kernel.cpp"
    src.write_text(_HARNESS % dict(bits=bits, gs=group_size, rows=ROWS, d=d, h=h, gate_up=GATE_UP_SOURCE,
                                   down=DOWN_SOURCE))
    lib = tmp_path / "kernel.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    ids, _ = make_routing(tokens, top_k, 6, routing, seed=1)
    x = np.random.default_rng(2).normal(size=(tokens, d)).astype(np.float32)
    g = group_by_expert(mx.array(ids))
    if routing == "overlap":
        assert int(np.diff(np.array(g.offsets)).max()) > ROWS  # a group spans two row tiles
    host = [np.ascontiguousarray(np.array(a)) for a in (
        x, g.rows, g.offsets, g.experts, *(slab[f"{p}.{part}"] for p in ("gate_proj", "up_proj", "down_proj")
                                           for part in ("weight", "scales", "biases")))]
    n_pairs = ids.size
    h_out, y_out = np.zeros((n_pairs, h), np.float32), np.zeros((n_pairs, d), np.float32)
    ctypes.CDLL(str(lib)).run(ctypes.c_uint(n_pairs), *(a.ctypes.data_as(ctypes.c_void_p) for a in host + [h_out, y_out]))
    weights = weights_from_slab(slab, group_size=group_size, bits=bits)
    want = grouped_reference(mx.array(x), g, weights, stock_switch_glu(slab, group_size=group_size, bits=bits).activation)
    assert max_error(mx.array(y_out), want) <= tolerance(want)


def test_expert_outputs_rejects_mismatched_leading_dims():
    w = weights_from_slab(_slab(4, 64, "float32"), group_size=64, bits=4)
    with pytest.raises(ValueError, match="leading"):
        expert_outputs(mx.zeros((3, D)), mx.zeros((2, 4), mx.uint32), w, None)
