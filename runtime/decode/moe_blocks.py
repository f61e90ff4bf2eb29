"""MoE blocks of a loaded mlx-lm model, found from its module structure.

An expert module is any module with `gate_proj`, `up_proj` and `down_proj` children that
are mlx-lm SwitchLinear / QuantizedSwitchLinear (stacked [E, ...] weights) and an
`activation`: mlx-lm's SwitchGLU under whatever name the family gives it (`switch_mlp`,
gpt-oss's `experts`). Its parent is the MoE block, whose router is its `gate` (an
nn.Linear / QuantizedLinear, or DeepSeek/GLM's MoEGate with a raw `weight`) or `router`
(gpt-oss, a biased Linear); the parent's parent is the decoder layer, whose
`post_attention_layernorm` feeds the block.

Invariants: paths are the module paths that name the expert tensors in the checkpoint
(`<path>.gate_proj.weight`); a router's `logits` maps (..., D) to (..., E) scores whose
per-token ranking is the ranking the block's own top-k starts from (before any group
limit); they feed prefetch forecasts only, never the decoded output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from runtime.cache import check_expert_module
from storage import LayerLayout, StoreError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_expert_module(module) -> bool:
    """A SwitchGLU-like module: three stacked switch projections and an activation."""
    if not isinstance(module, nn.Module) or not hasattr(module, "activation"):
        return False
    return all(isinstance(module.get(p), (SwitchLinear, QuantizedSwitchLinear)) for p in PROJECTIONS)


def find_expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> expert module, for every SwitchGLU-like module of `model`."""
    return {path: m for path, m in model.named_modules() if is_expert_module(m)}


def match_expert_modules(model: nn.Module, layouts: dict[int, LayerLayout], where) -> dict[int, tuple[str, nn.Module]]:
    """MoE layer -> (path, stock expert module): the model's expert modules and the stored expert
    tensors name each other one to one, and each module can run over slabs of its layout.
    Raises StoreError naming the module otherwise."""
    found = find_expert_modules(model)
    by_prefix = {lay.prefix: lay for lay in layouts.values()}
    for prefix in by_prefix:
        if prefix not in found:
            raise StoreError(where, "expert tensors have no matching SwitchGLU-like module in the mlx-lm model", tensor=prefix)
    out = {}
    for path, module in sorted(found.items()):
        lay = by_prefix.get(path)
        if lay is None:
            raise StoreError(where, "missing expert tensors for this MoE block", tensor=f"{path}.gate_proj.weight")
        try:
            check_expert_module(lay, module)
        except ValueError as e:
            raise StoreError(where, str(e), tensor=path) from None
        out[lay.layer] = (path, module)
    return out


def lazy_structure(model_dir: Path) -> nn.Module:
    """The mlx-lm model of a checkpoint or store directory, built lazily (no weight is evaluated)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir), lazy=True, strict=False)
    return model


def describe_expert_module(module: nn.Module, layout: LayerLayout) -> str:
    """e.g. 'SwitchGLU(SwigluOAI; mxfp4 4-bit g32, bias)': the module's class and activation, the
    stored quantization (a model built from a packed store has no expert tensors to quantize)."""
    q = layout.quant["gate_proj"]
    quant = "unquantized" if q is None else f"{q.mode} {q.bits}-bit g{q.group_size}"
    act = module.get("activation", getattr(module, "activation", None))
    act_name = getattr(act, "__name__", type(act).__name__)
    bias = ", bias" if any(t.name == "gate_proj.bias" for t in layout.tensors) else ""
    return f"{type(module).__name__}({act_name}; {quant}{bias})"


def _gate_logits(gate) -> Callable[[mx.array], mx.array] | nn.Module:
    if isinstance(gate, (nn.Linear, nn.QuantizedLinear)):
        return gate  # the module itself (bias included when it has one): stackable by the RouterBank
    weight = gate.get("weight") if isinstance(gate, nn.Module) else None
    if isinstance(weight, mx.array) and weight.ndim == 2:  # DeepSeek / GLM MoEGate: x @ W^T, then softmax or sigmoid
        correction = gate.get("e_score_correction_bias")
        if correction is None:
            return lambda x: x @ weight.T.astype(x.dtype)  # softmax gates (DeepSeek-V2): logits rank as softmax
        # sigmoid + correction bias (DeepSeek-V3, GLM-4.5): select on sigmoid(x W^T) + b; return that score
        return lambda x: mx.sigmoid(x @ weight.T.astype(x.dtype)) + correction.astype(x.dtype)
    raise ValueError(f"router {type(gate).__name__} is neither a Linear nor a gate with a 2-D weight")


@dataclass(frozen=True)
class MoEBlockInfo:
    path: str  # module path of the expert module, e.g. "model.layers.3.mlp.switch_mlp"
    norm: nn.Module  # the decoder layer's post-attention norm (feeds the block)
    logits: Callable[[mx.array], mx.array]  # router scores (..., D) -> (..., E); see the module docstring


def _get(root: nn.Module, path: str) -> nn.Module:
    node = root
    for p in path.split(".") if path else []:
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node


def block_info(model: nn.Module, path: str) -> MoEBlockInfo:
    """The norm and router that feed the expert module at `path`."""
    block_path = path.rpartition(".")[0]
    block, layer = _get(model, block_path), _get(model, block_path.rpartition(".")[0])
    gate = block.get("gate") if block.get("gate") is not None else block.get("router")
    if gate is None:
        raise ValueError(f"{block_path}: MoE block has neither a `gate` nor a `router`")
    norm = layer.get("post_attention_layernorm")
    if norm is None:
        raise ValueError(f"{block_path.rpartition('.')[0]}: decoder layer has no post_attention_layernorm")
    return MoEBlockInfo(path, norm, _gate_logits(gate))
