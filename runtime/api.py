"""The Python API, in mlx-lm's shape: `load`, then `stream_generate` or `generate`.

    from runtime import load, stream_generate
    engine = load("~/models/q3.specmoe", budget="40%", draft="~/models/Qwen3-0.6B-4bit")
    for r in stream_generate(engine, "Hello", max_tokens=64):
        print(r.text, end="", flush=True)
    print(r.stats.tokens_per_s, r.stats.hit_rate, r.stats.prefill.seconds)
    print(engine.totals().bytes_read, engine.plan.slots)

`load` takes every engine setting (budget, drafter, I/O, memory limit, ...) and
opens the model with its routed experts paged from disk into a budgeted cache (and the drafter, if
given); `stream_generate` takes the per-call settings (sampling, prompt cache, KV bits) and
yields one `GenerationResponse` per emitted token, plain or speculative, each carrying one
`RunStats` (runtime/run_stats.py: decode-only rates, a prefill and a decode part, the drafter's
part); `generate` returns the text. `Engine.totals()` gives the running totals since load
(lookups, reads, bytes, host syncs, usable slots) and `Engine.plan` what the budget became (bytes
and slots per MoE layer). docs/json.md documents every field.

Your own token loop: `engine.model.model` is the mlx-lm model whose MoE layers read the expert
cache, so `model(ids[None], cache=make_prompt_cache(model))` or mlx-lm's `generate_step` over it
gives the resident model's tokens (lossless), and totals and the plan still count. It skips what
`stream_generate` adds around the model: one host sync per token where it decodes through device
passes (a full budget, or one_sync="on"; your loop's MoE layers each read their routing back, one
sync per layer, which also stops mlx-lm's async pipelining of the next step), the repair of absent
experts and the verify windows' early syncs, the warm start (a full budget's experts read up
front), the memory limit's KV accounting (slots given back as the KV grows; prefill
chunks sized to fit), the drafter (speculative decoding and its prefetch) and RunStats.
Expert-major prefill, caching and the memory governor stay on: they live in the MoE layers and
the cache.

Invariants: a prompt string is tokenized as given (apply a chat template yourself, as with
mlx-lm); greedy output equals the resident mlx-lm model's; every call starts a fresh KV cache and
leaves the expert cache warm for the next; the drafter's taps are removed when a stream ends,
however it ends (exhausted, closed early, or raising).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.sample_utils import make_sampler

from runtime.cache import DEFAULT_POLICY, BudgetPlan, GovernorConfig
from runtime.decode import (OffloadConfig, OffloadedModel, default_predictor, load_drafter, release_drafter,
                            speculative_decoder, stream_tokens, text_config)
from runtime.run_stats import PhaseStats, RunMeter, RunStats, SpeculativeStats, Totals

__all__ = ["load", "stream_generate", "generate", "Engine", "GenerationResponse", "DraftSettings", "RunStats",
           "PhaseStats", "SpeculativeStats", "Totals"]

ONE_SYNC = ("auto", "on", "off")
KV_GROUP = 64  # mlx-lm's kv_group_size: its quantized KV cache groups each head's values in 64s


@dataclass(frozen=True)
class DraftSettings:
    path: Path  # drafter directory (an mlx-lm model sharing the target's tokenizer)
    num_draft: int  # K: tokens proposed per round
    predictor: str  # expert forecaster: none, previous, popularity, spmoe, oracle
    cutoff: int  # prefetch for the first `cutoff` MoE layers; the MoE layer count: all, 0: none
    projection: Path | None = None  # drafter->target projection file (spmoe); None: next to the target


@dataclass
class Engine:
    """What `load` returns and `stream_generate` / `generate` take: the model and its engine settings.

    `model.model` is the paged mlx-lm model for a token loop of your own; what that loop loses
    against `stream_generate` is listed in this module's docstring (and docs/json.md)."""

    model: OffloadedModel  # the target, experts paged through its cache
    draft: DraftSettings | None = None  # speculative decoding when set
    notes: list[str] = field(default_factory=list)  # where settings came from (tuning.json, defaults)
    policy: str = DEFAULT_POLICY  # the expert cache's eviction policy
    one_sync: str = "auto"  # how decode steps and verify passes sync (load's docstring); "on"/"off" for comparisons
    _draft_model: object = None
    _draft_config: dict | None = None

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def plan(self) -> BudgetPlan:
        """What the budget became: `budget_bytes`, `slots` (MoE layer -> expert slots), `fraction` of all
        expert bytes, `min_bytes` (the smallest budget that runs), `breakdown` (how "auto" was computed)."""
        return self.model.plan

    def totals(self) -> Totals:
        """Running totals since load, over every call (runtime/run_stats.py: Totals)."""
        return Totals.of(self.model)

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class GenerationResponse:
    text: str  # the next segment of decoded text (may be empty)
    token: int  # the emitted token id
    stats: RunStats  # the run so far: decode-only rates, prefill and decode parts, the drafter's part
    finish_reason: str | None = None  # "stop" (end of sequence), "length" (max_tokens) or None
    detail: object = None  # last response only: the decoder's own record, for diagnostics (GenerationStats
    # when plain, SpecStats when speculative; its fields differ by decoder: `stats` is the one shape)


