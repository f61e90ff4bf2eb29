"""Self-check of the dedup verify path: kernel vs reference vs stock on one live-sized window.

The harness builds a random quantized slab at the requested shapes, routes a window
through it with router-like (skewed) choices, and compares three computations of the
layer's output: stock mlx-lm SwitchGLU + score-weighted sum, `moe_verify_reference`,
and (where Metal exists) the Metal kernel. It reports max errors against the same
`tolerance` the in-process KernelGate applies, and median timings of each.

`run_coverage` repeats the check on the shapes the kernel handles differently:
groups of more than ROWS (8) rows for one expert (the weight row is walked again),
windows of fewer than 8 pairs, float16, and float32 activations with bfloat16
scales (mixed promotion).

Invariants: the report is complete whether or not Metal exists (the kernel line then
says why it was skipped); `passed` is False iff some available comparison exceeded
its tolerance or the kernel failed to run; `status` is PASS only if the kernel ran
and matched, SKIPPED if it did not run (no Metal, or a --bits / layer the kernel
cannot compute: then only reference vs stock was checked), FAIL otherwise.
What is checked: reference vs stock mlx-lm (bit-exact on the CPU backend) and kernel
vs reference within `tolerance` (rtol 1e-4 float32, 5e-3 float16, 3e-2 bfloat16 of
the output's largest magnitude): the kernel is close to, not bit-identical with, stock.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from mlx_lm.models.switch_layers import SwiGLU

from metal.dedup_verify import (
    grouped_metal,
    group_by_expert,
    kernel_unsupported,
    max_error,
    moe_verify_reference,
    tolerance,
    weights_from_slab,
    window_stats,
)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
ROUTINGS = ("random", "overlap", "skewed")


def random_slab(n_slots: int, d_model: int, hidden: int, *, bits: int, group_size: int, dtype: mx.Dtype,
                seed: int = 0) -> dict[str, mx.array]:
    """Quantized expert slabs with random codes, laid out as the expert cache holds them.

    Scales and biases centre each group's codes on zero with a std near 1/sqrt(in), so
    activations keep a sane magnitude through gate, up and down.
    """
    rng = np.random.default_rng(seed)
    slab = {}
    for proj, (out_dims, in_dims) in {"gate_proj": (hidden, d_model), "up_proj": (hidden, d_model),
                                      "down_proj": (d_model, hidden)}.items():
        levels = (1 << bits) - 1
        codes = rng.integers(0, 1 << 32, (n_slots, out_dims, in_dims * bits // 32), dtype=np.uint32)
        slab[f"{proj}.weight"] = mx.array(codes)
        scales = mx.array(rng.uniform(0.5, 1.5, (n_slots, out_dims, in_dims // group_size)).astype(np.float32))
        scales = scales * (2.0 * math.sqrt(3.0 / in_dims) / levels)
        slab[f"{proj}.scales"] = scales.astype(dtype)
        slab[f"{proj}.biases"] = (-scales * levels / 2).astype(dtype)
    mx.eval(slab)
    return slab


def stock_switch_glu(slab: dict[str, mx.array], *, group_size: int, bits: int, mode: str = "affine") -> SwitchGLU:
    """A stock mlx-lm SwitchGLU whose QuantizedSwitchLinears are the slabs (the path to match)."""
    d_model = slab["gate_proj.scales"].shape[-1] * group_size
    hidden = slab["down_proj.scales"].shape[-1] * group_size
    glu = SwitchGLU(d_model, hidden, 1)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out_dims, in_groups = slab[f"{proj}.scales"].shape[1:]
        lin = QuantizedSwitchLinear(in_groups * group_size, out_dims, 1, bias=False, group_size=group_size,
                                    bits=bits, mode=mode)
        lin.weight, lin.scales, lin.biases = slab[f"{proj}.weight"], slab[f"{proj}.scales"], slab[f"{proj}.biases"]
        setattr(glu, proj, lin)
    glu.freeze()
    return glu


def make_routing(n_tokens: int, top_k: int, n_slots: int, kind: str, seed: int = 0,
                 skew: float = 1.3) -> tuple[np.ndarray, np.ndarray]:
    """(inds (T, k) uint32 distinct per token, scores (T, k) float32 summing to 1 per token).

    random: uniform over slots; overlap: every token picks from the same k + 1 slots;
    skewed: a router with fixed per-expert popularity (std `skew`) plus per-token noise,
    which is what real routing looks like (fewer unique experts than uniform); the
    default skew gives ~20.3 unique for 4 tokens x top-8 of 128 (published: 20.4;
    uniform: 28.8). Token t's choices do not depend on the window length.
    """
    if kind not in ROUTINGS:
        raise ValueError(f"routing kind {kind!r} is not one of {ROUTINGS}")
    if top_k > n_slots or (kind == "overlap" and top_k + 1 > n_slots):
        raise ValueError(f"top_k {top_k} needs more slots than {n_slots}")
    rng = np.random.default_rng(seed)
    if kind == "random":
        inds = np.stack([rng.permutation(n_slots)[:top_k] for _ in range(n_tokens)])
    elif kind == "overlap":
        pool = rng.permutation(n_slots)[: top_k + 1]
        inds = np.stack([rng.permutation(pool)[:top_k] for _ in range(n_tokens)])
    else:
        logits = rng.normal(0.0, skew, n_slots)[None, :] + rng.normal(0.0, 1.0, (n_tokens, n_slots))
        inds = np.argsort(-logits, axis=-1)[:, :top_k]
    raw = rng.uniform(0.5, 1.5, inds.shape)
    return inds.astype(np.uint32), (raw / raw.sum(-1, keepdims=True)).astype(np.float32)


def median_ms(fn, *, warmup: int = 1, trials: int = 5) -> float:
    """Median wall time of mx.eval(fn()) in milliseconds."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclass(frozen=True)
