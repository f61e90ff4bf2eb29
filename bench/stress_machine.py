"""The stateful stress machine: Hypothesis drives the real engine step by step, every token vs stock mlx-lm.

The seeded harness (bench/stress_schedules.py, bench/stress_lossless.py) draws whole schedules from a seed; a
failing one is reported as drawn. Here a hypothesis.stateful.RuleBasedStateMachine drives one engine step by step:

- start (once): a family's tiny checkpoint as an OffloadedModel at a budget (a share, or a per-layer split of 100%
  that leaves one layer whole: its ids are its slots), plain or speculative decoding, greedy or seeded sampling,
  the one-sync setting, the device ("async", "lazy": queued graphs run at the next sync, "eager": at once);
- decode(n): the next n tokens; each equals stock mlx-lm's token at that position, and in plain decoding its
  log-probabilities equal stock's exactly (the invariant; the reference streams are computed once per family,
  sampling and seed by stress_schedules.References);
- events between tokens, while the next forward is built and pending: a governor shrink (all layers or per layer)
  and a grow, applied now or at the engine's next resize point; a resize requested from an I/O thread at a given
  read; a prefetch that arrives early, late or never; slow reads; a read error the loader retries (EIO, EINTR, a
  short read); the device switching between running queued work as it does, late or at once.

Hypothesis explores the interleavings and, when a step fails, shrinks the sequence to a minimal one and prints it
(state.start(...), state.decode(n=1), ...). Nothing here changes package code; a planted defect
(bench/stress_lossless.py's MUTATIONS) is undone after its run.

explore() runs the machine with deterministic settings and catches the failure; replay() reruns a shrunk trace;
find_mutation() plants a defect for one run. The command is bench/stress_stateful.py; the suite's run is
tests/test_lossless_stateful.py.
"""

from __future__ import annotations

import functools
import itertools
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.internal.conjecture import engine as shrink_engine  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test  # noqa: E402,E501

from bench.stress_schedules import (BUDGETS, MODES, PROMPT, SAMPLINGS, TEMP, TINY, Device,  # noqa: E402
                                    GovernorReader, References, Schedule, apply_event, plain_steps)
from runtime.checkpoints.tiny import FAMILIES  # noqa: E402
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel  # noqa: E402
from runtime.decode.speculative_run import release_drafter, speculative_decoder  # noqa: E402
from runtime.decode.warm import warm_start  # noqa: E402
from storage.faults import FaultSpec, FaultyReader  # noqa: E402

N_TOKENS = 16  # tokens a machine may decode (decode's precondition: fewer so far)
ONE_SYNCS = ("on", "auto", "off")
THEN = st.integers(0, 2)  # tokens an event rule decodes right after its event (0: the next step may be another)
DEVICES = ("async", "lazy", "eager")
# Weighted as the seeded schedules are, towards what pipelined forwards race with: plain decoding (its next forward
# is pending at every step), whole layers (100%, split: ids are slots), a device that runs queued work late.
MODE_WEIGHTS = {"plain": 2, "spec": 1}
BUDGET_WEIGHTS = {"100%": 3, "50%": 2, "25%": 2, "split": 3}
ONE_SYNC_WEIGHTS = {"on": 2, "auto": 2, "off": 1}
DEVICE_WEIGHTS = {"async": 3, "lazy": 5, "eager": 2}


def _weighted(options, weights: dict) -> list:
    """Each option repeated by its weight (1 if unlisted)."""
    return [o for o in options for _ in range(weights.get(o, 1))]


@dataclass
class Tally:
    """What the machines of one run did; `trace` is the last example's steps: after a failure, the shrunk example
    (Hypothesis replays the minimal failing example last)."""

    examples: int = 0  # machines started (one engine each)
    steps: int = 0  # rules run, start included
    tokens: int = 0  # tokens compared with the reference
    logits: int = 0  # plain decoding: positions whose log-probabilities were compared exactly
    mismatches: int = 0  # tokens or log-probabilities that differed
    errors: int = 0  # steps that raised something other than a mismatch (the engine broke)
    first_failure: int | None = None  # the example count when a step first failed
    rules: Counter = field(default_factory=Counter)  # rule name -> times run
    configs: Counter = field(default_factory=Counter)  # (family, budget, mode, sampling) -> machines started
    trace: list = field(default_factory=list)  # the last example's steps: (rule, its arguments)


