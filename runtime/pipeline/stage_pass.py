"""StagePass: a stage's forward as one device pass (runtime.decode.DevicePass) -- one host sync and repairs.

Without it, every MoE layer of a stage reads its router's ids back to the host (one sync per
MoE layer per window). With it, a window whose experts fit each layer's usable slots looks its
experts up on the device and the stage syncs once (its output and every layer's lookup codes in
one array); an absent expert is read and the stage recomputed from the first layer that missed
(a repair). Its forwards route as one process's verify windows do (runtime/decode/window_routes.py): a layer
whose slots cannot hold every expert and whose recent misses make it pay syncs its lookup codes before its experts
run and reads what is absent there, so a miss costs its read and no recompute. A window too large for a
layer's slots (a prefill chunk) takes that layer's synced call, which runs expert-major
(runtime/cache/expert_major.py: each unique expert read once).

DevicePass drives an offloaded model through a small interface; `StagePassHost` is that
interface for one stage: its cache, its modules, its layers (replayable from any of them), and
MoE layer -> index in the stage's own cache list.

Invariants: the stage's output equals the synced path's (DevicePass returns a forward only when
every routed expert it read was resident: same slots, kernels and weights); `host_syncs` counts
every host sync the stage's forwards made (device-pass syncs and synced layer calls), as the
cache's own counter does.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.decode import DevicePass, LayerReplay


@dataclass
class StagePassHost:
    cache: object  # the stage's ExpertCache
    modules: dict  # MoE layer -> CachedSwitchGLU
    replay: LayerReplay  # over the stage's decoder layers, in cache order
    decoder_index: dict  # MoE layer -> index in the stage's layers and cache list
    top_k: int
    telemetry: object = None


def stage_pass(cache, modules: dict, layers: list, layer_ids: list[int], top_k: int,
               route_windows: bool = True) -> DevicePass | None:
    """A DevicePass over this stage's layers, or None when the stage has no MoE layer. route_windows: its forwards (one
    token, or a verify window) route the layers whose misses make a sync pay, by the rates of one process's verify
    windows; False: one sync and repairs."""
    if cache is None or not modules:
        return None
    first = layer_ids[0]
    host = StagePassHost(cache, modules, LayerReplay(layers), {l: l - first for l in modules}, top_k)
    # Routed layers sync before their experts (window_routes.py), the rest wait for the forward's one sync; the
    # rates carry on the host from forward to forward.
    dp = DevicePass(host)
    dp.route_windows = route_windows
    return dp