class SelfCheckConfig:
    tokens: int = 4  # T: tokens in the verify window (K drafted + 1)
    top_k: int = 8  # experts per token
    d_model: int = 2048  # D (hidden size)
    hidden: int = 768  # H (expert intermediate size)
    n_slots: int = 32  # cache slots in the slab
    bits: int = 4  # weight bits
    group_size: int = 64  # quantization group
    dtype: str = "bfloat16"  # activations (and scales unless scale_dtype is set)
    scale_dtype: str | None = None  # scales and biases; None: dtype
    routing: str = "skewed"  # random | overlap | skewed
    trials: int = 5  # timed runs per variant (median reported)
    seed: int = 0

    def __post_init__(self):
        for name in ("tokens", "top_k", "d_model", "hidden", "n_slots", "trials"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES or self.scale_dtype not in (*DTYPES, None):
            raise ValueError(f"dtype {self.dtype!r} / scale_dtype {self.scale_dtype!r}: expected one of {sorted(DTYPES)}")
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8, got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size}")
        for name in ("d_model", "hidden"):
            if getattr(self, name) % self.group_size or getattr(self, name) * self.bits % 32:
                raise ValueError(f"{name} {getattr(self, name)} must be a multiple of group_size {self.group_size}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r} is not one of {ROUTINGS}")
        if self.top_k + (self.routing == "overlap") > self.n_slots:
            raise ValueError(f"top_k {self.top_k} needs more than n_slots {self.n_slots}")


