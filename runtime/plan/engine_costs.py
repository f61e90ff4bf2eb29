"""Engine costs: how an engine's code turns one forward into host syncs, command buffers and repairs.

Cost model v2 prices the fixed (non-byte) part of a forward from what the engine's code does, not
from one fitted per-layer number:

    sync     = (syncs per forward + syncs per MoE layer x MoE layers + routed layers) x sync_us
    buffers  = command buffers per MoE layer x MoE layers x command_buffer_us
    layers   = MoE layers x layer_us                      (the one fitted constant: kernel dispatch and
                                                           small-kernel time the byte roofline misses)
    repairs  = repairs per forward x (sync_us + repair_fraction x the forward's compute)

The counts follow the budget as the engine's code does (its default, `one_sync="auto"`, docs/flags.md): with every
expert of every MoE layer cached, a forward is one device pass (one host sync, plus one per repair);
below that, a one-token decode forward syncs once per MoE layer plus once for the token
(`partial_syncs_per_layer`), and a verify window stays a device pass whose layers that keep missing
sync their routing before their experts run (`routed_windows`; runtime/decode/window_routes.py's rule,
`window_syncs`), so a miss there costs its read and no repair.

Prices, with sources (shared/reference/peers-and-limits-2026.md):
- a CPU<->GPU crossing costs ~180 us with MLX's default fence and ~4 us with MLX_METAL_FAST_SYNCH=1
  (ml-explore/mlx#4438); `specmoe doctor` measures both on the machine at hand;
- a command-buffer boundary costs ~20 us of GPU time (ml-explore/mlx#4521).

Invariants: every price is >= 0; every term that is an assumption rather than a count from the
code or a measurement is named in `EngineProfile.assumed`, and the plan prints those names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from runtime.decode import ROUTE_REPAIR_EXTRA as REPAIR_EXTRA, ROUTE_SYNC_COST as SYNC_COST

__all__ = [
    "MLX_DEFAULT_FENCE_US", "MLX_FAST_SYNCH_US", "COMMAND_BUFFER_US", "DEFAULT_LAYER_US",
    "EngineProfile", "EngineOverhead", "specmoe_engine", "engine_overhead", "expected_repairs",
    "window_routes",
]

MLX_DEFAULT_FENCE_US = 180.0  # ml-explore/mlx#4438: one CPU<->GPU crossing with the default fence
MLX_FAST_SYNCH_US = 4.0  # ml-explore/mlx#4438: the same crossing with MLX_METAL_FAST_SYNCH=1
COMMAND_BUFFER_US = 20.0  # ml-explore/mlx#4521: GPU time per command-buffer boundary
# Fitted by bench/validate_planner.py: model A, one constant for every engine, the fit with the lowest
# median leave-one-out error over all 27 published rows (34.6%); re-run the bench and paste its
# fit_A_all_rows["layer_us"] value here when the rows or the model change.
DEFAULT_LAYER_US = 693.0


@dataclass(frozen=True)
class EngineProfile:
    name: str  # e.g. "specmoe (one_sync auto)"
    syncs_per_forward: float = 1.0  # host syncs of one forward whatever its depth (token read-back)
    syncs_per_layer: float = 0.0  # more host syncs per MoE layer per forward (per-layer routing read-back)
    command_buffers_per_layer: float = 2.0  # command-buffer boundaries per MoE layer per forward
    repairs_per_token: float | None = None  # measured repairs per forward; None: expected_repairs()
    repair_fraction: float = 0.5  # share of a forward's compute one repair re-runs
    sync_us: float = MLX_DEFAULT_FENCE_US  # price of one host sync
    command_buffer_us: float = COMMAND_BUFFER_US  # price of one command-buffer boundary
    layer_us: float = DEFAULT_LAYER_US  # fixed GPU time per MoE layer per forward (fitted)
    # Below a full budget (some MoE layer cannot hold every expert): host syncs per MoE layer of a one-token
    # decode forward (None: as at a full budget), and whether a verify window routes its missing layers.
    partial_syncs_per_layer: float | None = None
    routed_windows: bool = False
    assumed: tuple[str, ...] = field(default=(), compare=False)  # terms that are assumptions, for the plan

    def __post_init__(self) -> None:
        for name in ("syncs_per_forward", "syncs_per_layer", "command_buffers_per_layer", "sync_us",
                     "command_buffer_us", "layer_us") + (("partial_syncs_per_layer",) if self.partial_syncs_per_layer
                                                         is not None else ()):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"EngineProfile.{name} must be >= 0, got {value!r}")
        if self.repairs_per_token is not None and not self.repairs_per_token >= 0:
            raise ValueError(f"--repairs-per-token must be >= 0, got {self.repairs_per_token!r}")
        if not 0 <= self.repair_fraction <= 1:
            raise ValueError(f"repair_fraction must be in [0, 1], got {self.repair_fraction!r}")

    def with_measured(self, *, sync_us: float | None = None, syncs_per_token: float | None = None,
                      repairs_per_token: float | None = None,
                      syncs_per_layer: float | None = None) -> "EngineProfile":
        """This profile with measured values replacing assumed ones (None keeps the current value).

        `syncs_per_token` is for the model being planned (its repairs' syncs included);
        `syncs_per_layer` is the per-MoE-layer share measured on another model (doctor's embedded
        pair), which carries over to a model of different depth. A measured count holds at every
        budget: it replaces the code's budget-dependent counts."""
        assumed = list(self.assumed)
        changes: dict = {}
        if sync_us is not None:
            changes["sync_us"] = sync_us
            assumed = [a for a in assumed if not a.startswith("sync price")]
        if syncs_per_token is not None:
            # Measured syncs include the repairs' syncs; the rest are the forward's own.
            repairs = repairs_per_token if repairs_per_token is not None else (self.repairs_per_token or 0.0)
            changes["syncs_per_forward"] = max(0.0, syncs_per_token - repairs)
            changes["syncs_per_layer"] = 0.0
        elif syncs_per_layer is not None:
            changes["syncs_per_forward"] = 1.0
            changes["syncs_per_layer"] = max(0.0, syncs_per_layer)
        if syncs_per_token is not None or syncs_per_layer is not None:
            changes.update(partial_syncs_per_layer=None, routed_windows=False)
        if repairs_per_token is not None:
            changes["repairs_per_token"] = repairs_per_token
            assumed = [a for a in assumed if not a.startswith("repairs")]
        return replace(self, assumed=tuple(assumed), **changes)


ONE_SYNC_SYNCS = {
    "auto": "1 per forward at a full budget; below it 1 per MoE layer + 1 per token, and verify windows sync the "
            "routing of the layers whose misses make it pay (each layer missing alike)",
    "on": "1 per forward at every budget, plus 1 per repair",
    "off": "1 per MoE layer + 1 per token at every budget",
}


def specmoe_engine(*, fast_synch: bool = False, repairs_per_token: float | None = None,
                   layer_us: float = DEFAULT_LAYER_US, one_sync: str = "auto") -> EngineProfile:
    """This project's engine under `one_sync` (runtime.api.load's; default auto): at a full budget one host sync per forward
    plus one per repair (the expert lookup runs on the device); below it one sync per MoE layer plus one
    for the token, and verify windows as device passes that sync the routing of the layers that keep
    missing. "on" prices device passes at every budget, "off" per-layer syncs at every budget."""
    if one_sync not in ONE_SYNC_SYNCS:
        raise ValueError(f"one_sync {one_sync!r}; expected auto, on or off")
    assumed = [
        f"sync price {'fast-synch' if fast_synch else 'default fence'} from ml-explore/mlx#4438, not measured here "
        "(run `specmoe doctor` on the Mac and pass --from-doctor)",
        "command buffers: 2 per MoE layer (MLX's op/MB limits per buffer; not counted on a Mac)",
        f"layer time {layer_us:.0f} us per MoE layer: fitted to 27 published runs of five engine kinds "
        "(leave-one-out median error 35%, 28% for one-graph engines; docs/planner.md)",
        "repair re-runs half a forward (first missing layer uniform over depth)",
        f"host syncs as one_sync {one_sync}: {ONE_SYNC_SYNCS[one_sync]}",
    ]
    if repairs_per_token is None:
        assumed.append("repairs per forward: one per forward with any absent expert (not measured)")
    return EngineProfile(
        name=f"specmoe (one_sync {one_sync})", syncs_per_forward=1.0, syncs_per_layer=float(one_sync == "off"),
        command_buffers_per_layer=2.0, repairs_per_token=repairs_per_token, repair_fraction=0.5,
        sync_us=MLX_FAST_SYNCH_US if fast_synch else MLX_DEFAULT_FENCE_US, layer_us=layer_us,
        partial_syncs_per_layer=1.0 if one_sync == "auto" else None, routed_windows=one_sync == "auto",
        assumed=tuple(assumed),
    )


def expected_repairs(miss_share: float, expert_reads: float) -> float:
    """Repairs of one forward when none was measured: the chance it meets at least one absent expert.

    `miss_share` is the share of expert reads not already in the cache, `expert_reads` the distinct
    (layer, expert) reads of the forward. One repair reads every flagged expert at once, so a forward
    with any miss is counted as one repair (a lower bound when a repair's new routing misses again).
    """
    if not 0 <= miss_share <= 1 or expert_reads < 0:
        raise ValueError(f"miss share must be in [0, 1] and reads >= 0, got {miss_share!r}, {expert_reads!r}")
    return 1.0 - (1.0 - miss_share) ** expert_reads


def window_routes(n_moe_layers: int, depth: int, layer_miss: float) -> int:
    """MoE layers a verify window routes by runtime/decode/window_routes.py's rule w (R + E + q) > q: w the
    chance the layer reads an absent expert in a window, R the decoder layers a repair from it recomputes
    (MoE layers spread evenly over `depth` decoder layers), E and q the engine's own constants."""
    if not 0 <= layer_miss <= 1:
        raise ValueError(f"layer miss chance must be in [0, 1], got {layer_miss!r}")
    routed = 0
    for i in range(n_moe_layers):
        tail = depth - i * depth / n_moe_layers
        routed += layer_miss * (tail + REPAIR_EXTRA + SYNC_COST) > SYNC_COST
    return routed


@dataclass(frozen=True)
class EngineOverhead:
    sync_ms: float  # host syncs of the forward itself
    command_buffer_ms: float  # command-buffer boundaries
    layer_ms: float  # fixed GPU time per MoE layer
    repairs: float  # repairs of this forward
    repair_ms: float  # their syncs and re-run compute
    host_syncs: float = 0.0  # host syncs of the forward itself (its repairs' not included)
    routed_layers: int = 0  # MoE layers a verify window syncs the routing of (below a full budget)

    @property
    def total_ms(self) -> float:
        return self.sync_ms + self.command_buffer_ms + self.layer_ms + self.repair_ms


def engine_overhead(engine: EngineProfile, n_moe_layers: int, compute_ms: float, miss_share: float,
                    expert_reads: float, *, full_budget: bool = True, window: bool = False,
                    depth: int | None = None) -> EngineOverhead:
    """Fixed costs of one forward over `n_moe_layers` whose byte/FLOP roofline is `compute_ms`.

    `full_budget`: the cache holds every expert of every MoE layer; `window`: the forward is a verify
    window (or its re-run), which the engine runs as a device pass at any budget; `depth`: decoder layers
    (default: the MoE layers), for where a repair restarts."""
    per_layer, routed = engine.syncs_per_layer, 0
    if not full_budget and not window and engine.partial_syncs_per_layer is not None:
        per_layer = engine.partial_syncs_per_layer
    if not full_budget and window and engine.routed_windows and n_moe_layers:
        layer_miss = 1.0 - (1.0 - miss_share) ** (expert_reads / n_moe_layers)
        routed = window_routes(n_moe_layers, depth or n_moe_layers, layer_miss)
    host_syncs = engine.syncs_per_forward + per_layer * n_moe_layers + routed
    sync_ms = host_syncs * engine.sync_us / 1000
    buffers_ms = engine.command_buffers_per_layer * n_moe_layers * engine.command_buffer_us / 1000
    layer_ms = n_moe_layers * engine.layer_us / 1000
    repairs = engine.repairs_per_token
    if repairs is None:
        # A routed layer reads its misses at its route sync; only the other layers' misses cost a repair.
        unrouted = expert_reads * (n_moe_layers - routed) / n_moe_layers if n_moe_layers else expert_reads
        repairs = expected_repairs(miss_share, unrouted) if per_layer == 0 else 0.0
    rerun_ms = engine.repair_fraction * (compute_ms + buffers_ms + layer_ms)
    repair_ms = repairs * (engine.sync_us / 1000 + rerun_ms)
    return EngineOverhead(sync_ms, buffers_ms, layer_ms, repairs, repair_ms, host_syncs, routed)
