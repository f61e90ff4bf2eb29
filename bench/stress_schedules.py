"""Differential stress schedules: seeded random interleavings that drive the real engine, every token vs stock mlx-lm.

A schedule (make_schedule(seed, ...): the same seed gives the same schedule) fixes a family's tiny checkpoint, a
budget (a share, or a per-layer split of a 100% budget that leaves some layers whole: their ids are their slots),
plain or speculative decoding, greedy or seeded sampling, the engine's one-sync setting, how the device runs what is
queued, disk faults, and events at token boundaries:
- governor shrinks and grows (ExpertCache.request_usable_slots, all layers or per layer), applied by the engine at
  its next usable_now() or at once ("apply": the decode loop's usable_now() between tokens); and resizes requested
  from an I/O thread at a given read, mid-forward, as the governor's own thread may (the engine applies them);
- prefetches of random experts (ExpertCache.prefetch) that arrive early (settle_inflight), late (slow reads) or
  never (cancelled before their read: AsyncLoader.cancel_stale);
- slow reads and read errors the loader retries (storage.faults through OffloadConfig.inject);
- the device: "async" (as it runs), "lazy" (mx.async_eval queues nothing: a queued graph runs at the next sync, as
  a busy device would run it) or "eager" (mx.async_eval evaluates at once), both legal schedules of an
  asynchronous device, patched into the runtime.decode modules only for the run.
Repairs, evictions and (where the engine has them) staged builds follow from the budgets, shrinks and misses.

What is compared (run_schedule):
- plain decoding: every token and its log-probabilities, exactly (np.array_equal), with stock mlx-lm's
  generate_step on the resident model; seeded sampling draws with a key made of the seed and the token's position
  (the first attention cache's offset), a pure function of (position, logits) in both runs;
- speculative greedy: every token vs stock greedy; speculative seeded sampling: every token vs the same decoder
  (same drafter, predictor and seed) at a 100% budget with no event, no fault and the device as it runs.
A run that raises counts as an error. Nothing here changes package code.
"""

from __future__ import annotations

import inspect
import random
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from runtime.checkpoints.tiny import FAMILIES, make_tiny
from runtime.decode import offloaded_generate_step
from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from runtime.decode.speculative_run import release_drafter, speculative_decoder
from runtime.decode.warm import warm_start
from storage import ExpertKey

PROMPT = "The quick brown fox jumps over the lazy dog. Experts live on disk and the loader fetches them."
TINY = dict(layers=3, n_experts=32, top_k=4)  # the tests' tiny checkpoints: 25% of 32 experts is above top-k
BUDGETS = ("100%", "50%", "25%", "split")
MODES = ("plain", "spec")
SAMPLINGS = ("greedy", "seeded")
TEMP = 0.8


@dataclass(frozen=True)
class Schedule:
    seed: int  # replays the schedule: make_schedule(seed, ...) rebuilds it
    family: str
    budget: str  # a share, or "split": 100% with some layers shrunk (the others whole, ids as slots)
    mode: str  # "plain" or "spec"
    sampling: str  # "greedy" or "seeded"
    one_sync: str  # plain: "auto", "on", "off" (device passes as runtime/decode/plain.py picks); spec: SpecConfig
    device: str  # "async", "lazy" or "eager"
    faults: str  # storage.faults spec ("" none)
    n_tokens: int
    split: tuple = ()  # "split": (layer index, usable slots) of the shrunk layers
    events: tuple = ()  # (after token i, kind, args) in order
    predictor: str = "previous"  # spec: the forecaster
    num_draft: int = 3  # spec: K
    governor: tuple = ()  # (read count after the warm start, usable slots): a resize requested from an I/O thread

    def label(self) -> str:
        return f"seed {self.seed} {self.family} {self.budget} {self.mode} {self.sampling} {self.one_sync} {self.device}"


@dataclass
class Outcome:
    schedule: Schedule
    tokens: list = field(default_factory=list)  # what the engine emitted
    expected: list = field(default_factory=list)  # what the reference emitted
    compared: int = 0  # tokens compared
    mismatches: int = 0  # tokens that differ (from the first difference on, all count)
    logit_mismatches: int = 0  # plain: positions whose log-probabilities differ from stock's
    error: str = ""  # the run raised: its one-line message
    repairs: int = 0  # the engine's repairs over the run
    shrinks: int = 0  # resizes that shrank a layer

    @property
    def failed(self) -> bool:
        return bool(self.mismatches or self.logit_mismatches or self.error)