def load(model: str | Path, budget: str = "auto", draft: str | Path | None = None, *, num_draft: int | None = None,
         predictor: str | None = None, cutoff: int | None = None, policy: str | None = None, threads: int = 4,
         io_mode: str = "buffered", verify: bool = True, memory_governor: bool = True,
         projection: str | Path | None = None, telemetry: bool = True, inject: str = "",
         memory_limit: str | None = "auto", context_tokens: int = 4096, one_sync: str = "auto") -> Engine:
    """Open `model` (an mlx-lm checkpoint directory or a `specmoe convert` store) with its routed experts
    paged into a cache of `budget` ("6GB", "40%" or "auto"). With `draft`, generation is speculative;
    settings not given come from tuning.json for this model, drafter, budget and machine, else defaults
    (predictor spmoe, or none for a drafter of another width without a projection: a note in `notes` says so).
    `memory_limit` ("12GB", "auto": the auto budget rule's memory, None: no cap) caps the whole process --
    baseline, resident weights, KV and state at `context_tokens`, drafter, expert cache -- and the expert cache
    gives slots back as the KV outgrows that context (runtime/cache/memory_limit.py).
    `one_sync`: "auto" (the default) decodes with one host sync per token (experts looked up on the device,
    repaired when one was absent) while the budget holds every expert, else with one sync per MoE layer; verify
    windows look up on the device and sync early at the layers whose windows keep missing
    (runtime/decode/plain.py, window_routes.py; docs/flags.md). "on" (device passes at any budget) and "off" (one
    sync per MoE layer at any budget) are for comparisons (bench/bench_defaults.py; no command-line flag: neither
    is faster than the default in bench/results/decode_defaults.txt). K follows acceptance (down to plain rounds).
    `telemetry` keeps per-round records (on by default, as `specmoe generate`); `inject` is a debugging aid: disk faults to inject (spec: storage/faults.py)."""
    if one_sync not in ONE_SYNC:
        raise ValueError(f"one_sync {one_sync!r}; expected auto, on or off")
    notes = []
    settings = None
    asked_predictor = predictor is not None  # named by the caller (resolve_settings fills it in otherwise)
    if draft is not None:
        from runtime.tune import resolve_settings

        num_draft, predictor, cutoff, policy, note = resolve_settings(Path(model), Path(draft), budget, num_draft,
                                                                      predictor, cutoff, policy)
        if note:
            notes.append(note)
        settings = DraftSettings(Path(draft), num_draft, predictor, cutoff, Path(projection) if projection else None)
    om = OffloadedModel.load(model, OffloadConfig(budget=budget, policy=policy or DEFAULT_POLICY, threads=threads,
                                                  io_mode=io_mode, verify_checksums=verify,
                                                  governor=GovernorConfig() if memory_governor else None,
                                                  telemetry=telemetry, inject=inject, memory_limit=memory_limit,
                                                  context_tokens=context_tokens,
                                                  drafter_bytes=_weights_bytes(draft) if draft is not None else 0))
    if settings is not None and settings.cutoff is None:  # all layers, said as the count (as --json reports it)
        from dataclasses import replace

        settings = replace(settings, cutoff=len(om.moe_layers))
    engine = Engine(om, settings, notes, policy or DEFAULT_POLICY, one_sync)
    if settings is not None:
        try:
            engine._draft_model, engine._draft_config = load_drafter(settings.path, om)
        except BaseException:
            om.close()
            raise
        # spmoe by default only where it runs as is: a drafter of another width without a fitted projection falls
        # back to a predictor that needs none, with one note (runtime/decode/predictor_default.py)
        chosen, note = default_predictor(settings.predictor, asked_predictor, om.store.model_dir, om.config,
                                         settings.path, engine._draft_config, settings.projection)
        if note:
            from dataclasses import replace

            engine.draft = replace(settings, predictor=chosen)
            notes.append(note)
    return engine


