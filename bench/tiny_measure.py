"""Measurements of the trained pair for its card (used by bench/train_tiny.py).

Held-out cross-entropy, teacher-forced routing statistics (overlap vs the independence
and within-sequence shuffle baselines), greedy draft acceptance and top-1 agreement.
MLX is imported inside the functions, after train_tiny may have re-executed itself.
"""

from __future__ import annotations


import numpy as np


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


def forward_with_routing(model, tokens, residuals: list | None = None):
    """Logits plus, for an MoE model, each layer's router softmax (B, L, E); [] for a dense one.
    If `residuals` is a list, each layer's post-attention residual (B, L, D) is appended to it.

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
        if residuals is not None:
            residuals.append(h)
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
