"""Mac settings the engine applies: each switchable, each with its reason, and only on macOS with Metal.

- wired_limit: raise MLX's wired limit to the GPU's recommended working set for the process, as
  mlx-lm's `wired_limit` does around generation, so resident weights and the expert cache stay
  wired instead of being paged or compressed between tokens ([MH] reports +20% from a wired limit).
- command_buffers: raise MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER, so one forward is split into
  fewer command buffers; each boundary costs ~20 us of GPU time and raising both gave +5-7.7% on MoE
  decode, bit-identical (ml-explore/mlx#4521). The values are this module's assumption.
- fast_synch: MLX_METAL_FAST_SYNCH=1 makes a CPU<->GPU crossing ~4 us instead of ~180 us (mlx issue
  4438); on by default only where `specmoe doctor` measured that it pays on this Mac.

Switches: `SPECMOE_MAC_SETTINGS` (or `specmoe --mac-settings`): "auto" (default), "off", or a comma
list such as "fast_synch=on,wired_limit=off". Environment settings must exist before MLX creates its
Metal device, so the CLI applies them at start-up; an environment variable the user already set is
never overridden.

Invariants: `plan_settings` is pure (platform, Metal, doctor report and switches in; decisions out);
`apply_settings` touches nothing unless the platform is macOS and Metal is available; every decision,
applied or not, carries its reason.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, MutableMapping

__all__ = ["MacSetting", "SETTING_NAMES", "parse_switches", "plan_settings", "apply_settings", "wired_limit",
           "last_doctor_path", "load_last_doctor"]

SETTING_NAMES = ("wired_limit", "command_buffers", "fast_synch")
COMMAND_BUFFER_ENV = {"MLX_MAX_OPS_PER_BUFFER": "200", "MLX_MAX_MB_PER_BUFFER": "200"}  # assumption
FAST_SYNCH_ENV = "MLX_METAL_FAST_SYNCH"


@dataclass(frozen=True)
class MacSetting:
    name: str  # one of SETTING_NAMES
    apply: bool  # whether apply_settings will apply it
    action: str  # what applying does, e.g. "env MLX_METAL_FAST_SYNCH=1"
    reason: str  # why it is (or is not) applied


def parse_switches(text: str | None) -> dict[str, bool | None]:
    """"auto" / "off" / "name=on|off,..." -> {name: True/False/None (None = automatic)}."""
    switches: dict[str, bool | None] = {name: None for name in SETTING_NAMES}
    text = (text or "auto").strip().lower()
    if text == "auto":
        return switches
    if text == "off":
        return {name: False for name in SETTING_NAMES}
    for item in text.split(","):
        name, _, value = item.strip().partition("=")
        if name not in SETTING_NAMES or value not in ("on", "off", "auto"):
            raise ValueError(f"--mac-settings {text!r}: expected auto, off, or name=on|off|auto with names "
                             f"{', '.join(SETTING_NAMES)}")
        switches[name] = None if value == "auto" else value == "on"
    return switches


def plan_settings(*, platform: str, metal: bool, working_set_bytes: int | None, doctor: dict | None,
                  switches: dict[str, bool | None], environ: MutableMapping[str, str] | None = None) -> list[MacSetting]:
    """Which settings to apply, and why (pure)."""
    environ = os.environ if environ is None else environ
    if platform != "darwin" or not metal:
        why = "not macOS" if platform != "darwin" else "no Metal device"
        return [MacSetting(name, False, "none", f"{why}: Mac settings do not apply") for name in SETTING_NAMES]
    out = []
    if switches.get("wired_limit") is False:
        out.append(MacSetting("wired_limit", False, "none", "switched off"))
    elif not working_set_bytes:
        out.append(MacSetting("wired_limit", False, "none", "Metal reports no recommended working set"))
    else:
        out.append(MacSetting("wired_limit", True, f"mx.set_wired_limit({working_set_bytes})",
                              "keep weights and the expert cache wired, as mlx-lm's wired_limit does"))
    set_by_user = [k for k in COMMAND_BUFFER_ENV if k in environ]
    if switches.get("command_buffers") is False:
        out.append(MacSetting("command_buffers", False, "none", "switched off"))
    elif set_by_user:
        out.append(MacSetting("command_buffers", False, "none", f"{', '.join(set_by_user)} already set by the user"))
    else:
        action = "env " + " ".join(f"{k}={v}" for k, v in COMMAND_BUFFER_ENV.items())
        out.append(MacSetting("command_buffers", True, action,
                              "fewer command-buffer boundaries (~20 us each); +5-7.7% on MoE decode (ml-explore/mlx#4521)"))
    fast = switches.get("fast_synch")
    sync = (doctor or {}).get("host_sync") or {}
    pays = sync.get("fast_synch_pays")
    measured = (f"doctor measured {sync.get('default', {}).get('sync_us')} us default vs "
                f"{sync.get('fast_synch', {}).get('sync_us')} us fast-synch")
    if FAST_SYNCH_ENV in environ:
        out.append(MacSetting("fast_synch", False, "none", f"{FAST_SYNCH_ENV} already set by the user"))
    elif fast is False:
        out.append(MacSetting("fast_synch", False, "none", "switched off"))
    elif fast is True:
        out.append(MacSetting("fast_synch", True, f"env {FAST_SYNCH_ENV}=1", "switched on"))
    elif pays is True:
        out.append(MacSetting("fast_synch", True, f"env {FAST_SYNCH_ENV}=1", f"pays here: {measured}"))
    elif pays is False:
        out.append(MacSetting("fast_synch", False, "none", f"does not pay here: {measured}"))
    else:
        out.append(MacSetting("fast_synch", False, "none", "no doctor measurement yet: run `specmoe doctor`"))
    return out


def apply_settings(settings: list[MacSetting], *, platform: str, environ: MutableMapping[str, str] | None = None,
                   set_wired_limit=None) -> list[str]:
    """Apply the settings marked `apply` (macOS only); returns what was done. Environment variables are
    set only when absent; the wired limit through `set_wired_limit` (default: mx.set_wired_limit)."""
    if platform != "darwin":
        return []
    environ = os.environ if environ is None else environ
    done = []
    for setting in settings:
        if not setting.apply:
            continue
        if setting.action.startswith("env "):
            for pair in setting.action[4:].split():
                key, _, value = pair.partition("=")
                if key not in environ:
                    environ[key] = value
                    done.append(f"{key}={value}")
        elif setting.name == "wired_limit":
            if set_wired_limit is None:
                import mlx.core as mx

                set_wired_limit = mx.set_wired_limit
            limit = int(setting.action.split("(")[1].rstrip(")"))
            set_wired_limit(limit)
            done.append(f"wired limit {limit}")
    return done


@contextmanager
def wired_limit(limit_bytes: int | None = None) -> Iterator[None]:
    """mlx-lm's wired_limit for API users: raise the limit (default: the recommended working set) for
    the block and restore the old one after; does nothing without Metal."""
    import mlx.core as mx

    if not mx.metal.is_available():
        yield
        return
    limit = limit_bytes or mx.metal.device_info()["max_recommended_working_set_size"]
    old = mx.set_wired_limit(limit)
    try:
        yield
    finally:
        mx.synchronize()
        mx.set_wired_limit(old)


def last_doctor_path() -> Path:
    """Where `specmoe doctor` keeps its last report (SPECMOE_HOME, else ~/.cache/specmoe)."""
    home = os.environ.get("SPECMOE_HOME") or str(Path.home() / ".cache" / "specmoe")
    return Path(home) / "doctor-last.json"


def load_last_doctor() -> dict | None:
    try:
        report = json.loads(last_doctor_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and report.get("kind") == "specmoe-doctor" else None
