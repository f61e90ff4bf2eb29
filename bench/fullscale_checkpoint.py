"""Full-size synthetic checkpoints of the MoE models people run, written without holding them in RAM.

    python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out /tmp/q30 [--layers N]
        [--dtype float32|bfloat16] [--skew S] [--locality P] [--embed-rms R] [--seed N] [--small]

Presets (real dimensions from runtime/data/model_presets.json, the published configs):
    qwen3-30b-a3b     48 layers, 128 experts top-8, hidden 2048, vocab 151,936           (qwen3_moe)
    qwen3.5-35b-a3b   40 layers, 3 GatedDeltaNet : 1 attention, 256 experts top-8, a gated
                      shared expert, vocab 248,320                                      (qwen3_5_moe)
    gpt-oss-20b       24 layers alternating sliding-128 / full attention, 32 experts top-4,
                      expert biases, vocab 201,088                                      (gpt_oss)
Layout as mlx-community publishes it: mlx-lm's own parameter names (the model class is built
lazily, so shapes come from mlx-lm and nothing is allocated), 4-bit affine group 64, routers and
shared-expert gates 8-bit (the model's quant_predicate), gpt-oss experts MXFP4 (group 32, uint8
scales), shards of at most 5 GiB in mlx-lm's order with model.safetensors.index.json, config.json
with the quantization block. The tokenizer is the embedded model's (4,096 ids): the config keeps the
preset's vocab (embedding rows), and lm_head rows past the tokenizer are zeroed so generated ids
are always valid (bench/fullscale_weights.py).

--dtype: the published checkpoints keep scales, biases and norms in bfloat16; on this machine's
CPU backend a bfloat16 quantized matmul is ~10x slower than float32, so float32 is the default
here. config.json's "specmoe_synthetic" block records the choice and the knobs.
--small: the same family structure at toy widths (hidden 128, 16 experts) for tests.
--embed-rms: the embedding rows' rms per sqrt(layers) (default 1.2). Larger, each token's own direction
dominates the final hidden state, so a --share-output drafter (bench/random_drafter.py) is accepted more
often: the knob sets how well a stand-in drafter agrees with the target, not a property of real models.

Invariants: values depend on (seed, tensor name) only; each shard is written to a .partial file and
renamed when complete; a run refuses an output directory that is not empty, or a disk without room.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from bench.fullscale_weights import Knobs, TensorSpec, plan_shards, tensor_values, write_shard

PRESET_FAMILIES = {"qwen3-30b-a3b": "qwen3_moe", "qwen3.5-35b-a3b": "qwen3_5_moe", "gpt-oss-20b": "gpt_oss"}
SMALL_DIMS = {"hidden_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
              "num_experts": 16, "num_local_experts": 16, "vocab_size": 8192}
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB
SCALE_DTYPES = ("float32", "bfloat16")
EMBED_RMS_PER_SQRT_LAYER = 1.2  # embedding rms / sqrt(layers): greedy tokens stay varied (fullscale_weights.py)


def preset_config(preset: str, *, layers: int | None = None, small: bool = False) -> dict:
    """The config.json dict (before quantization) of `preset`: the published fields over mlx-lm's defaults."""
    from runtime.checkpoints.tiny import family_config

    if preset not in PRESET_FAMILIES:
        raise ValueError(f"--preset {preset!r}: expected one of {', '.join(PRESET_FAMILIES)}")
    family = PRESET_FAMILIES[preset]
    presets = json.loads((Path(__file__).resolve().parent.parent / "runtime/data/model_presets.json").read_text())
    published = presets["presets"][preset]["config"]
    text = dict(published.get("text_config", published))
    text.pop("model_type", None)
    cfg = {**family_config(family, vocab_size=int(text["vocab_size"])), **text}
    if family == "gpt_oss":
        cfg["intermediate_size"] = int(text["intermediate_size"])
    if small:
        cfg.update({k: v for k, v in SMALL_DIMS.items() if k in cfg})
        if family == "gpt_oss":
            cfg["intermediate_size"] = SMALL_DIMS["moe_intermediate_size"]
    if layers is not None:
        if not 1 <= layers <= int(cfg["num_hidden_layers"]):
            raise ValueError(f"--layers {layers}: expected 1..{cfg['num_hidden_layers']} for {preset}")
        cfg["num_hidden_layers"] = layers
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = cfg["layer_types"][:layers]
    cfg["model_type"] = family
    cfg["eos_token_id"] = 0  # the embedded tokenizer's <|endoftext|>
    if "text_config" in published:  # Qwen3.5 is published as a multimodal wrapper around its text config
        return {"model_type": family, "text_config": {**cfg, "model_type": published["text_config"]["model_type"]},
                "tie_word_embeddings": False, "eos_token_id": 0}
    return cfg


def _quant_predicate(family: str, model):
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if family == "gpt_oss" and ".experts" in path:
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return own(path, module) if own is not None else True

    return predicate


def model_specs(config: dict, dtype: str) -> tuple[list[TensorSpec], dict, dict]:
    """(tensor specs in mlx-lm's order, the quantized config, {module: (bits, group, mode)}) from mlx-lm's
    own model class, built lazily: no parameter is ever evaluated."""
    import contextlib
    import io

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
        model, qconfig = quantize_model(model, config, group_size=64, bits=4,
                                        quant_predicate=_quant_predicate(config["model_type"], model))
    keep = getattr(model, "cast_predicate", None) or (lambda path: True)
    q = qconfig["quantization"]
    specs, quant = [], {}
    for name, p in tree_flatten(model.parameters()):
        module = name.rsplit(".", 1)[0]
        if name.endswith(".scales"):
            params = q.get(module, q)
            quant[module] = (int(params["bits"]), int(params["group_size"]), params.get("mode", "affine"))
        if p.dtype == mx.uint32:
            kind = "uint32"
        elif p.dtype == mx.uint8:
            kind = "uint8"
        else:
            kind = dtype if keep(name) else "float32"
        specs.append(TensorSpec(name, kind, tuple(p.shape)))
    return specs, qconfig, quant


