"""Layouts of routed experts: what one expert of one layer consists of.

mlx-lm stores a MoE layer's experts stacked: `<prefix>.{gate,up,down}_proj.{weight,
scales,biases,bias}` with a leading expert dimension E, where <prefix> is the expert
module's path (`...mlp.switch_mlp` for most families, `...mlp.experts` for gpt-oss).
A projection is stacked when its weight has 3 dimensions ([E, out, in or packed in]);
the 2-D gate/up/down projections of dense layers and shared experts stay resident.
`scales` without `biases` is a quantization mode without offsets (mxfp4); `bias` is
the linear bias (gpt-oss). Expert e's slice of each tensor is one contiguous byte
range, so an expert is a fixed list of per-expert tensors.

Invariants: `tensors` has a fixed order (projection, then weight/scales/biases/bias)
shared by the raw reader, the packed records and the cache slabs; every tensor's
nbytes is prod(shape) * itemsize; `expert_bytes` is their sum.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from storage.errors import StoreError
from storage.safetensors_header import DTYPE_ITEMSIZE, TensorEntry

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases", "bias")
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|scales|biases|bias)$")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
_UNSTACKED = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class ExpertTensor:
    name: str  # "<proj>.<part>", e.g. "gate_proj.scales"
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]  # shape of one expert's slice (the stacked shape without E)
    nbytes: int  # bytes of one expert's slice


@dataclass(frozen=True)
class QuantSpec:
    group_size: int  # elements per quantization group
    bits: int  # bits per quantized element
    mode: str  # mlx quantization mode ("affine", "mxfp4", ...)


@dataclass(frozen=True)
class LayerLayout:
    layer: int  # decoder-layer index
    prefix: str  # full module path of the stacked experts, e.g. "model.layers.3.mlp.switch_mlp" or "...mlp.experts"
    n_experts: int  # E
    tensors: tuple[ExpertTensor, ...]  # per-expert tensors in canonical order
    quant: dict[str, QuantSpec | None]  # projection -> quantization (None: unquantized)

    @property
    def expert_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor_names(self) -> list[str]:
        return [f"{self.prefix}.{t.name}" for t in self.tensors]

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "prefix": self.prefix,
            "n_experts": self.n_experts,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
                for t in self.tensors
            ],
            "quant": {
                p: (None if q is None else {"group_size": q.group_size, "bits": q.bits, "mode": q.mode})
                for p, q in self.quant.items()
            },
        }

    @classmethod
    def from_json(cls, d: dict) -> "LayerLayout":
        tensors = tuple(
            ExpertTensor(t["name"], t["dtype"], tuple(int(s) for s in t["shape"]), int(t["nbytes"]))
            for t in d["tensors"]
        )
        quant = {p: (None if q is None else QuantSpec(int(q["group_size"]), int(q["bits"]), q["mode"])) for p, q in d["quant"].items()}
        return cls(int(d["layer"]), d["prefix"], int(d["n_experts"]), tensors, quant)


def canonical_order(names: list[str]) -> list[str]:
    """Sort '<proj>.<part>' names by projection then part, the order of every record."""
    return sorted(names, key=lambda n: (PROJECTIONS.index(n.split(".")[0]), PARTS.index(n.split(".")[1])))


def _quant_spec(path, prefix: str, proj: str, parts: dict[str, TensorEntry], config: dict) -> QuantSpec | None:
    if "scales" not in parts:
        return None
    q = config.get("quantization") or {}
    override = q.get(f"{prefix}.{proj}")
    q = override if isinstance(override, dict) else q
    group_size, bits, mode = q.get("group_size"), q.get("bits"), q.get("mode", "affine")
    if not isinstance(group_size, int) or not isinstance(bits, int):
        raise StoreError(path, "expert tensors have scales but config.json has no quantization {group_size, bits}", tensor=f"{prefix}.{proj}.scales")
    w, s = parts["weight"], parts["scales"]
    in_from_weight = w.shape[-1] * 32 // bits
    in_from_scales = s.shape[-1] * group_size
    if in_from_weight != in_from_scales or w.shape[:-1] != s.shape[:-1]:
        raise StoreError(
            path,
            f"weight {list(w.shape)} and scales {list(s.shape)} disagree with {bits}-bit group {group_size} quantization",
            tensor=f"{prefix}.{proj}",
        )
    if "biases" in parts and parts["biases"].shape != s.shape:
        raise StoreError(path, f"biases {list(parts['biases'].shape)} do not match scales {list(s.shape)}", tensor=f"{prefix}.{proj}.biases")
    return QuantSpec(group_size, bits, mode)


def _stacked(where, prefix: str, projs: dict[str, dict[str, TensorEntry]]) -> bool:
    """Whether the gate/up/down projections under `prefix` are stacked experts (3-D weights)."""
    dims = {proj: len(parts["weight"].shape) for proj, parts in projs.items() if "weight" in parts}
    stacked = {proj for proj, d in dims.items() if d == 3}
    if stacked and len(stacked) != len(dims):
        raise StoreError(where, f"projections {sorted(dims)} mix stacked (3-D) and unstacked weights", tensor=prefix)
    if not dims:  # scales or biases without any weight: only a stacked block can be named by them
        return any(len(e.shape) == 3 for parts in projs.values() for e in parts.values())
    return bool(stacked)


def discover_layouts(entries: dict[str, tuple[str, TensorEntry]], config: dict, where) -> dict[int, LayerLayout]:
    """Find every stacked expert tensor among `entries` (name -> (file, entry)).

    Returns layer -> LayerLayout. Raises StoreError for unstacked (per-expert)
    checkpoints, inconsistent expert counts and missing projections.
    """
    if any(_UNSTACKED.search(n) for n in entries):
        example = next(n for n in entries if _UNSTACKED.search(n))
        raise StoreError(where, "experts are stored one tensor per expert (Hugging Face layout); convert with mlx_lm.convert first so they are stacked", tensor=example)
    groups: dict[str, dict[str, dict[str, TensorEntry]]] = {}
    for name, (_, entry) in entries.items():
        m = _EXPERT_TENSOR.match(name)
        if m:
            groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[m["part"]] = entry
    groups = {p: projs for p, projs in groups.items() if _stacked(where, p, projs)}
    layouts: dict[int, LayerLayout] = {}
    for prefix, projs in groups.items():
        lm = _LAYER_INDEX.search(prefix + ".")
        if lm is None:
            raise StoreError(where, "cannot find a layer index in the expert tensor name", tensor=prefix)
        layer = int(lm.group(1))
        for proj in PROJECTIONS:
            if proj not in projs or "weight" not in projs[proj]:
                raise StoreError(where, f"missing expert tensor {proj}.weight", tensor=f"{prefix}.{proj}.weight")
        n_experts = {e.shape[0] if e.shape else -1 for parts in projs.values() for e in parts.values()}
        if len(n_experts) != 1 or min(n_experts) <= 0:
            raise StoreError(where, f"expert tensors disagree on the number of experts: {sorted(n_experts)}", tensor=prefix)
        (E,) = n_experts
        tensors = []
        for proj in PROJECTIONS:
            for part in PARTS:
                if part in projs[proj]:
                    e = projs[proj][part]
                    per = e.shape[1:]
                    tensors.append(ExpertTensor(f"{proj}.{part}", e.dtype, per, math.prod(per) * DTYPE_ITEMSIZE[e.dtype]))
        quant = {proj: _quant_spec(where, prefix, proj, projs[proj], config) for proj in PROJECTIONS}
        if config.get("quantization") or any(q is not None for q in quant.values()):
            for proj, q in quant.items():
                if q is None:
                    raise StoreError(where, f"missing expert tensor {proj}.scales (config.json says the model is quantized)", tensor=f"{prefix}.{proj}.scales")
        if layer in layouts:
            raise StoreError(where, f"two expert blocks claim layer {layer}", tensor=prefix)
        layouts[layer] = LayerLayout(layer, prefix, E, tuple(tensors), quant)
    return dict(sorted(layouts.items()))
