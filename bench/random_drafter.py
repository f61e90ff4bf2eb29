"""A random-weight dense drafter sharing a target's tokenizer, of any width: a drafter the target never accepts.

    python -m bench.random_drafter --like TARGET_DIR --out DIR [--hidden 1024] [--layers 28] [--seed N]

The model is mlx-lm's qwen3 class (a Qwen3-0.6B-class drafter at --hidden 1024 --layers 28, 16 heads
of 128, intermediate 3072), 4-bit affine group 64 as mlx-community publishes it, seeded random
weights; tokenizer files are copied from --like and the output layer has the target config's
vocab_size rows (at least the tokenizer's ids), so the pair passes the vocabulary check
(runtime/decode/pairing.py) and every proposal is a valid token that the target almost never agrees
with.

Invariant: the same (like, hidden, layers, seed) give byte-identical weights.
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


def write_random_drafter(out: Path, like: Path, *, hidden: int = 1024, layers: int = 28, seed: int = 0) -> Path:
    out, like = Path(out), Path(like)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; expected a new directory")
    target = json.loads((like / "config.json").read_text())
    target = target.get("text_config", target)
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
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", type=Path, required=True, help="the target directory (tokenizer and vocab_size)")
    ap.add_argument("--out", type=Path, required=True, help="a new directory")
    ap.add_argument("--hidden", type=int, default=1024, help="drafter width (Qwen3-0.6B: 1024)")
    ap.add_argument("--layers", type=int, default=28, help="drafter layers (Qwen3-0.6B: 28)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        print(write_random_drafter(args.out, args.like, hidden=args.hidden, layers=args.layers, seed=args.seed))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
