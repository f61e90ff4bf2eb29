"""plain_stretch: the K = 0 rounds of speculative decoding, decoded as plain decoding decodes.

When adaptive K has fallen to 0 (runtime/decode/draft_length.py), the next `n` tokens are the
target's alone. Run one by one as one-token verify rounds they cost what plain decoding does not
pay: below a full budget a device pass with window routes and repairs where plain decoding syncs
once per MoE layer (faster there: bench/results/decode_defaults.txt), no pipelining, and a round's
bookkeeping (snapshot, observer, forecast scoring, rewind) per token. A stretch decodes them with
plain decoding's rule (runtime/decode/plain.py): a device pass per token (one host sync) while the
budget holds every expert or one_sync is "on", else the paged model with one host sync per MoE
layer; greedy forwards are built on the previous token's lazy argmax and queued before that token
is read, as mlx-lm's generate_step pipelines. The drafter does nothing meanwhile: the decoder queues
the stretch's tokens on it (ModelDrafter.skip) and it feeds them in one batched forward when it next
proposes (the probe round).

Invariants: the tokens are the target's own (greedy: its argmax; sampled: drawn from its distribution
under the sampler settings, one uniform from `rng` per token, as a one-token round draws); no forward
is built past the stretch's last token, so the target's cache ends holding the context up to, not
including, the last token returned (the next round's pending token); a stretch stops after an
end-of-sequence token (decoding ends there, whatever a queued forward left in the cache).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runtime.decode.sampling import Sampling, sample


def plain_stretch(target, cache: list, pending: int, n: int, *, sampling: Sampling, rng: np.random.Generator,
                  device_pass=None, eos_ids=()) -> list[int]:
    """Up to `n` tokens after `pending` (fed first) from `target` (an OffloadedModel) over its KV `cache`.
    `device_pass`: a DevicePass to run each forward through (one host sync a token), None: the paged model's
    per-layer synced path."""
    if n < 1:
        raise ValueError(f"plain_stretch n={n}; expected >= 1")
    model = target.model

    def logits_of(token) -> mx.array:  # token: an id, or a lazy scalar (the previous greedy step's argmax)
        inputs = mx.array([[token]]) if isinstance(token, int) else token.reshape(1, 1)
        target.label_round("decode")
        if device_pass is None:
            return model(inputs, cache=cache)[0, -1]
        return device_pass.run(lambda: model(inputs, cache=cache), cache, 1)[0, -1]

    out: list[int] = []
    try:
        if not sampling.greedy or device_pass is not None:  # a host step between forwards: not pipelined
            token = pending
            for _ in range(n):
                logits = logits_of(token)
                if sampling.greedy:
                    token = int(mx.argmax(logits).item())
                else:
                    token = sample(np.array(sampling.probabilities(logits[None]), np.float64)[0], rng)
                out.append(token)
                if token in eos_ids:
                    break
            return out
        y = mx.argmax(logits_of(pending))
        mx.async_eval(y)
        for i in range(n):
            following = None
            if i + 1 < n:  # queued before this token is read; never past the stretch's last token
                following = mx.argmax(logits_of(y))
                mx.async_eval(following)
            token = int(y.item())
            out.append(token)
            if token in eos_ids:
                break
            y = following
        return out
    finally:
        target.end_round()
        if device_pass is None:
            for m in target.modules.values():  # the per-layer path's last calls: evaluated, their slots unpinned
                m.release_pending()