def make_schedule(seed: int, families=FAMILIES, budgets=BUDGETS, modes=MODES, samplings=SAMPLINGS,
                  n_tokens: int = 12) -> Schedule:
    """The schedule of `seed`. Weighted towards what pipelined forwards race with: plain decoding (its next forward
    is pending at every token boundary, where the events land), whole layers (their ids are slots), a lazy device."""
    r = random.Random(seed)
    mode = _pick(r, modes, {"plain": 2, "spec": 1})
    budget = _pick(r, budgets, {"100%": 3, "50%": 2, "25%": 2, "split": 3})
    split = ()
    if budget == "split":  # at least one layer whole and one short
        whole = r.randrange(TINY["layers"])
        split = tuple((i, r.randint(TINY["top_k"], TINY["n_experts"] // 2))
                      for i in range(TINY["layers"]) if i != whole)
    kinds = [k for k in ("slow", "eio", "eintr", "short") if r.random() < 0.4]
    faults = ";".join(f"slow:ms={r.choice([0.2, 1, 3])},p=0.3,seed={seed}" if k == "slow" else
                      f"{k}:after={r.randint(0, 60)},times={1 if k == 'short' else r.randint(1, 2)}" for k in kinds)
    events = []
    for i in range(n_tokens - 1):
        x = r.random()
        if x < 0.3:
            per_layer = r.random() < 0.4
            n = (tuple(r.randint(TINY["top_k"], TINY["n_experts"]) for _ in range(TINY["layers"])) if per_layer
                 else r.randint(TINY["top_k"], TINY["n_experts"] - 1))
            events.append((i, "resize", (n, r.random() < 0.7)))
        elif x < 0.45:
            events.append((i, "grow", (r.random() < 0.6,)))
        elif x < 0.65:
            keys = tuple((r.randrange(TINY["layers"]), r.randrange(TINY["n_experts"])) for _ in range(r.randint(1, 6)))
            events.append((i, "prefetch", (keys, r.choice(["early", "late", "never"]))))
    one_sync = _pick(r, ("auto", "on", "off"), {"auto": 9, "on": 9, "off": 2 if mode == "plain" else 0})
    g = random.Random(seed * 7919 + 1)  # a stream of its own: the fields above stay as they were without it
    governor = tuple(sorted((g.randint(1, 60), g.randint(TINY["top_k"], TINY["n_experts"]))
                            for _ in range(g.randint(1, 3)))) if g.random() < 0.5 else ()
    return Schedule(seed, r.choice(list(families)), budget, mode, r.choice(list(samplings)), one_sync,
                    _pick(r, ("async", "lazy", "eager"), {"async": 3, "lazy": 5, "eager": 2}), faults, n_tokens, split,
                    tuple(events), r.choice(["previous", "spmoe", "none"]), r.choice([2, 3, 4]), governor)


def _pick(r: random.Random, options, weights: dict):
    options = list(options)
    return r.choices(options, [weights.get(o, 1) for o in options])[0]


# -- checkpoints and references ------------------------------------------------------------
def build_checkpoints(root: Path, families=FAMILIES) -> dict:
    """Tiny checkpoints of `families` and the dense drafter, under `root` (as the tests' fixtures build them)."""
    dirs = {fam: make_tiny(root / fam, fam, seed=1, **TINY) for fam in families}
    dirs["drafter"] = make_tiny(root / "drafter", "qwen3", seed=9, layers=TINY["layers"])
    return dirs


class References:
    """Stock results, memoized: (tokens, log-probabilities) of the resident model; the speculative reference runs."""

    def __init__(self, dirs: dict):
        self.dirs = dirs
        self._memo: dict = {}
        self._drafter = None

    def drafter(self):
        if self._drafter is None:
            model, _ = load(str(self.dirs["drafter"]))
            self._drafter = (model, {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]})
        return self._drafter

    def stock(self, family: str, sampling: str, seed: int, n: int) -> tuple[list, list]:
        key = ("stock", family, sampling, seed if sampling == "seeded" else 0, n)
        if key not in self._memo:
            model, tok = load(str(self.dirs[family]))
            cache = make_prompt_cache(model)
            sampler = position_sampler(cache, seed) if sampling == "seeded" else None
            tokens, logprobs = [], []
            for token, lp in generate_step(mx.array(tok.encode(PROMPT)), model, max_tokens=n, sampler=sampler,
                                           prompt_cache=cache):
                tokens.append(int(token))
                logprobs.append(np.array(lp))
            self._memo[key] = (tokens, logprobs)
        return self._memo[key]

    def speculative(self, s: Schedule) -> list:
        key = ("spec", s.family, s.seed, s.predictor, s.num_draft, s.n_tokens)
        if key not in self._memo:
            clean = Schedule(s.seed, s.family, "100%", "spec", "seeded", "on", "async", "", s.n_tokens,
                             predictor=s.predictor, num_draft=s.num_draft)
            self._memo[key] = _run(clean, self)[0]
        return self._memo[key]


def position_sampler(cache: list, seed: int, temp: float = TEMP):
    """Categorical sampling at `temp` with a key of (seed, position): the position is the first attention cache's
    offset when the sampler runs (the forward has written its token), so a repaired or rebuilt forward draws the
    same as the first build, and stock draws the same as the engine for the same logits."""
    attn = next(c for c in cache if hasattr(c, "offset"))

    def sampler(logprobs: mx.array) -> mx.array:
        return mx.random.categorical(logprobs * (1.0 / temp), key=mx.random.key(seed * 100_003 + attn.offset))

    return sampler


# -- one run -------------------------------------------------------------------------------
class Device:
    """mlx.core as the decode modules see it, with mx.async_eval replaced (every other name is mlx.core's)."""

    def __init__(self, kind: str):
        self.async_eval = (lambda *a: None) if kind == "lazy" else mx.eval

    def __getattr__(self, name):
        return getattr(mx, name)


class GovernorReader:
    """The loader's reader, passed through, that requests a resize (as the memory governor's thread does) when the
    read count reaches each of `at`'s counts: on an I/O thread, in the middle of whatever the engine is doing. The
    engine applies it at its next resize point."""

    def __init__(self, reader, cache, at: tuple):
        self._reader, self._cache, self._at = reader, cache, dict(at)
        self._n, self._lock = 0, threading.Lock()

    def read(self, path: str, offset: int, buffers: list) -> int:
        with self._lock:
            self._n += 1
            n = self._at.pop(self._n, None)
        if n is not None:
            self._cache.request_usable_slots(n)
        return self._reader.read(path, offset, buffers)

    def __getattr__(self, name):
        return getattr(self._reader, name)


@contextmanager
def device_mode(kind: str):
    """Patch `mx` in every loaded runtime.decode module to model the device `kind` for the run, then restore it."""
    if kind == "async":
        yield
        return
    fake = Device(kind)
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("runtime.decode") and getattr(m, "mx", None) is mx]
    for m in patched:
        m.mx = fake
    try:
        yield
    finally:
        for m in patched:
            m.mx = mx


