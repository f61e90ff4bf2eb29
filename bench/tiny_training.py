"""Training the embedded pair (used by bench/train_tiny.py): losses and the step loop.

The target's loss adds a load-balancing term computed from router probabilities that a
training-only forward collects (mlx-lm classes are not modified); drafters learn from the
target's logits (KL) and the text (CE). Steps stop at a fixed count or a time budget.
MLX is imported inside the functions, after train_tiny may have re-executed itself.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from functools import partial

import numpy as np

from bench.tiny_measure import forward_with_routing, top_k_choices


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