def _weights_bytes(path: str | Path) -> int:
    """Bytes of a model directory's weight files (the drafter's share of a memory limit)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def stream_generate(engine: Engine, prompt: str | list[int], max_tokens: int = 256, *, temp: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                    one_sync: str | None = None, progress=None, prompt_cache=None,
                    kv_bits: int | None = None, warm: str | None = None) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per emitted token; the last has finish_reason set. `progress`
    (a runtime.observe.PrefillProgress) shows the prompt's processing; the last response's
    detail.prefill says what it cost (tokens/s, bytes read, reads per routed expert). `prompt_cache`
    (runtime.decode.PromptCache, plain decoding only) keeps a conversation's KV cache and state: a
    prompt that extends what it holds prefills only the new tokens. `kv_bits` (plain decoding) quantizes the
    KV cache as mlx-lm does (from 5000 tokens on; lossy). A full budget reads every expert before decoding;
    `warm="off"` starts from the cache as it is instead (e.g. to measure a cold start). `one_sync` is an engine
    setting (`load(one_sync=...)`); given here, it overrides the engine's for this call."""
    om, tokenizer = engine.model, engine.tokenizer
    if isinstance(prompt, str):  # as mlx-lm: no second BOS when the prompt already starts with one
        bos = getattr(tokenizer, "bos_token", None)
        ids = list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty after tokenization; expected at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens {max_tokens}; expected >= 1")
    one_sync = engine.one_sync if one_sync is None else one_sync
    if one_sync not in ONE_SYNC:
        raise ValueError(f"one_sync {one_sync!r}; expected auto, on or off")
    if warm not in (None, "off"):
        raise ValueError(f"warm {warm!r}; expected None (a full budget reads every expert first) or 'off'")
    check_kv_bits_fits(om.config, kv_bits, len(ids) + max_tokens)
    if seed is not None:
        mx.random.seed(seed)
    eos = set(tokenizer.eos_token_ids)
    decoder = None
    if (prompt_cache is not None or kv_bits) and engine.draft is not None:
        raise ValueError("prompt_cache / kv_bits with a drafter: the speculative decoder neither saves nor trims the "
                         "drafter's KV beside the target's, nor quantizes its caches (not implemented); load without draft")
    if engine.draft is None:
        sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
        tokens = stream_tokens(om.model, ids, max_tokens=max_tokens, eos_ids=eos, om=om, one_sync=one_sync,
                               sampler=sampler, progress=progress, prompt_cache=prompt_cache, kv_bits=kv_bits,
                               warm=warm)
    else:
        d = engine.draft
        decoder = speculative_decoder(om, d.path, ids, max_tokens=max_tokens, num_draft=d.num_draft,
                                      predictor=d.predictor, cutoff=d.cutoff, projection=d.projection, temp=temp,
                                      top_p=top_p, top_k=top_k, min_p=min_p, seed=0 if seed is None else seed, eos_ids=eos,
                                      draft_model=engine._draft_model, draft_config=engine._draft_config,
                                      one_sync=one_sync, warm=warm)
        tokens = decoder.stream(ids, max_tokens, eos, progress=progress)
    try:
        yield from _responses(tokens, tokenizer, RunMeter(om, len(ids), prompt_cache), decoder, max_tokens, eos)
    finally:
        tokens.close()
        if decoder is not None:
            release_drafter(decoder.drafter)


def check_kv_bits_fits(config: dict, kv_bits: int | None, positions: int) -> None:
    """A run that reaches mlx-lm's quantized_kv_start (5000 tokens) on a model whose head_dim is not a multiple of
    KV_GROUP would fail inside mlx when the cache converts (mid-run, with a traceback): refused before the prefill."""
    cfg = text_config(config)
    if not kv_bits or positions < DEFAULT_QUANTIZED_KV_START or "kv_lora_rank" in cfg:  # MLA caches: other shapes
        return
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    if head_dim % KV_GROUP:
        raise ValueError(f"kv_bits {kv_bits} with {positions} tokens: mlx-lm quantizes the KV cache from its "
                         f"{DEFAULT_QUANTIZED_KV_START}th token in groups of {KV_GROUP} values per head, and this "
                         f"model's head_dim is {head_dim}; drop --kv-bits or keep prompt + max tokens under "
                         f"{DEFAULT_QUANTIZED_KV_START}")


def generate(engine: Engine, prompt: str | list[int], max_tokens: int = 256, **kwargs) -> str:
    """The whole text stream_generate produces (same arguments)."""
    return "".join(r.text for r in stream_generate(engine, prompt, max_tokens, **kwargs))


def _responses(tokens, tokenizer, meter: RunMeter, decoder, max_tokens: int, eos) -> Iterator[GenerationResponse]:
    detok = tokenizer.detokenizer
    detok.reset()
    meter.start()
    for n, token in enumerate(tokens, start=1):
        stats = meter.stats(n, None if decoder is None else decoder.stats)  # before the next token is asked for
        finish = "stop" if token in eos else ("length" if n >= max_tokens else None)
        if finish != "stop":
            detok.add_token(token)
        detail = None
        if finish:
            detok.finalize()
            detail = _drain(tokens) if decoder is None else decoder.stats
        yield GenerationResponse(detok.last_segment, token, stats, finish, detail)
        if finish:
            return


def _drain(tokens):
    """The value a finished token generator returns (its run's stats), None if it had more to give."""
    try:
        next(tokens)
    except StopIteration as done:
        return done.value
    return None
