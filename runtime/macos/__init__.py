"""runtime.macos: settings the engine applies on macOS only (wired limit, command buffers, fast-synch).

Invariant kept at this boundary: nothing here changes anything on another platform or without Metal;
every setting is switchable and carries its reason.
"""

from runtime.macos.settings import (
    SETTING_NAMES,
    MacSetting,
    apply_settings,
    last_doctor_path,
    load_last_doctor,
    parse_switches,
    plan_settings,
    wired_limit,
)

from runtime.macos.startup import apply_at_startup  # noqa: E402  (returns at once off macOS)

__all__ = ["apply_at_startup", "SETTING_NAMES", "MacSetting", "apply_settings", "last_doctor_path", "load_last_doctor",
           "parse_switches", "plan_settings", "wired_limit"]
