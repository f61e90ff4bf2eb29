"""A random-weight dense drafter sharing a target's tokenizer, of any width: a drafter the target never accepts;
or, with --share-output, one it often accepts.

    python -m bench.random_drafter --like TARGET_DIR --out DIR [--hidden 1024] [--layers 28] [--seed N]
    python -m bench.random_drafter --like TARGET_DIR --out DIR --share-output [--layers 2]

The model is mlx-lm's qwen3 class (a Qwen3-0.6B-class drafter at --hidden 1024 --layers 28, 16 heads
of 128, intermediate 3072), 4-bit affine group 64 as mlx-community publishes it, seeded random
weights; tokenizer files are copied from --like and the output layer has the target config's
vocab_size rows (at least the tokenizer's ids), so the pair passes the vocabulary check
(runtime/decode/pairing.py) and every proposal is a valid token that the target almost never agrees
with.

--share-output (a target written by bench/fullscale_checkpoint.py): the drafter has the target's width and takes
its embedding, final norm and output layer, as stored; its layers' output projections (o_proj, down_proj) are zero,
so they add nothing and it proposes argmax lm_head(norm(embed(token))). The synthetic target's large embeddings
keep the token's own direction a large part of its final state (bench/fullscale_weights.py), so the target agrees
with many of those proposals: a stand-in for a trained drafter at full size, not a claim about real models.

Invariant: the same (like, hidden, layers, seed, share_output) give byte-identical weights.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model, save_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


SHARED = ("model.embed_tokens", "lm_head")  # quantized modules taken from the target with --share-output
ZEROED = ("self_attn.o_proj", "mlp.down_proj")  # each layer's output projections with --share-output


def write_random_drafter(out: Path, like: Path, *, hidden: int = 1024, layers: int = 28, seed: int = 0,
                         share_output: bool = False) -> Path:
    out, like = Path(out), Path(like)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; expected a new directory")
    target = json.loads((like / "config.json").read_text())
    target = target.get("text_config", target)
    shared = _target_output(like, target) if share_output else {}
    if share_output:
        hidden = target["hidden_size"]
    heads = max(1, hidden // 128)
    config = {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 3 * hidden,
              "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": hidden // heads,
              "vocab_size": target["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 40960, "tie_word_embeddings": True}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
        model, config = quantize_model(model, config, group_size=64, bits=4)
    weights = dict(tree_flatten(model.parameters()))
    if share_output:
        config["tie_word_embeddings"] = False
        weights = {k: v for k, v in weights.items() if not k.startswith(SHARED + ("model.norm.",))}
        for k in [k for k in weights if k.endswith((".scales", ".biases")) and any(z in k for z in ZEROED)]:
            weights[k] = mx.zeros_like(weights[k])  # dequantizes to exactly zero
        weights.update(shared)
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    return out


def _target_output(like: Path, target: dict) -> dict:
    """The target's embedding, output layer and final norm tensors, as stored (quantized with its group and bits)."""
    q = target.get("quantization") or {}
    if (q.get("group_size"), q.get("bits")) != (64, 4) or target.get("tie_word_embeddings"):
        raise ValueError(f"--share-output: {like} is not a 4-bit group-64 target with its own lm_head; expected a "
                         "checkpoint written by bench/fullscale_checkpoint.py")
    index = like / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    wanted = [f"{m}.{p}" for m in SHARED for p in ("weight", "scales", "biases")] + ["model.norm.weight"]
    found = {}
    for name in files:
        tensors = mx.load(str(like / name))
        found.update({k: tensors[k] for k in wanted if k in tensors})
    missing = [k for k in wanted if k not in found]
    if missing:
        raise ValueError(f"--share-output: {like} has no {missing[0]}; expected a qwen3-style target")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", type=Path, required=True, help="the target directory (tokenizer and vocab_size)")
    ap.add_argument("--out", type=Path, required=True, help="a new directory")
    ap.add_argument("--hidden", type=int, default=1024, help="drafter width (Qwen3-0.6B: 1024)")
    ap.add_argument("--layers", type=int, default=28, help="drafter layers (Qwen3-0.6B: 28)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--share-output", action="store_true",
                    help="take the target's embedding, final norm and output layer (its width; --hidden is ignored) "
                         "and zero every layer's output projections: a drafter the target often accepts")
    args = ap.parse_args(argv)
    try:
        print(write_random_drafter(args.out, args.like, hidden=args.hidden, layers=args.layers, seed=args.seed,
                                   share_output=args.share_output))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
