"""Applying the Mac settings when the `specmoe` command starts, before MLX creates its Metal device.

Order matters: environment settings (command buffers, fast-synch) are decided and set first, without
touching MLX; only then is MLX asked for the recommended working set and the wired limit raised.

Invariant: on any platform but macOS this returns at once and imports nothing.
"""

from __future__ import annotations

import sys

from runtime.macos.settings import MacSetting, apply_settings, load_last_doctor, parse_switches, plan_settings

__all__ = ["apply_at_startup"]


def apply_at_startup(switch_text: str | None, platform: str = sys.platform) -> tuple[list[MacSetting], list[str]]:
    """Decide and apply the Mac settings for this process; returns (decisions, what was applied)."""
    switches = parse_switches(switch_text)  # a bad switch is refused on every platform
    if platform != "darwin":
        return plan_settings(platform=platform, metal=False, working_set_bytes=None, doctor=None,
                             switches=switches), []
    doctor = load_last_doctor()
    env_only = plan_settings(platform=platform, metal=True, working_set_bytes=None, doctor=doctor, switches=switches)
    done = apply_settings([s for s in env_only if s.name != "wired_limit"], platform=platform)
    import mlx.core as mx

    metal = bool(mx.metal.is_available())
    working_set = mx.metal.device_info().get("max_recommended_working_set_size") if metal else None
    decisions = plan_settings(platform=platform, metal=metal, working_set_bytes=working_set, doctor=doctor,
                              switches=switches)
    done += apply_settings([s for s in decisions if s.name == "wired_limit"], platform=platform)
    return decisions, done
