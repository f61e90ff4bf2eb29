"""Seeded random values for a full-size synthetic checkpoint, one tensor at a time, and the streaming
safetensors shard writer that puts them on disk.

Values (`tensor_values(name, dtype, shape, knobs)`) depend only on (seed, tensor name), never on the
order tensors are written in, so a shard can be rewritten alone and two runs are byte-identical.
Quantized weights are random codes; the affine scales are sized so each dequantized matrix has
std `gain / sqrt(in_features)`, with biases = -mid * scales (codes centred on zero):
    gain 1        q/k/v, linear-attention inputs, routers, expert gate/up
    embedding     rows of rms `embed_rms` (the writer uses 1.2 sqrt(layers)): the token's own direction
                  stays a large part of the final hidden state, so greedy decoding walks through varied
                  tokens instead of settling on one (as random deep stacks otherwise do)
    gain 0.5      expert and shared-expert down projections (keeps the residual stream bounded)
    locality      attention and linear-attention output projections: gain 1 + 8 P / (1 - P) embed_rms. A large
                  attention share puts the running mean of the context's values in every token's hidden
                  state, so consecutive tokens route alike (measured: tests/test_fullscale_checkpoint.py).
                  GatedDeltaNet layers get a longer memory for the same reason: A_log shifted by -8 P.
                  The boost is confined to the first half of the hidden dimensions (the rows of o_proj /
                  out_proj there; the other half keeps gain 1) and lm_head's columns over that half are
                  zero: routers and attention read the whole (normed) state, dominated by the context,
                  while the output layer reads only the half where the token's own direction dominates.
                  Without that split, on the 48-layer Qwen3 shape P = 0.5 (with S = 1) made greedy
                  decoding repeat one token (bench/results/fullscale_qwen3-30b-a3b_local.txt).
    skew          a fixed direction u (+-1 per quantization group) is added to every embedding row, and
                  each router row e gets S * z_e * u (z_e ~ N(0, 1) per layer; gpt-oss: its router bias
                  S * z_e): every token's logit for expert e is offset by about S * z_e, so the experts
                  with large z_e are popular at every position.
MXFP4 scales (uint8 exponents) sit around 2^-8. lm_head rows the tokenizer cannot decode (ids past its
vocab and its special tokens) get zero scales and biases: their logit is exactly 0 while some decodable
row is positive, so greedy decoding always emits ids the tokenizer knows and never stops at EOS.

Writer invariant (`write_shard`): the header is written first from shapes alone, then each tensor is
generated, written and dropped; the process never holds more than one tensor.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAFETENSORS_DTYPES = {"uint32": "U32", "uint8": "U8", "float32": "F32", "bfloat16": "BF16", "float16": "F16"}
ITEM_BYTES = {"U32": 4, "U8": 1, "F32": 4, "BF16": 2, "F16": 2}


@dataclass(frozen=True)
class Knobs:
    seed: int = 0  # all values derive from (seed, tensor name)
    skew: float = 0.0  # router row spread: 0 = every expert equally likely
    locality: float = 0.0  # in [0, 1): attention share of the hidden state; consecutive tokens share experts
    decodable: int = 0  # the tokenizer's vocab: lm_head rows at or past it are zeroed (0 = keep all rows)
    special: int = 0  # the tokenizer's first `special` ids (EOS, chat markers) are zeroed in lm_head too
    embed_rms: float = 1.0  # rms of an embedding row

    def __post_init__(self):
        if not 0 <= self.locality < 1:
            raise ValueError(f"locality {self.locality}: expected a value in [0, 1)")
        if self.skew < 0:
            raise ValueError(f"skew {self.skew}: expected a value >= 0")


def _rng(knobs: Knobs, name: str, salt: int = 0) -> np.random.Generator:
    return np.random.default_rng([knobs.seed, zlib.crc32(name.encode()), salt])


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _gain(module: str, knobs: Knobs) -> float:
    if module.endswith(("self_attn.o_proj", "linear_attn.out_proj")):
        return 1.0 + 8.0 * knobs.locality / (1.0 - knobs.locality) * knobs.embed_rms
    if module.endswith("down_proj"):
        return 0.5
    return 1.0


def _is_router(module: str) -> bool:
    return module.endswith(("mlp.gate", "mlp.router"))


def affine_scales(module: str, shape: tuple, bits: int, group: int, knobs: Knobs) -> np.ndarray:
    """float32 scales of an affine-quantized module, shape (..., out, in / group)."""
    in_features = shape[-1] * group
    code_std = np.sqrt(((2**bits) ** 2 - 1) / 12.0)  # std of a uniform code in [0, 2^bits)
    gain = _gain(module, knobs)
    if module.endswith("embed_tokens"):
        gain = knobs.embed_rms * np.sqrt(in_features)  # embedding rows of rms embed_rms
    base = gain / np.sqrt(in_features) / code_std
    jitter = 1.0 + 0.1 * _rng(knobs, module, 1).standard_normal(shape, dtype=np.float32)
    scales = (base * np.abs(jitter)).astype(np.float32)
    if knobs.locality > 0 and module.endswith(("self_attn.o_proj", "linear_attn.out_proj")):
        scales[..., _local_rows(shape[-2]):, :] *= 1.0 / gain  # the boost stays in the local half (gain 1 elsewhere)
    if knobs.locality > 0 and module.endswith("lm_head"):
        scales[:, : _unread_by_output(in_features) // group] = 0  # the output layer does not read the local half
    if module.endswith("lm_head") and knobs.decodable:
        scales[knobs.decodable:] = 0
        scales[: knobs.special] = 0
    return scales


def _local_rows(hidden: int) -> int:
    """The hidden dimensions [0, hidden / 2) that attention's boosted output writes when locality > 0."""
    return hidden // 2


