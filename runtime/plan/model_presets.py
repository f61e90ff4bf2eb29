"""Model presets: the config.json fields of well-known MoE models, with their sources.

`data/model_presets.json` holds, per preset, the HF config fields the cost model reads, where they
came from and the reference figures they must reproduce; plus aliases and published
(cache share, hit rate) observations the planner's hit-rate prior is fitted to.
`load_model_config(name_or_path)` resolves a preset name, an alias or a config.json path.

Invariants: a name that is neither a preset nor a readable JSON object file raises ValueError naming
the flag and what was expected; nothing here downloads.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["preset_names", "preset", "hit_rate_observations", "load_model_config"]

_PRESETS_PATH = Path(__file__).parent.parent / "data" / "model_presets.json"


@lru_cache(maxsize=1)
def _presets() -> dict[str, Any]:
    with open(_PRESETS_PATH, encoding="utf-8") as handle:
        return json.load(handle)


def preset_names() -> list[str]:
    """Canonical preset names (aliases excluded)."""
    return sorted(_presets()["presets"])


def preset(name: str) -> dict[str, Any]:
    """The preset record (display_name, source, reference, config) for a name or alias."""
    key = name.strip().lower()
    key = _presets()["aliases"].get(key, key)
    try:
        return _presets()["presets"][key]
    except KeyError:
        raise ValueError(
            f"--model {name!r} is neither a preset ({', '.join(preset_names())}) "
            f"nor an existing config.json path"
        ) from None


def hit_rate_observations() -> list[dict[str, Any]]:
    """Published (cache_fraction, hit_rate) points with their sources."""
    return list(_presets()["hit_rate_observations"]["points"])


def load_model_config(name_or_path: str) -> tuple[str, dict[str, Any], str]:
    """(display name, config dict, source) for a preset name or a config.json file/directory."""
    path = Path(name_or_path).expanduser()
    looks_like_path = path.suffix == ".json" or "/" in name_or_path or path.exists()
    if not looks_like_path:
        record = preset(name_or_path)
        return record["display_name"], record["config"], record["source"]
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {name_or_path!r}: no such file {str(path)!r} (expected a config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--model {str(path)!r} is not a readable JSON config: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {str(path)!r} must hold a JSON object, got {type(config).__name__}")
    return path.parent.name or str(path), config, str(path)