@dataclass
class SelfCheckReport:
    config: SelfCheckConfig  # what was checked
    device: str  # MLX default device
    metal_available: bool  # mx.metal.is_available()
    versions: dict[str, str]  # mlx, mlx-lm, python, platform
    n_pairs: int  # T * k
    n_unique: int  # unique slots among them
    reference_error: float  # max |reference - stock|
    reference_tolerance: float  # what the reference may differ by (0 expected on CPU)
    kernel_status: str  # "ok", "mismatch", "error: ...", or "skipped: ..."
    kernel_error: float | None = None  # max |kernel - reference| when the kernel ran
    kernel_tolerance: float | None = None
    timings_ms: dict[str, float | None] = field(default_factory=dict)  # stock, reference, kernel: medians

    max_group_rows: int = 0  # most pairs routed to one expert (> ROWS: the kernel re-walks weights)

    @property
    def passed(self) -> bool:
        """No comparison that ran exceeded its tolerance (a skipped kernel is not a failure)."""
        kernel_fine = self.kernel_status == "ok" or self.kernel_status.startswith("skipped")
        return self.reference_error <= self.reference_tolerance and kernel_fine

    @property
    def status(self) -> str:
        """PASS (kernel ran and matched), SKIPPED (kernel not run; reference vs stock held), or FAIL."""
        if not self.passed:
            return "FAIL"
        return "PASS" if self.kernel_status == "ok" else "SKIPPED"

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"], d["status"] = self.passed, self.status
        return d


def _gpu_name() -> str:
    if not mx.metal.is_available():
        return "none"
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return f"{info.get('architecture', '?')}, {info.get('memory_size', 0) / 2**30:.0f} GB"
    except Exception:  # the name is decoration; never fail the check over it
        return "Metal (unnamed)"


def run_selfcheck(config: SelfCheckConfig) -> SelfCheckReport:
    dtype = DTYPES[config.dtype]
    q = dict(group_size=config.group_size, bits=config.bits)
    slab = random_slab(config.n_slots, config.d_model, config.hidden, dtype=DTYPES[config.scale_dtype or config.dtype],
                       seed=config.seed, **q)
    switch = stock_switch_glu(slab, **q)
    ids, raw_scores = make_routing(config.tokens, config.top_k, config.n_slots, config.routing, config.seed)
    inds, scores = mx.array(ids)[None], mx.array(raw_scores)[None]  # (1, T, k): a batch of one, as models call it
    x = mx.random.normal((1, config.tokens, config.d_model), key=mx.random.key(config.seed + 1)).astype(dtype)

    def stock():
        return (switch(x, inds) * scores[..., None]).sum(axis=-2)

    def reference():
        return moe_verify_reference(x, inds, scores, slab, **q)

    want, ref = stock(), reference()
    n_pairs, n_unique = window_stats(ids)
    report = SelfCheckReport(
        config=config, device=str(mx.default_device()), metal_available=mx.metal.is_available(),
        versions={"mlx": mx.__version__, "mlx-lm": mlx_lm.__version__, "python": platform.python_version(),
                  "platform": platform.platform(), "gpu": _gpu_name()},
        n_pairs=n_pairs, n_unique=n_unique, reference_error=max_error(ref, want),
        reference_tolerance=tolerance(want, dtype), kernel_status="skipped: no Metal device on this machine",
        max_group_rows=int(np.bincount(ids.reshape(-1)).max()),
    )
    unsupported = kernel_unsupported(weights_from_slab(slab, **q), SwiGLU())
    if unsupported is not None:
        report.kernel_status = f"skipped: the kernel cannot run this layer ({unsupported}); verify uses the reference"
    timings = {"stock": median_ms(stock, trials=config.trials), "reference": median_ms(reference, trials=config.trials),
               "kernel": None}
    if report.metal_available and unsupported is None:
        weights = weights_from_slab(slab, **q)
        grouping = group_by_expert(inds)
        x2d = x.reshape(-1, config.d_model)

        def kernel():
            y = grouped_metal(x2d, grouping, weights)[grouping.inv_order].reshape(*inds.shape, config.d_model)
            return (y * scores[..., None]).sum(axis=-2)

        try:
            got = kernel()
            mx.eval(got)
            report.kernel_error, report.kernel_tolerance = max_error(got, ref), tolerance(ref, dtype)
            report.kernel_status = "ok" if report.kernel_error <= report.kernel_tolerance else "mismatch"
            timings["kernel"] = median_ms(kernel, trials=config.trials)
        except Exception as e:  # the report must say what broke, not crash
            report.kernel_status = f"error: {e!r}"
    report.timings_ms = timings
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def format_report(report: SelfCheckReport) -> str:
    """A fixed-width, pasteable report (for an issue or a PR)."""
    c, t = report.config, report.timings_ms
    ref_note = "0 (bit-exact)" if report.reference_error == 0 else f"{report.reference_error:.3g}"
    if report.kernel_error is None:
        kernel_line = report.kernel_status
    else:
        kernel_line = f"max error {report.kernel_error:.3g}  (tolerance {report.kernel_tolerance:.3g})  {report.kernel_status}"
    versions = report.versions
    lines = [
        "specmoe selfcheck: dedup verify (kernel vs reference vs stock SwitchGLU)",
        f"device               {report.device}  (Metal: {versions['gpu'] if report.metal_available else 'not available'})",
        f"versions             mlx {versions['mlx']}, mlx-lm {versions['mlx-lm']}, python {versions['python']}",
        f"platform             {versions['platform']}",
        f"shapes               T={c.tokens} tokens x top-{c.top_k} of {c.n_slots} slots; D={c.d_model}, H={c.hidden}; "
        f"{c.bits}-bit, group {c.group_size}; {c.dtype}"
        f"{f' activations, {c.scale_dtype} scales' if c.scale_dtype else ''}; {c.routing} routing",
        f"window               {report.n_pairs} pairs, {report.n_unique} unique experts, "
        f"at most {report.max_group_rows} rows per expert",
        f"reference vs stock   max error {ref_note}  (tolerance {report.reference_tolerance:.3g})",
        f"kernel vs reference  {kernel_line}",
        f"{f'timings (median/{c.trials})':<21}stock {_ms(t.get('stock'))}   reference {_ms(t.get('reference'))}   "
        f"kernel {_ms(t.get('kernel'))}",
        f"result               {report.status}"
        + ("  (the kernel did not run: nothing about it was checked)" if report.status == "SKIPPED" else ""),
    ]
    return "\n".join(lines)