class DeviceSwitch:
    """Sets how the device runs queued work, as the runtime.decode modules see `mx`, at any step; restore() undoes it."""

    def __init__(self):
        self.modules = [m for name, m in list(sys.modules.items())
                        if name.startswith("runtime.decode") and getattr(m, "mx", None) is mx]

    def set(self, kind: str) -> None:
        fake = mx if kind == "async" else Device(kind)
        for m in self.modules:
            m.mx = fake

    def restore(self) -> None:
        self.set("async")


def lossless_machine(refs: References, tally: Tally, families=FAMILIES, budgets=BUDGETS, modes=MODES,
                     samplings=SAMPLINGS, n_tokens: int = N_TOKENS) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class over `refs`' checkpoints that counts into `tally`."""
    layers, n_experts, top_k = TINY["layers"], TINY["n_experts"], TINY["top_k"]
    slots = st.integers(top_k, n_experts)
    # Every (family, budget, mode, sampling, one-sync, device), weighted, in a fixed shuffled order: Hypothesis draws
    # a long list's small indices far more often, so an ordered product would mostly run its first family and budget.
    configs = list(itertools.product(families, _weighted(budgets, BUDGET_WEIGHTS), _weighted(modes, MODE_WEIGHTS),
                                     samplings, _weighted(ONE_SYNCS, ONE_SYNC_WEIGHTS), _weighted(DEVICES, DEVICE_WEIGHTS)))
    random.Random(0).shuffle(configs)

    def checked(step):
        """A step whose exception (other than a mismatch) is counted as an error before Hypothesis sees it."""
        @functools.wraps(step)
        def call(self, **args):
            try:
                return step(self, **args)
            except AssertionError:
                raise
            except Exception:
                tally.errors += 1
                self._failed()
                raise
        return call

    class LosslessMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.om = self.steps = self.decoder = None
            self.device = None
            self.pos = 0
            self.n_events = 0
            self.errors = None  # the FaultyReader of read errors (its one armed fault replaced by the next)
            tally.examples += 1
            tally.trace = self.trace = []

        def _did(self, name: str, **args) -> None:
            tally.steps += 1
            tally.rules[name] += 1
            self.trace.append((name, args))

        def _failed(self) -> None:
            if tally.first_failure is None:
                tally.first_failure = tally.examples

        @initialize(config=st.sampled_from(configs), variant=st.integers(0, 2**16 - 1))
        @checked
        def start(self, config, variant):
            """One engine: config is (family, budget, mode, sampling, one-sync, device); variant seeds the rest (the
            sampling seed, a split's per-layer slots and its whole layer, the drafter's forecaster and K). One draw
            each keeps shrinking cheap (every draw of the first step is another engine load to try)."""
            self._did("start", config=config, variant=variant)
            family, budget, mode, sampling, one_sync, device = config
            r = random.Random(variant)
            seed, whole = r.randrange(4), r.randrange(layers)
            split = [r.randint(top_k, n_experts // 2) for _ in range(layers)]
            predictor, num_draft = r.choice(["previous", "spmoe", "none"]), r.choice([3, 2, 4])
            tally.configs[(family, budget, mode, sampling)] += 1
            self.label = f"{family} {budget} {mode} {sampling} one-sync {one_sync}"
            self.plain = mode == "plain"
            if mode == "spec" and sampling == "seeded":  # the same decoder at 100%, no event, computed before
                self.expected, self.expected_lp = refs.speculative(Schedule(  # the device is switched
                    seed, family, "100%", "spec", "seeded", "on", "async", "", n_tokens, predictor=predictor,
                    num_draft=num_draft)), None
            else:
                self.expected, self.expected_lp = refs.stock(family, sampling if self.plain else "greedy", seed,
                                                             n_tokens)
            self.om = om = OffloadedModel.load(refs.dirs[family], OffloadConfig(
                budget="100%" if budget == "split" else budget, threads=2))
            warm_start(om)
            om.cache.settle_inflight()
            if budget == "split":  # every layer but `whole` shrunk to its split
                om.cache.set_usable_slots({l: (om.cache.n_slots(l) if i == whole else split[i])
                                           for i, l in enumerate(om.moe_layers)})
            self.device = DeviceSwitch()
            self.device.set(device)
            ids = om.tokenizer.encode(PROMPT)
            if self.plain:
                self.steps, _ = plain_steps(om, ids, one_sync, sampling, seed, n_tokens)
            else:
                model, config = refs.drafter()
                self.decoder = speculative_decoder(
                    om, None, ids, max_tokens=n_tokens, num_draft=num_draft, predictor=predictor, cutoff=None,
                    temp=TEMP if sampling == "seeded" else 0.0, seed=seed, draft_model=model, draft_config=config,
                    one_sync=one_sync)
                self.steps = self.decoder.stream(ids, n_tokens)

        @precondition(lambda self: self.pos < n_tokens)
        @rule(n=st.integers(1, 6))
        @checked
        def decode(self, n):
            """The next n tokens, each compared with the reference (plain: its log-probabilities exactly)."""
            self._did("decode", n=n)
            self._decode(n)

        def _decode(self, n: int) -> None:
            for _ in range(min(n, n_tokens - self.pos)):
                try:
                    out = next(self.steps)
                except StopIteration:
                    self._failed()
                    raise AssertionError(f"{self.label}: the engine stopped after {self.pos} of {n_tokens} tokens")
                token, lp = (int(out[0]), out[1]) if self.plain else (int(out), None)
                i, self.pos = self.pos, self.pos + 1
                tally.tokens += 1
                tally.logits += lp is not None
                wrong = (f"token {i} is {token}, the reference's {self.expected[i]}" if token != self.expected[i] else
                         f"token {i}'s log-probabilities differ from stock's"
                         if lp is not None and not np.array_equal(np.array(lp), self.expected_lp[i]) else "")
                if wrong:  # one place raises: Hypothesis shrinks token and logit mismatches as one failure
                    tally.mismatches += 1
                    self._failed()
                    raise AssertionError(f"{self.label}: {wrong}")

        @rule(n=st.one_of(st.integers(top_k, n_experts - 1), st.tuples(*[slots] * layers)), now=st.booleans(), then=THEN)
        @checked
        def shrink(self, n, now, then):
            """The governor asks every layer (or each layer: a tuple) for n usable slots; applied now (the decode
            loop's usable_now()) or at the engine's next resize point."""
            self._did("shrink", n=n, now=now, then=then)
            self._event("resize", (n, now))
            self._decode(then)

        @rule(now=st.booleans(), then=THEN)
        @checked
        def grow(self, now, then):
            self._did("grow", now=now, then=then)
            self._event("grow", (now,))
            self._decode(then)

        @rule(keys=st.lists(st.tuples(st.integers(0, layers - 1), st.integers(0, n_experts - 1)), min_size=1,
                            max_size=6), when=st.sampled_from(["early", "late", "never"]), then=THEN)
        @checked
        def prefetch(self, keys, when, then):
            """Random experts prefetched: settled at once (early), left in flight (late) or cancelled (never)."""
            self._did("prefetch", keys=keys, when=when, then=then)
            self._event("prefetch", (tuple(keys), when))
            self._decode(then)

        @rule(after=st.integers(1, 20), n=slots, then=THEN)
        @checked
        def governor_at_read(self, after, n, then):
            """A resize requested from an I/O thread at the after-th read from now, mid-forward."""
            self._did("governor_at_read", after=after, n=n, then=then)
            self.om.loader.reader = GovernorReader(self.om.loader.reader, self.om.cache, ((after, n),))
            self._decode(then)

        @rule(kind=st.sampled_from(["eio", "eintr", "short"]), after=st.integers(0, 8), times=st.integers(1, 2),
              then=THEN)
        @checked
        def read_error(self, kind, after, times, then):
            """The loader's reads, after `after` good ones, fail `times` times (a short read: once); it retries them.
            One error is armed at a time (a new one replaces the last): the loader gives up after 4 attempts of a
            read, which stacked errors could reach (a StoreError, as it should be, not a lossless failure)."""
            self._did("read_error", kind=kind, after=after, times=times, then=then)
            spec = FaultSpec(kind, after=after, times=1 if kind == "short" else times)
            if self.errors is None:
                self.errors = self._fault(spec)
            else:
                self.errors.faults = FaultyReader(None, [spec]).faults
            self._decode(then)

        @rule(ms=st.sampled_from([1.0, 0.2, 3.0]), times=st.integers(1, 8), then=THEN)
        @checked
        def slow_reads(self, ms, times, then):
            """The loader's next `times` reads take ms longer each."""
            self._did("slow_reads", ms=ms, times=times, then=then)
            self._fault(FaultSpec("slow", ms=ms, times=times))
            self._decode(then)

        @rule(kind=st.sampled_from(list(DEVICES)), then=THEN)
        @checked
        def device_runs(self, kind, then):
            """From now on the device runs queued work as it does, late (at the next sync) or at once."""
            self._did("device_runs", kind=kind, then=then)
            self.device.set(kind)
            self._decode(then)

        def _event(self, kind: str, args: tuple) -> None:
            self.n_events += 1
            apply_event(self.om, kind, args, 10_000 + self.n_events)

        def _fault(self, spec: FaultSpec) -> FaultyReader:
            self.om.loader.reader = reader = FaultyReader(self.om.loader.reader, [spec])
            return reader

        def teardown(self):
            try:
                if self.steps is not None:
                    self.steps.close()  # settles a queued forward before the model closes
            finally:
                if self.device is not None:
                    self.device.restore()
                if self.decoder is not None:
                    release_drafter(self.decoder.drafter)
                if self.om is not None:
                    self.om.close()

    return LosslessMachine


def machine_settings(examples: int, steps: int) -> settings:
    """Deterministic settings: derandomized, no example database, no deadline (an example loads an engine); one
    failure shrunk (the smallest, not one per kind), and no explain phase (it reruns hundreds of examples to mark
    which arguments of the shrunk one could vary)."""
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=False,
                    report_multiple_bugs=False, phases=[Phase.explicit, Phase.generate, Phase.shrink])


@dataclass
class Finding:
    """A run of the machine: whether a step failed, and the (shrunk) failing sequence."""

    failed: bool  # some example failed (Hypothesis raised after shrinking)
    error: str  # the failure's one-line message ("" if none)
    trace: list  # the shrunk failing sequence (start included), or the last example's steps
    seconds: float  # wall time of the run


def explore(refs: References, tally: Tally, examples: int, steps: int, shrink_seconds: float | None = None,
            **options) -> Finding:
    """Run the machine for `examples` examples of `steps` steps; a failure is caught, not raised. `shrink_seconds`
    bounds the shrinking (Hypothesis's own bound, MAX_SHRINKING_SECONDS: 300 s) for this run only."""
    t0 = time.perf_counter()
    saved = shrink_engine.MAX_SHRINKING_SECONDS
    if shrink_seconds is not None:
        shrink_engine.MAX_SHRINKING_SECONDS = shrink_seconds
    try:
        run_state_machine_as_test(lossless_machine(refs, tally, **options), settings=machine_settings(examples, steps))
        failed, error = False, ""
    except Exception as e:  # a failing example (after shrinking) or a flaky one: a finding either way
        failed, error = True, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:240]
    finally:
        shrink_engine.MAX_SHRINKING_SECONDS = saved
    return Finding(failed, error, list(tally.trace), time.perf_counter() - t0)


def replay(refs: References, trace: list, **options) -> str:
    """Run a trace's steps (Tally.trace) on a fresh machine: "" if every step passed, else the failure's message."""
    machine = lossless_machine(refs, Tally(), **options)()
    try:
        for name, args in trace:
            getattr(machine, name)(**args)
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        machine.teardown()


def find_mutation(refs: References, plant, examples: int, steps: int, **options) -> tuple[Finding, Tally]:
    """Plant a defect (a function of a pytest MonkeyPatch), explore, undo it."""
    import pytest

    tally, mp = Tally(), pytest.MonkeyPatch()
    try:
        plant(mp)
        return explore(refs, tally, examples, steps, **options), tally
    finally:
        mp.undo()


def shown(trace: list) -> str:
    """A trace as Hypothesis prints a state machine's steps, one line: start(config=(...), variant=0); decode(n=1)."""
    return "; ".join(f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})" for name, args in trace)