def _tokenizer(out: Path) -> tuple[int, int]:
    """Copy the embedded model's tokenizer into `out`; (vocab size, number of special ids at the start)."""
    from runtime.checkpoints.embedded import embedded_pair

    src = embedded_pair().target
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(t["id"] >= len(tok["model"]["vocab"]) for t in tok.get("added_tokens", []))
    special = max((t["id"] + 1 for t in tok.get("added_tokens", []) if t.get("special")), default=0)
    return vocab, special


def write_checkpoint(out: str | Path, preset: str, *, layers: int | None = None, dtype: str = "float32",
                     skew: float = 0.0, locality: float = 0.0, seed: int = 0, small: bool = False,
                     embed_rms: float = EMBED_RMS_PER_SQRT_LAYER, max_shard_bytes: int = MAX_SHARD_BYTES, progress=None) -> dict:
    """Write the checkpoint; returns a summary (files, bytes, expert bytes, seconds)."""
    from mlx_lm.utils import save_config

    if dtype not in SCALE_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(SCALE_DTYPES)}")
    if not embed_rms > 0:
        raise ValueError(f"--embed-rms {embed_rms}: expected a positive number (default {EMBED_RMS_PER_SQRT_LAYER})")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty; the writer makes a new checkpoint directory")
    config = preset_config(preset, layers=layers, small=small)
    specs, qconfig, quant = model_specs(config, dtype)
    total = sum(s.nbytes for s in specs)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < total + (1 << 30):
        raise ValueError(f"--out {out}: {free / 1e9:.1f} GB free, the checkpoint needs {total / 1e9:.1f} GB plus 1 GB")
    vocab, special = _tokenizer(out)
    n_layers = int(config.get("text_config", config)["num_hidden_layers"])
    knobs = Knobs(seed=seed, skew=skew, locality=locality, decodable=vocab, special=special,
                  embed_rms=embed_rms * n_layers**0.5)
    shards = plan_shards(specs, max_shard_bytes)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    t0, weight_map = time.perf_counter(), {}
    for i, shard in enumerate(shards):
        fname = fmt.format(i + 1, len(shards))
        write_shard(out / fname, shard, lambda s: tensor_values(s.name, s.dtype, s.shape, knobs, quant))
        weight_map.update({s.name: fname for s in shard})
        if progress:
            progress(f"{fname}: {sum(s.nbytes for s in shard) / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    expert = sum(s.nbytes for s in specs if ".switch_mlp." in s.name or ".experts." in s.name)
    n_experts = sum(s.shape[0] for s in specs if s.name.endswith(("switch_mlp.gate_proj.weight", "experts.gate_proj.weight")))
    qconfig["specmoe_synthetic"] = {
        "preset": preset, "small": small, "scales_dtype": dtype, "skew": skew, "locality": locality, "seed": seed,
        "embed_rms_per_sqrt_layer": embed_rms, "tokenizer_vocab": vocab,
        "note": ("random weights; float32 scales, biases and norms for the CPU backend (published checkpoints: bfloat16)"
                 if dtype == "float32" else "random weights; bfloat16 scales, biases and norms as published")}
    save_config(qconfig, out / "config.json")
    return {"preset": preset, "out": str(out), "files": len(shards), "total_bytes": total, "expert_bytes": expert,
            "expert_mb": expert / max(1, n_experts) / 1e6, "n_experts": n_experts, "dtype": dtype,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True, help=f"one of {', '.join(PRESET_FAMILIES)}")
    ap.add_argument("--out", required=True, help="a new directory (put it on a disk with room: 11-22 GB)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (default: all)")
    ap.add_argument("--dtype", default="float32", help="scales/biases/norms: float32 (fast on CPU) or bfloat16 (as published)")
    ap.add_argument("--skew", type=float, default=0.0, help="router skew S >= 0: a few experts popular (0 = uniform)")
    ap.add_argument("--locality", type=float, default=0.0, help="P in [0, 1): consecutive tokens share experts")
    ap.add_argument("--embed-rms", type=float, default=EMBED_RMS_PER_SQRT_LAYER,
                    help="embedding rms per sqrt(layers); larger: a --share-output drafter is accepted more often")
    ap.add_argument("--seed", type=int, default=0, help="weights depend on (seed, tensor name) only")
    ap.add_argument("--small", action="store_true", help="toy widths (hidden 128, 16 experts) for tests")
    ap.add_argument("--debug", action="store_true", help="tracebacks on errors")
    args = ap.parse_args(argv)
    try:
        summary = write_checkpoint(args.out, args.preset, layers=args.layers, dtype=args.dtype, skew=args.skew,
                                   locality=args.locality, seed=args.seed, small=args.small,
                                   embed_rms=args.embed_rms, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'preset':<18}{'files':>6}{'total GB':>10}{'experts GB':>12}{'MB/expert':>11}{'dtype':>10}{'s':>7}")
    print(f"{summary['preset']:<18}{summary['files']:>6}{summary['total_bytes'] / 1e9:>10.2f}"
          f"{summary['expert_bytes'] / 1e9:>12.2f}{summary['expert_mb']:>11.2f}{summary['dtype']:>10}{summary['seconds']:>7}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