def coverage_configs(config: SelfCheckConfig) -> dict[str, SelfCheckConfig]:
    """Small cases for the shapes the kernel treats differently, at `config`'s bits and group size."""
    base = dict(d_model=256, hidden=128, bits=config.bits, group_size=config.group_size, trials=1, seed=config.seed)
    return {
        "groups over 8 rows": SelfCheckConfig(tokens=12, top_k=4, n_slots=8, routing="overlap", dtype="float32", **base),
        "window under 8 pairs": SelfCheckConfig(tokens=2, top_k=3, n_slots=8, routing="random", dtype="float32", **base),
        "float16": SelfCheckConfig(tokens=4, top_k=4, n_slots=16, routing="skewed", dtype="float16", **base),
        "float32 x, bf16 scales": SelfCheckConfig(tokens=4, top_k=4, n_slots=16, routing="skewed", dtype="float32",
                                                  scale_dtype="bfloat16", **base),
    }


def run_coverage(config: SelfCheckConfig) -> dict[str, SelfCheckReport]:
    return {name: run_selfcheck(c) for name, c in coverage_configs(config).items()}


def overall_result(reports) -> str:
    """FAIL if any report failed, else SKIPPED if any kernel did not run, else PASS."""
    results = {r.status for r in reports}
    return "FAIL" if "FAIL" in results else "SKIPPED" if "SKIPPED" in results else "PASS"


def format_coverage(reports: dict[str, SelfCheckReport]) -> str:
    lines = ["coverage (D=256, H=128):",
             f"  {'case':<24}{'pairs':>6}{'rows/expert':>12}  {'reference vs stock':<22}kernel vs reference"]
    for name, r in reports.items():
        ref = "0 (bit-exact)" if r.reference_error == 0 else f"{r.reference_error:.3g} (tol {r.reference_tolerance:.3g})"
        kernel = r.kernel_status if r.kernel_error is None else f"{r.kernel_error:.3g} (tol {r.kernel_tolerance:.3g}) {r.kernel_status}"
        lines.append(f"  {name:<24}{r.n_pairs:>6}{r.max_group_rows:>12}  {ref:<22}{kernel}")
    return "\n".join(lines)
