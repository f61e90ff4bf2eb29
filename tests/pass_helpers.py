"""Test helpers for device passes (runtime/decode/device_pass.py): greedy decoding through one, and the
check that a finished pass left nothing pinned, held or in device mode."""

from __future__ import annotations

import mlx.core as mx

from runtime.decode import offloaded_generate_step
from runtime.decode.device_pass import DevicePass
from runtime.decode.warm import warm_start
from tests.conftest import PROMPT


def decode_through_pass(om, n: int, **pass_options) -> tuple[list[int], DevicePass]:
    """Greedy tokens of PROMPT through offloaded_generate_step with DevicePass(om, **pass_options), warm start."""
    warm_start(om)
    dp = DevicePass(om, **pass_options)
    gen = offloaded_generate_step(om, mx.array(om.tokenizer.encode(PROMPT)), max_tokens=n,
                                  sampler=lambda x: mx.argmax(x, axis=-1), device_pass=dp,
                                  after_prefill=om.cache.settle_inflight)
    return [t for t, _ in gen], dp


def pass_idle(om) -> bool:
    """Nothing pinned or held, no module left in device mode."""
    return (all((ls.pins == 0).all() and ls.held == 0 for ls in om.cache.table.layers.values())
            and all(m.device is None for m in om.modules.values()))


def watch_repairs(monkeypatch) -> list:
    """Record (layers found missing, layers the forward routed) at every sync of a DevicePass that finds absent
    experts (each one repaired)."""
    seen = []
    real = DevicePass._sync

    def sync(self, launch):
        missing = real(self, launch)
        if missing:
            seen.append((frozenset(missing), launch.routes))
        return missing

    monkeypatch.setattr(DevicePass, "_sync", sync)
    return seen