def apply_event(om, kind: str, args: tuple, round_id: int) -> None:
    cache, layers = om.cache, om.moe_layers
    if kind == "resize":
        n, now = args
        cache.request_usable_slots({l: v for l, v in zip(layers, n)} if isinstance(n, tuple) else n)
        if now:
            cache.usable_now()
    elif kind == "grow":
        cache.request_usable_slots({l: cache.n_slots(l) for l in layers})
        if args[0]:
            cache.usable_now()
    elif kind == "prefetch":
        keys, when = args
        cache.prefetch([ExpertKey(layers[i % len(layers)], e) for i, e in keys], round_id)
        if when == "early":
            cache.settle_inflight()
        elif when == "never":
            om.loader.cancel_stale(round_id + 1)


def uses_pass(om, one_sync: str) -> bool:
    """Whether plain decoding with --one-sync `one_sync` runs device passes, as runtime/decode/plain.py decides it:
    "on" always, "off" never, "auto" while every layer's usable slots hold all its experts (where the engine has
    that rule; else always)."""
    if one_sync != "auto":
        return one_sync == "on"
    try:
        from runtime.decode.plain import holds_every_expert
    except ImportError:
        return True
    return holds_every_expert(om)


def pass_options(one_sync: str) -> dict:
    """DevicePass options of a plain decode's --one-sync, as runtime/decode/plain.py passes them (where the pass
    takes a segment setting: "auto" learns routed layers and segments, "on" keeps one sync)."""
    if "segment" in inspect.signature(DevicePass).parameters:
        return {"segment": "auto" if one_sync == "auto" else None}
    return {}


