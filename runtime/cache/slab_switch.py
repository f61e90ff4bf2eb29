"""slab_switch_glu: the family's own expert module rebuilt over one layer's cache slabs.

Shapes: S = cache slots of the layer. A stock expert module stacks each projection's
tensors as [E, ...]; the slab module holds the same tensors as [S, ...] (the cache's
slabs) and is called with slot ids instead of expert ids.

With `like` (the stock module of the loaded mlx-lm model) the slab module is an
instance of `like`'s own class, its projections instances of `like`'s projection
classes with the same attributes (group_size, bits, mode) and its activation the same
object (e.g. gpt-oss's clamped SwiGLU), so `__call__` is the family's own code and the
output is bit-identical to the resident model. Without `like` it is a stock SwitchGLU.

Invariants: every array of a projection (weight, scales, biases, bias) is a slab of the
layout, and every slab of the layout is used; the quantization the module runs
(group_size, bits, mode) equals the layout's, else a ValueError names the projection;
expert-module arrays that are not paged (e.g. nvfp4 global scales) are refused.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from storage import LayerLayout

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def slab_switch_glu(layout: LayerLayout, slabs: dict[str, mx.array], activation=None, *, like: nn.Module | None = None) -> nn.Module:
    """The expert module of one layer whose stacked weights are the cache slabs."""
    if like is not None:
        return _mirror(layout, slabs, like)
    linears = {}
    for proj in PROJECTIONS:
        weight = slabs[f"{proj}.weight"]
        q = layout.quant[proj]
        out_dims = weight.shape[1]
        if q is None:
            lin = SwitchLinear(weight.shape[2], out_dims, 1, bias=False)
            lin.weight = weight
        else:
            in_dims = slabs[f"{proj}.scales"].shape[-1] * q.group_size
            lin = QuantizedSwitchLinear(in_dims, out_dims, 1, bias=False, group_size=q.group_size, bits=q.bits, mode=q.mode)
            lin.weight = weight
            lin.scales = slabs[f"{proj}.scales"]
            lin.biases = slabs.get(f"{proj}.biases")
        if f"{proj}.bias" in slabs:
            lin.bias = slabs[f"{proj}.bias"]
        linears[proj] = lin
    hidden = linears["gate_proj"].output_dims
    glu = SwitchGLU(linears["gate_proj"].input_dims, hidden, 1, activation=activation)
    glu.gate_proj, glu.up_proj, glu.down_proj = linears["gate_proj"], linears["up_proj"], linears["down_proj"]
    glu.freeze()
    return glu


def _fresh(template: nn.Module) -> nn.Module:
    """An empty instance of template's class carrying its plain attributes (no arrays, no children)."""
    cls = type(template)
    out = cls.__new__(cls)
    nn.Module.__init__(out)
    for k, v in template.__dict__.items():
        if k not in ("_no_grad", "_training"):
            setattr(out, k, v)
    return out


def _check_linear(layout: LayerLayout, proj: str, stock: nn.Module) -> None:
    where = f"{layout.prefix}.{proj}"
    if not isinstance(stock, (SwitchLinear, QuantizedSwitchLinear)):
        raise ValueError(f"{where}: {type(stock).__name__} is not a SwitchLinear or QuantizedSwitchLinear; cannot page it")
    if getattr(stock, "global_scale", None) is not None:
        raise ValueError(f"{where}: per-expert global scales ({getattr(stock, 'mode', '?')}) are not paged")
    q = layout.quant[proj]
    mine = _parts(layout, proj)
    if ("bias" in stock) != ("bias" in mine):
        raise ValueError(f"{where}: the model's projection {'has' if 'bias' in stock else 'has no'} bias but the expert tensors "
                         f"{'have' if 'bias' in mine else 'have no'} {proj}.bias")
    if isinstance(stock, QuantizedSwitchLinear):
        got = (stock.group_size, stock.bits, stock.mode)
        if q is None or (q.group_size, q.bits, q.mode) != got:
            raise ValueError(f"{where}: the model runs group_size/bits/mode {got} but the expert tensors are "
                             f"{None if q is None else (q.group_size, q.bits, q.mode)}")


def _parts(layout: LayerLayout, proj: str) -> set[str]:
    return {t.name.split(".", 1)[1] for t in layout.tensors if t.name.startswith(proj + ".")}


def check_expert_module(layout: LayerLayout, like: nn.Module) -> None:
    """Raise ValueError (naming the module) unless `like` can run over slabs of `layout`."""
    for key, child in like.items():
        if key in PROJECTIONS:
            _check_linear(layout, key, child)
        elif isinstance(child, mx.array):
            raise ValueError(f"{layout.prefix}.{key}: an array of the expert module that is not per-expert paged")
    missing = [p for p in PROJECTIONS if p not in like]
    if missing:
        raise ValueError(f"{layout.prefix}: the expert module has no {', '.join(missing)}")


def _mirror_linear(layout: LayerLayout, slabs: dict[str, mx.array], proj: str, stock: nn.Module) -> nn.Module:
    """The slab projection: stock's class and attributes, or QuantizedSwitchLinear of the layout's spec.

    A model loaded from a packed store has no expert tensors, so mlx-lm leaves its
    expert projections unquantized; the layout (config.json and the tensors) then says
    how they are quantized. A model loaded from the raw checkpoint must agree with it
    (check_expert_module).
    """
    q = layout.quant[proj]
    mine = _parts(layout, proj)
    if isinstance(stock, QuantizedSwitchLinear) or q is None:
        lin = _fresh(stock)
    else:
        weight = slabs[f"{proj}.weight"]
        in_dims = slabs[f"{proj}.scales"].shape[-1] * q.group_size
        lin = QuantizedSwitchLinear(in_dims, weight.shape[1], 1, bias=False, group_size=q.group_size, bits=q.bits, mode=q.mode)
        for part in list(lin.keys()):
            del lin[part]  # the constructor's placeholder arrays; the slabs replace them below
    for part in sorted(mine):
        lin[part] = slabs[f"{proj}.{part}"]
    if lin.get("biases") is None and "biases" not in mine and isinstance(lin, QuantizedSwitchLinear):
        lin.biases = None  # modes without offsets (mxfp4): gather_qmm gets biases=None
    lin.freeze()
    return lin


def _mirror(layout: LayerLayout, slabs: dict[str, mx.array], like: nn.Module) -> nn.Module:
    check_expert_module(layout, like)
    glu = _fresh(like)
    for key, child in like.items():
        # projections over slabs; the activation (module or function) is the family's own object
        glu[key] = _mirror_linear(layout, slabs, key, child) if key in PROJECTIONS else child
    glu.freeze()
    return glu
