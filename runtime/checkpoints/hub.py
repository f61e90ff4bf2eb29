"""Model references as mlx-lm takes them: a local directory, or a Hugging Face Hub id.

`resolve_model("mlx-community/Qwen3-30B-A3B-4bit")` looks in the local Hugging Face cache first
(`HF_HUB_CACHE` / `HF_HOME`), then downloads with mlx-lm's own allow patterns when online.

Invariants: an existing local path is returned unchanged and never touches huggingface_hub. A
missing path that can only be a path (`./x`, `../x`, `/x`, `~/x`, `x/y/z`, a single name, a file name
such as `x.json`) is one ValueError "no such model directory" and never touches the hub. A missing
`owner/name` is read both ways: the local cache, then (online) a download; its error names both
readings. Offline (`HF_HUB_OFFLINE=1`) nothing is fetched and the error names the cache directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

__all__ = ["resolve_model", "looks_like_hub_id", "hub_offline", "HUB_ALLOW_PATTERNS"]

# Names that end like a file, never a model directory or a hub repository.
_FILE_SUFFIXES = (".json", ".safetensors", ".gguf", ".bin", ".npz", ".npy", ".pt", ".pth", ".txt", ".yaml", ".yml",
                  ".py", ".model", ".tar", ".gz", ".zip")

HUB_ALLOW_PATTERNS = list(DEFAULT_ALLOW_PATTERNS)  # what `mlx_lm.generate --model ID` fetches
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def looks_like_hub_id(ref: str) -> bool:
    """`owner/name` with hub-legal characters, not a relative path such as `./x` or `~/x`."""
    return (bool(_HUB_ID.match(ref)) and ".." not in ref and not ref.endswith(".git")
            and not ref.lower().endswith(_FILE_SUFFIXES)
            and not any(sep and sep != "/" and sep in ref for sep in (os.sep, os.altsep)))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, checked at call time (tests set it late)."""
    value = os.environ.get("HF_HUB_OFFLINE", "")
    if value.strip().lower() in ("1", "on", "yes", "true"):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model(ref: str | Path | None, flag: str = "--model") -> Path | None:
    """A local directory for `ref`: the path itself, or the hub snapshot (cached, else downloaded)."""
    if ref is None:
        return None
    path = Path(ref).expanduser()
    text = str(ref)
    if path.exists():
        return path
    if not looks_like_hub_id(text):
        raise ValueError(f"{flag} {text}: no such model directory: {path.absolute()} (expected an mlx-lm checkpoint directory, "
                         "a `specmoe convert` store, or a Hugging Face id owner/name)")
    from huggingface_hub import snapshot_download

    cache = _cache_dir()
    try:
        return Path(snapshot_download(text, local_files_only=True, allow_patterns=HUB_ALLOW_PATTERNS, cache_dir=cache))
    except Exception:  # not cached (LocalEntryNotFoundError and kin across huggingface_hub versions)
        pass
    if hub_offline():
        raise ValueError(f"{flag} {text}: no such model directory ./{text}, and as a Hugging Face id it is not in "
                         f"the cache {cache} while HF_HUB_OFFLINE is set; download it while online or pass an "
                         "existing directory")
    try:
        return Path(snapshot_download(text, allow_patterns=HUB_ALLOW_PATTERNS, cache_dir=cache))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{flag} {text}: could not download it from the Hugging Face Hub ({reason}), and there is "
                         f"no such model directory ./{text}") from None