def _unread_by_output(hidden: int) -> int:
    """The hidden dimensions [0, n) lm_head ignores when locality > 0: the local half."""
    return _local_rows(hidden)


def _popularity(module: str, n_experts: int, knobs: Knobs) -> np.ndarray:
    """z_e ~ N(0, 1) of one router: the experts with large z_e are the popular ones."""
    return _rng(knobs, module, 2).standard_normal(n_experts).astype(np.float32)


def _skew_offset(module: str, shape: tuple, group: int, knobs: Knobs) -> np.ndarray:
    """What the skew adds to the affine biases (shape of the biases): the common direction u in embedding
    rows, S * z_e * u * sqrt(2) / in_features in router rows (a logit offset of about S * z_e after the
    hidden state's RMSNorm); zero elsewhere and when skew is 0."""
    if knobs.skew <= 0 or not (module.endswith("embed_tokens") or _is_router(module)):
        return np.zeros(shape, np.float32)
    n_groups = shape[-1]
    u = np.where(np.random.default_rng([knobs.seed, n_groups]).random(n_groups) < 0.5, -1.0, 1.0).astype(np.float32)
    if module.endswith("embed_tokens"):
        return np.broadcast_to(knobs.embed_rms * u, shape).astype(np.float32)
    z = _popularity(module, shape[0], knobs)
    return (knobs.skew * np.sqrt(2.0) / (n_groups * group) * z[:, None] * u[None, :]).astype(np.float32)


def tensor_values(name: str, dtype: str, shape: tuple, knobs: Knobs, quant: dict) -> np.ndarray:
    """The values of tensor `name` (numpy; bf16 as uint16 bits). `quant` maps a module path to its
    (bits, group, mode) for quantized modules."""
    module, leaf = _module(name), name.rsplit(".", 1)[-1]
    rng = _rng(knobs, name)
    if module in quant:
        bits, group, mode = quant[module]
        if leaf == "weight":  # packed codes: every bit pattern is a valid code
            return np.frombuffer(rng.bytes(int(np.prod(shape)) * 4), dtype=np.uint32).reshape(shape)
        if mode == "mxfp4" and leaf == "scales":  # E8M0 exponents: 2^(s - 127) around 2^-8 (fp4 codes reach 6)
            return rng.integers(117, 121, shape, dtype=np.uint8)
        if leaf in ("scales", "biases"):
            scales = affine_scales(module, shape, bits, group, knobs)
            if leaf == "scales":
                return _cast(scales, dtype)
            return _cast(-(2**bits - 1) / 2.0 * scales + _skew_offset(module, shape, group, knobs), dtype)
    # Unquantized parameters.
    if leaf == "A_log":  # GatedDeltaNet decay, as Qwen3-Next initialises it, log(U[1, 16]), lengthened by locality
        return _cast((np.log(rng.uniform(1, 16, shape)) - 8.0 * knobs.locality).astype(np.float32), dtype)
    if leaf == "bias" and _is_router(module) and knobs.skew > 0:  # gpt-oss: a router bias per expert
        return _cast(knobs.skew * _popularity(module, shape[0], knobs), dtype)
    if leaf == "dt_bias" or "norm" in leaf or module.endswith("norm"):
        return _cast(np.ones(shape, np.float32), dtype)
    if leaf in ("bias", "sinks"):  # linear biases (gpt-oss attention, experts, router) and attention sinks
        return _cast(0.02 * rng.standard_normal(shape, dtype=np.float32), dtype)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return _cast(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in), dtype)


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return values.astype(np.float32, copy=False)
    if dtype == "float16":
        return values.astype(np.float16)
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits
        bits = values.astype(np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    raise ValueError(f"dtype {dtype!r}: expected float32, bfloat16 or float16")


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the parameter's name in mlx-lm's model tree
    dtype: str  # numpy-style name: uint32, uint8, float32, bfloat16, float16
    shape: tuple  # full shape

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * ITEM_BYTES[SAFETENSORS_DTYPES[self.dtype]]


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """mlx-lm's make_shards rule: in order, a new shard when the next tensor would pass the limit."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_shard(path: Path, specs: list[TensorSpec], values, metadata: dict | None = None) -> int:
    """Write one safetensors file tensor by tensor; `values(spec)` returns each array. Returns bytes written."""
    header: dict = {"__metadata__": metadata or {"format": "mlx"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = path.with_suffix(path.suffix + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for spec in specs:
            array = np.ascontiguousarray(values(spec))
            if array.nbytes != spec.nbytes or tuple(array.shape) != tuple(spec.shape):
                raise ValueError(f"{spec.name}: generated {array.shape} ({array.nbytes} B), "
                                 f"expected {spec.shape} ({spec.nbytes} B)")
            f.write(array.tobytes())
            del array
    tmp.replace(path)
    return 8 + len(text) + offset
