"""OffloadedModel: an mlx-lm model whose routed experts are paged from disk.

Loading: mlx-lm builds the model lazily from the checkpoint (raw) or from the
store's resident weights (packed); every expert module found from the model's
structure (runtime/decode/moe_blocks.py: `switch_mlp`, gpt-oss's `experts`, ...) is
replaced on that instance by a CachedSwitchGLU running the family's own class before any parameter is evaluated, so expert
tensors are never materialised. mlx-lm classes are not patched: a stock model
loaded in the same process is unaffected.

Invariants: after load() every non-expert parameter came from the checkpoint
(missing ones are an error naming the tensor), every stacked expert block in the
store has exactly one module, and the cache holds at most the budget. With --io-mode
direct the resident tensors' file pages are dropped from the page cache once loaded
(storage/file_pages.py), so under a memory cap they do not take the cache's room; the
resident weights are evaluated before the expert cache allocates its slabs, so the
load's peak is the larger of the two, not their sum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, load_tokenizer

from runtime.cache import DEFAULT_POLICY, BudgetPlan, kv_bytes_estimate, parse_budget, plan_budget
from runtime.cache import CachedSwitchGLU
from runtime.cache import ExpertCache
from runtime.decode.families import check_supported, top_k
from runtime.decode.layer_replay import LayerReplay
from runtime.decode.moe_blocks import block_info, match_expert_modules
from runtime.cache import GovernorConfig, MemoryGovernor
from runtime.cache import DEFAULT_PREFILL_STEP, ContextGovernor, apply_memory_limit, process_rss, rss_peak_since_last
from runtime.observe import Telemetry
from storage import AsyncLoader, ExpertStore, LoaderConfig, StoreError
from storage.faults import FaultyReader, parse_faults
from storage.reader import RangeReader

if TYPE_CHECKING:  # for the annotation only; routers() imports it when called
    from predictor.spmoe import TargetRouter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadConfig:
    budget: str = "50%"  # --budget: size, share of expert bytes, or auto
    policy: str = DEFAULT_POLICY  # eviction policy name (runtime/cache/policy.py)
    threads: int = 4  # loader I/O threads
    io_mode: str = "buffered"  # "buffered" or "direct"
    verify_checksums: bool = True  # CRC-check packed records on every load (raw checkpoints have no CRCs)
    context_tokens: int = 4096  # KV-cache size assumed by --budget auto
    telemetry: bool = True  # per-round, per-layer records (cheap; see bench/bench_telemetry.py)
    trace: bool = False  # also keep every token's routing for a trace file
    governor: GovernorConfig | None = None  # shrink the cache when RAM runs low (None: off)
    inject: str = ""  # debug only: storage.faults spec of disk faults to inject ("": none)
    memory_limit: str | None = None  # --memory-limit: cap on the whole process ("auto", "12GB"); None: none
    drafter_bytes: int = 0  # the drafter's weights, counted against the memory limit


def get_module(root: nn.Module, path: str) -> nn.Module:
    node = root
    for p in path.split(".") if path else []:
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(get_module(root, parent), leaf, module)


class OffloadedModel:
    """The model, its tokenizer, and the store/loader/cache that feed its experts."""

    def __init__(self, model, tokenizer, config: dict, store: ExpertStore, loader: AsyncLoader,
                 cache: ExpertCache, plan: BudgetPlan, modules: dict[int, CachedSwitchGLU], telemetry: Telemetry | None,
                 governor: MemoryGovernor | None = None):
        self.model = model  # the mlx-lm model with cache-backed expert modules
        self.tokenizer = tokenizer  # mlx-lm TokenizerWrapper
        self.config = config  # config.json as loaded by mlx-lm
        self.store = store
        self.loader = loader
        self.cache = cache
        self.plan = plan  # budget, slots per layer and how they were computed
        self.modules = modules  # MoE layer -> its cache-backed expert module
        self.telemetry = telemetry  # per-round records fed by the modules (None when disabled)
        self.governor = governor  # memory governor resizing the cache (None when off)
        self.memory_limit = None  # the MemoryLimit of --memory-limit (None: no limit)
        self.context_governor = None  # gives back expert slots as the KV grows under the limit (None: no limit)
        self.prefill_step = DEFAULT_PREFILL_STEP  # prompt tokens per prefill chunk (smaller only when the limit needs it)
        # Verify windows' per-layer miss rates, carried from one generation to the next (window_routes.py)
        self.verify_layer_miss = None
        for m in modules.values():
            m.telemetry = telemetry
        # Device passes (runtime/decode/device_pass.py) recompute from a decoder layer after a miss.
        self.decoder_index = self._decoder_index()  # MoE layer -> index in model.layers (= prompt cache index)
        self.replay = LayerReplay(model.layers)

    @classmethod
    def load(cls, path: str | Path, cfg: OffloadConfig = OffloadConfig()) -> "OffloadedModel":
        faults = parse_faults(cfg.inject) if cfg.inject else None  # a bad spec is refused before anything opens
        baseline = process_rss()  # the process before the model: counted against --memory-limit
        store = ExpertStore.open(path, io_mode=cfg.io_mode)
        check_supported(store.config, Path(path) / "config.json")
        layouts = store.layouts()
        if not layouts:
            raise StoreError(path, "has no stacked routed-expert tensors (3-D *.{gate,up,down}_proj.weight); nothing to page")
        plan = plan_budget(
            parse_budget(cfg.budget),
            expert_bytes={l: lay.expert_bytes for l, lay in layouts.items()},
            n_experts={l: lay.n_experts for l, lay in layouts.items()},
            top_k=top_k(store.config),
            resident_bytes=store.resident_bytes,
            kv_bytes=kv_bytes_estimate(store.config, cfg.context_tokens),
        )
        limit, step = None, DEFAULT_PREFILL_STEP
        if cfg.memory_limit is not None:
            try:
                plan, limit, step, kv_per_token = apply_memory_limit(
                    plan, cfg.memory_limit, config=store.config, layouts=layouts, resident_bytes=store.resident_bytes,
                    context_tokens=cfg.context_tokens, drafter_bytes=cfg.drafter_bytes, top_k=top_k(store.config),
                    baseline_bytes=baseline)
            except BaseException:
                store.close()
                raise
        reader = FaultyReader(RangeReader(cfg.io_mode), faults, store) if faults else None
        loader = AsyncLoader(store, LoaderConfig(threads=cfg.threads, io_mode=cfg.io_mode, verify_checksums=cfg.verify_checksums),
                             reader=reader)
        try:
            model, config = load_model(store.model_dir, lazy=True, strict=False)
            experts = match_expert_modules(model, layouts, store.model_dir)
            # The resident weights first, then the slabs: the page cache's copy of the resident bytes (dropped
            # here with direct I/O) and the expert cache never take memory at the same time.
            skip = tuple(path + "." for path, _ in experts.values())
            mx.eval([v for k, v in tree_flatten(model.parameters()) if not k.startswith(skip)])
            if cfg.io_mode == "direct":  # the resident bytes now live in the model: no page-cache copy of them
                store.drop_resident_pages()
            cache = ExpertCache(layouts, plan.slots, loader, cfg.policy, min_usable=top_k(store.config))
            modules = cls._swap_experts(model, experts, layouts, cache)
            cls._check_resident(model, modules, store)
            mx.eval(model.parameters())
            tokenizer = load_tokenizer(store.model_dir, eos_token_ids=config.get("eos_token_id"))
        except BaseException:
            loader.close()
            store.close()
            raise
        telemetry = Telemetry(sorted(modules), trace=cfg.trace) if cfg.telemetry or cfg.trace else None
        governor = MemoryGovernor(cache, cfg.governor).start() if cfg.governor is not None else None
        om = cls(model, tokenizer, config, store, loader, cache, plan, modules, telemetry, governor)
        om.prefill_step = step
        if limit is not None:
            limit = limit.remeasured(process_rss(), store.resident_bytes + cache.nbytes)
            om.memory_limit = limit
            om.context_governor = ContextGovernor(cache, limit, store.config, step, governor, kv_per_token,
                                                  measure=rss_peak_since_last)  # closed loop: what the accounting misses
        return om

    @staticmethod
    def _swap_experts(model, experts, layouts, cache) -> dict[int, CachedSwitchGLU]:
        modules = {}
        for layer, (path, module) in experts.items():
            lay = layouts[layer]
            modules[layer] = CachedSwitchGLU(layer, lay, cache, module.activation, like=module)
            _set_module(model, path, modules[layer])
        return modules

    @staticmethod
    def _check_resident(model, modules, store) -> None:
        prefixes = tuple(store.layout(l).prefix + "." for l in modules)
        have = set(store.resident_tensors())
        for name, _ in tree_flatten(model.parameters()):
            if not name.startswith(prefixes) and name not in have:
                raise StoreError(store.model_dir, "missing weight (the checkpoint does not match config.json)", tensor=name)

    def _decoder_index(self) -> dict[int, int]:
        position = {id(layer): i for i, layer in enumerate(self.model.layers)}
        out = {}
        for layer in self.modules:
            path = self.store.layout(layer).prefix.rpartition(".")[0].rpartition(".")[0]  # "...layers.3"
            i = position.get(id(get_module(self.model, path)))
            if i is None:
                raise StoreError(self.store.model_dir, "MoE block is not inside one of model.layers", tensor=path)
            out[layer] = i
        return out

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.modules)

    @property
    def top_k(self) -> int:
        return top_k(self.config)

    def routers(self) -> dict[int, "TargetRouter"]:
        """Each MoE layer's post-attention norm and router gate, for forecasting."""
        from predictor.spmoe import TargetRouter

        out = {}
        for layer in self.modules:
            info = block_info(self.model, self.store.layout(layer).prefix)
            out[layer] = TargetRouter(layer, info.norm, info.logits)
        return out

    def label_round(self, kind: str) -> None:
        """Name the next forward in telemetry ("prefill", "verify", "rerun", ...)."""
        if self.telemetry is not None:
            self.telemetry.label(kind)

    def end_round(self) -> None:
        if self.telemetry is not None:
            self.telemetry.flush()

    def drop_prefetches_before(self, round_id: int) -> None:
        """Cancel queued prefetch reads of rounds before `round_id`: their forecast is stale."""
        self.loader.cancel_stale(round_id)

    def model_id(self) -> dict:
        """Identity of the model for traces: name, type, config digest, routing shape."""
        from predictor.projection import config_digest
        from runtime.decode.families import text_config

        cfg = text_config(self.config)
        first = self.store.layout(self.moe_layers[0])
        return {"name": self.store.model_dir.name, "model_type": self.config.get("model_type"),
                "digest": config_digest(self.config), "n_experts": first.n_experts, "top_k": self.top_k,
                "moe_layers": self.moe_layers, "hidden_size": cfg.get("hidden_size"), "expert_bytes": first.expert_bytes}

    def empty_cache(self) -> None:
        """Evict every expert (between generations): the next one starts cold, as after load()."""
        for m in self.modules.values():
            m.release()
        self.cache.empty()

    def set_observer(self, observer) -> None:
        """Call observer(layer, expert_ids (tokens, k)) on every MoE call; None to stop."""
        for m in self.modules.values():
            m.observer = observer

    # -- stats -------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Cumulative hits, misses, evictions, bytes read since load."""
        stats = self.cache.stats().values()
        return {
            "hits": sum(s.hits for s in stats),
            "misses": sum(s.misses for s in stats),
            "evictions": sum(s.evictions for s in stats),
            "prefetch_hits": sum(s.prefetch_hits for s in stats),
            "prefetch_loaded": sum(s.prefetch_loaded for s in stats),
            "prefetch_wasted": sum(s.prefetch_wasted for s in stats),
            "prefetch_cancelled": sum(s.prefetch_cancelled for s in stats),
            "bytes_read": self.loader.stats.bytes_read,
            "load_wait_ms": self.loader.stats.wait_ms,
            **(self.governor.counters() if self.governor is not None else {}),
        }

    def close(self) -> None:
        if self.governor is not None:
            self.governor.stop()
        self.loader.close()
        self.store.close()
