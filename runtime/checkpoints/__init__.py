"""runtime.checkpoints: model directories this package makes or ships.

Owns: tiny real-layout checkpoints built with mlx-lm's own model classes (`specmoe make-tiny`, the
test fixtures), the embedded trained pair shipped as package data, and weight fingerprints.

Also: resolving a model reference (a path, or a Hugging Face id through the local cache).

Invariants kept at this boundary: nothing here downloads except `resolve_model` for a hub id
missing from the local cache while online; a tiny checkpoint is written in the same
layout as an mlx-community conversion of its family.
"""

from runtime.checkpoints.embedded import EmbeddedPair, embedded_pair
from runtime.checkpoints.fingerprint import model_fingerprint
from runtime.checkpoints.hub import HUB_ALLOW_PATTERNS, hub_offline, looks_like_hub_id, resolve_model
from runtime.checkpoints.tiny import make_tiny

__all__ = [
    "EmbeddedPair", "embedded_pair", "model_fingerprint", "make_tiny", "HUB_ALLOW_PATTERNS", "hub_offline",
    "looks_like_hub_id", "resolve_model",
]