def plain_steps(om, ids: list, one_sync: str, sampling: str, seed: int, n_tokens: int):
    """Plain decoding of `ids` on the paged model as the engine runs it with --one-sync `one_sync` (device passes, or
    mlx-lm's generate_step where runtime/decode/plain.py runs none): a generator of (token, log-probabilities) and a
    callable giving the repairs so far."""
    cache = make_prompt_cache(om.model)
    sampler = position_sampler(cache, seed) if sampling == "seeded" else (lambda x: mx.argmax(x, axis=-1))
    if not uses_pass(om, one_sync):
        return generate_step(mx.array(ids), om.model, max_tokens=n_tokens, sampler=sampler, prompt_cache=cache), \
            lambda: 0
    dp = DevicePass(om, **pass_options(one_sync))
    return offloaded_generate_step(om, mx.array(ids), max_tokens=n_tokens, sampler=sampler, device_pass=dp,
                                   prompt_cache=cache, after_prefill=om.cache.settle_inflight), \
        lambda: dp.stats.repairs


def _run(s: Schedule, refs: References) -> tuple[list, list, int, int]:
    """The engine's (tokens, log-probabilities (plain; else []), repairs, shrinks) under schedule `s`."""
    budget = "100%" if s.budget == "split" else s.budget
    om = OffloadedModel.load(refs.dirs[s.family], OffloadConfig(budget=budget, inject=s.faults, threads=2))
    events = {}
    for i, kind, args in s.events:
        events.setdefault(i, []).append((kind, args))
    tokens, logprobs, decoder, steps = [], [], None, None
    try:
        warm_start(om)
        om.cache.settle_inflight()
        if s.governor:  # counted from the first read after the warm start
            om.loader.reader = GovernorReader(om.loader.reader, om.cache, s.governor)
        if s.split:
            om.cache.set_usable_slots({l: om.cache.n_slots(l) for l in om.moe_layers}
                                      | {om.moe_layers[i % len(om.moe_layers)]: n for i, n in s.split})
        ids = om.tokenizer.encode(PROMPT)
        with device_mode(s.device):
            if s.mode == "plain":
                steps, repairs = plain_steps(om, ids, s.one_sync, s.sampling, s.seed, s.n_tokens)
                for token, lp in steps:
                    tokens.append(int(token))
                    logprobs.append(np.array(lp))
                    for kind, args in events.get(len(tokens) - 1, ()):
                        apply_event(om, kind, args, 10_000 + len(tokens))
                n_repairs = repairs()
            else:
                model, config = refs.drafter()
                seeded = s.sampling == "seeded"
                decoder = speculative_decoder(om, None, ids, max_tokens=s.n_tokens, num_draft=s.num_draft,
                                              predictor=s.predictor, cutoff=None, temp=TEMP if seeded else 0.0,
                                              seed=s.seed, draft_model=model, draft_config=config,
                                              one_sync=s.one_sync)
                for token in decoder.stream(ids, s.n_tokens):
                    tokens.append(int(token))
                    for kind, args in events.get(len(tokens) - 1, ()):
                        apply_event(om, kind, args, 10_000 + len(tokens))
                n_repairs = decoder.stats.repairs
        return tokens, logprobs, n_repairs, om.cache.resize_stats.n_shrinks
    finally:
        try:
            if steps is not None:
                steps.close()  # an error mid-run: the engine settles its queued forward before the model closes
        finally:
            if decoder is not None:
                release_drafter(decoder.drafter)
            om.close()


def run_schedule(s: Schedule, refs: References) -> Outcome:
    out = Outcome(s)
    try:
        if s.mode == "spec" and s.sampling == "seeded":
            expected, stock_lp = refs.speculative(s), []
        else:
            expected, stock_lp = refs.stock(s.family, s.sampling if s.mode == "plain" else "greedy", s.seed,
                                            s.n_tokens)
        out.expected = expected
        out.tokens, logprobs, out.repairs, out.shrinks = _run(s, refs)
    except Exception as e:  # a run that breaks is a finding, reported with the schedule
        out.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        return out
    n = min(len(out.tokens), len(expected))
    out.compared = n
    diff = next((i for i in range(n) if out.tokens[i] != expected[i]), None)
    out.mismatches = (n - diff if diff is not None else 0) + abs(len(out.tokens) - len(expected))
    if logprobs and stock_lp:
        out.logit_mismatches = sum(not np.array_equal(a, b) for a, b in zip(logprobs[:n], stock_lp[:n]))
    return out
