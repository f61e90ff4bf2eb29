"""Stage: one pipeline rank's share of an offloaded model.

Shapes: T = tokens in a window, D = hidden size, V = vocabulary.

Loading builds the mlx-lm model lazily (nothing is read), swaps the routed-expert
blocks of this rank's layers for CachedSwitchGLU modules over this rank's own
ExpertCache and AsyncLoader (reading the local store), evaluates only this rank's
non-expert weights (rank 0 also the embedding, final norm and LM head), and drops
every other reference to the model. The other ranks' layers are never read.

Invariants: a stage computes exactly what the same layers of the resident mlx-lm
model compute (same modules, same masks, same caches), so the chain of stages is
bit-identical to one process; the cache holds at most this rank's budget; a stage's
KV/recurrent caches after rewind() equal a run that never saw the rejected tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import load_model, load_tokenizer

from runtime.cache import CachedSwitchGLU, ExpertCache, kv_bytes_estimate, parse_budget, plan_budget
from runtime.decode import WindowReads, check_supported, text_config, top_k
from runtime.pipeline.stage_pass import stage_pass
from runtime.plan import StageSplit, balanced_split, explicit_split, layer_bytes, layer_of
from storage import AsyncLoader, ExpertStore, LoaderConfig, StoreError


@dataclass(frozen=True)
class StageConfig:
    budget: str = "50%"  # --budget per rank: a size, a share of this rank's expert bytes, or auto
    policy: str = "lru"  # eviction policy
    threads: int = 4  # loader I/O threads
    io_mode: str = "buffered"  # "buffered" or "direct"
    verify_checksums: bool = True  # CRC-check packed records
    context_tokens: int = 4096  # KV size assumed by --budget auto
    split: tuple[int, ...] | None = None  # layers per rank (--pipeline-split); None: balanced by bytes
    routers: bool = False  # rank 0: also keep every MoE layer's norm + router gate (spmoe forecasts)
    one_sync: bool = True  # run each window as one device pass (one host sync + repairs); False: a sync per MoE layer
    route_windows: bool = True  # forwards route their layers that keep missing (runtime/decode/window_routes.py)


def _module(root, path: str):
    node = root
    for p in path.split(".") if path else []:
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node


def _cache_kind(c) -> tuple[str, int]:
    if type(c) is KVCache:
        return ("kv", 0)
    if type(c) is ArraysCache:
        return ("arrays", len(c.cache))
    raise ValueError(f"cache type {type(c).__name__} is not supported by --pipeline (KVCache and ArraysCache are)")


def plan_split(store: ExpertStore, n_ranks: int, counts=None) -> StageSplit:
    """The split every rank computes the same way from the (identical) store."""
    n_layers = int(text_config(store.config)["num_hidden_layers"])
    resident = {n: e.nbytes for n, e in store.resident_tensors().items()}
    experts = {l: lay.expert_bytes * lay.n_experts for l, lay in store.layouts().items()}
    per_layer, outside = layer_bytes(resident, experts, n_layers)
    if counts:
        return explicit_split(list(counts), per_layer, outside)
    return balanced_split(per_layer, n_ranks, outside)


class Stage:
    """This rank's layers, caches and (rank 0) embedding, head and tokenizer."""

    def __init__(self, *, rank, split, store, loader, cache, plan, layers, layer_ids, modules, kinds,
                 embed=None, norm=None, head=None, tokenizer=None, routers=None, fingerprint="", resident_bytes=0, chain_trimmable=False,
                 device_pass=None):
        self.rank = rank
        self.split = split  # StageSplit shared by every rank
        self.store = store
        self.loader = loader
        self.cache = cache  # ExpertCache of this rank's MoE layers (None if it has none)
        self.plan = plan  # BudgetPlan of this rank (None without MoE layers)
        self.layers = layers  # decoder-layer modules this rank runs, in order
        self.layer_ids = layer_ids  # their indices
        self.modules = modules  # MoE layer -> CachedSwitchGLU
        self.kinds = kinds  # per layer: ("kv", 0) or ("arrays", size), to build fresh caches
        self.embed, self.norm, self.head = embed, norm, head  # rank 0 only
        self.tokenizer = tokenizer  # rank 0 only
        self.routers = routers or {}  # rank 0 with StageConfig.routers: MoE layer -> TargetRouter (all layers)
        self.model_fingerprint = fingerprint  # rank 0: runtime.checkpoints.model_fingerprint of the full model
        self.resident_bytes = resident_bytes  # bytes of the weights this rank evaluated
        self.chain_trimmable = chain_trimmable  # every rank's caches are KV caches (a prompt prefix can be kept)
        self.device_pass = device_pass  # DevicePass over this stage (None: synced path, one sync per MoE layer)
        self.syncs: dict[str, list[int]] = {}  # window kind -> [windows, host syncs] (see run())
        self.window_reads = WindowReads()  # verify windows' demand reads in this rank's layers, by window token
        self._routing: dict = {}  # MoE layer -> the verify window's expert ids (T, k), while one runs
        self.kv = self.new_cache()
        self._snapshot = None
        self._window: mx.array | None = None

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, path, rank: int, n_ranks: int, cfg: StageConfig = StageConfig()) -> "Stage":
        store = ExpertStore.open(path, io_mode=cfg.io_mode)
        loader = None
        try:
            check_supported(store.config, f"{path}/config.json")
            split = plan_split(store, n_ranks, cfg.split)
            a, b = split.ranges[rank]
            layouts = {l: lay for l, lay in store.layouts().items() if a <= l < b}
            k = top_k(store.config)
            resident = store.resident_tensors()
            own = {n for n in resident if (layer_of(n) is None and rank == 0) or (layer_of(n) is not None and a <= layer_of(n) < b)}
            plan = cache = None
            loader = AsyncLoader(store, LoaderConfig(threads=cfg.threads, io_mode=cfg.io_mode,
                                                     verify_checksums=cfg.verify_checksums))
            if layouts:
                share = (b - a) / split.ranges[-1][1]
                plan = plan_budget(parse_budget(cfg.budget), expert_bytes={l: x.expert_bytes for l, x in layouts.items()},
                                   n_experts={l: x.n_experts for l, x in layouts.items()}, top_k=k,
                                   resident_bytes=sum(resident[n].nbytes for n in own),
                                   kv_bytes=int(share * kv_bytes_estimate(store.config, cfg.context_tokens)))
                cache = ExpertCache(layouts, plan.slots, loader, cfg.policy, min_usable=k)
            model, config = load_model(store.model_dir, lazy=True, strict=False)
            text = getattr(model, "language_model", model)
            inner = text.model
            all_kinds = [_cache_kind(c) for c in make_prompt_cache(model)]
            kinds = all_kinds[a:b]
            modules = {}
            for l, lay in layouts.items():
                stock = _module(model, lay.prefix)
                if not isinstance(stock, SwitchGLU):
                    raise StoreError(store.model_dir, "expert tensors have no matching SwitchGLU in the mlx-lm model", tensor=lay.prefix)
                modules[l] = CachedSwitchGLU(l, lay, cache, stock.activation, like=stock)  # the family's own class
                parent, _, leaf = lay.prefix.rpartition(".")
                setattr(_module(model, parent), leaf, modules[l])
            keep = []
            expert_prefixes = tuple(lay.prefix + "." for lay in layouts.values())  # the cache slabs, counted apart
            for name, p in tree_flatten(model.parameters()):
                l = layer_of(name)
                mine = (a <= l < b) if l is not None else rank == 0
                if mine and not name.startswith(expert_prefixes):
                    if name not in resident:
                        raise StoreError(store.model_dir, "missing weight (the checkpoint does not match config.json)", tensor=name)
                    keep.append(p)
            routers, fingerprint = {}, ""
            if rank == 0 and cfg.routers:
                from predictor.spmoe import TargetRouter
                from runtime.checkpoints import model_fingerprint

                for l, lay in store.layouts().items():
                    block = _module(model, lay.prefix.rpartition(".")[0])
                    decoder = _module(model, lay.prefix.rpartition(".")[0].rpartition(".")[0])
                    routers[l] = TargetRouter(l, decoder.post_attention_layernorm, block.gate)
                    keep.extend(p for _, p in tree_flatten(decoder.post_attention_layernorm.parameters()))
                    keep.extend(p for _, p in tree_flatten(block.gate.parameters()))
                fingerprint = model_fingerprint(model)
            mx.eval(keep)
            resident_bytes = sum({id(p): p.nbytes for p in keep}.values())
            layers = [inner.layers[i] for i in range(a, b)]
            device_pass = stage_pass(cache, modules, layers, list(range(a, b)), k, cfg.route_windows) if cfg.one_sync else None
            kw = {}
            if rank == 0:
                tie = text.args.tie_word_embeddings
                kw = dict(embed=inner.embed_tokens, norm=inner.norm,
                          head=inner.embed_tokens.as_linear if tie else text.lm_head,
                          tokenizer=load_tokenizer(store.model_dir, eos_token_ids=config.get("eos_token_id")))
            del model, text, inner  # the other ranks' layers (never evaluated) go with it
        except BaseException:
            if loader is not None:
                loader.close()
            store.close()
            raise
        return cls(rank=rank, split=split, store=store, loader=loader, cache=cache, plan=plan, layers=layers,
                   layer_ids=list(range(a, b)), modules=modules, kinds=kinds, routers=routers,
                   fingerprint=fingerprint, resident_bytes=resident_bytes,
                   chain_trimmable=all(kind == "kv" for kind, _ in all_kinds), device_pass=device_pass, **kw)

    # -- running -------------------------------------------------------------------------
    def new_cache(self) -> list:
        return [KVCache() if kind == "kv" else ArraysCache(size=n) for kind, n in self.kinds]

    def embed_tokens(self, tokens: list[int]) -> mx.array:
        """(1, T, D) embeddings of `tokens` (rank 0)."""
        return self.embed(mx.array(tokens)[None])

    def logits(self, h: mx.array) -> mx.array:
        """(1, T, V) logits of the last stage's output `h` (rank 0)."""
        return self.head(self.norm(h))

    def forward(self, h: mx.array, *, keep: bool = False) -> mx.array:
        """This rank's layers over `h` (1, T, D). keep: snapshot the caches first and keep `h`
        so rewind() can re-run a prefix (speculative verify windows). With a device pass the
        output comes back evaluated (one host sync + repairs); without, lazy."""
        cache = self.kv
        if keep:
            self._snapshot = [None if c.is_trimmable() else tree_map(lambda x: x, c.state) for c in cache]
            self._window = h
        is_linear = [bool(getattr(layer, "is_linear", False)) for layer in self.layers]

        def layers():  # masks from the caches' offsets, so a repair (after a roll-back) rebuilds them right
            x = h
            fa = next((c for c, lin in zip(cache, is_linear) if not lin), None)
            ssm = next((c for c, lin in zip(cache, is_linear) if lin), None)
            fa_mask = create_attention_mask(x, fa) if not all(is_linear) else None
            ssm_mask = create_ssm_mask(x, ssm) if any(is_linear) else None
            for layer, c, lin in zip(self.layers, cache, is_linear):
                x = layer(x, ssm_mask if lin else fa_mask, c)
            return x

        if self.device_pass is None:
            return layers()
        return self.device_pass.run(layers, cache, h.shape[1])

    def run(self, h: mx.array, *, keep: bool = False, kind: str = "step") -> mx.array:
        """forward() evaluated, counting the host syncs of windows of `kind` (step, verify, prefill, rerun):
        the device pass's one sync (+ repairs, + synced layer calls), or, without it, one router read-back
        per MoE layer plus the output's evaluation."""
        before = self.cache.host_syncs if self.cache is not None else 0
        # A verify window through a device pass: its routing (the modules' observer, called when the pass books the
        # accepted forward) and the pass's reads say which window tokens needed each read (runtime/decode/window_reads.py).
        counting = kind == "verify" and self.device_pass is not None
        if counting:
            self._routing = {}
            observers = {l: m.observer for l, m in self.modules.items()}
            for m in self.modules.values():
                m.observer = self._observe
        try:
            out = self.forward(h, keep=keep)
        finally:
            if counting:
                for l, m in self.modules.items():
                    m.observer = observers[l]
        mx.eval(out)
        if counting:
            self.window_reads.add(self._routing, self.device_pass.forward_reads, h.shape[1])
        syncs = (self.cache.host_syncs if self.cache is not None else 0) - before + (self.device_pass is None)
        row = self.syncs.setdefault(kind, [0, 0])
        row[0] += 1
        row[1] += syncs
        return out

    def _observe(self, layer: int, ids) -> None:
        """A verify window's routing in `layer` (T, k); a layer observed twice keeps both (the last rows count)."""
        self._routing[layer] = np.concatenate([self._routing[layer], ids]) if layer in self._routing else ids

    def rewind(self, rejected: int, keep_tokens: int) -> int:
        """Drop the last `rejected` positions of the kept window; returns tokens re-run (0 if trimmed)."""
        if rejected <= 0:
            return 0
        if self._snapshot is None or self._window is None:
            raise RuntimeError(f"rank {self.rank}: asked to rewind {rejected} tokens with no verify window kept")
        if all(s is None for s in self._snapshot):
            for c in self.kv:
                c.trim(rejected)
            return 0
        n_window = self._window.shape[1]
        for c, s in zip(self.kv, self._snapshot):
            if s is None:
                c.trim(n_window)
            else:
                c.state = tree_map(lambda x: x, s)
        self._snapshot = None
        self.run(self._window[:, :keep_tokens], kind="rerun")
        return keep_tokens

    @property
    def trimmable(self) -> bool:
        """Whether every cache of this rank can drop positions (KV caches; recurrent state cannot)."""
        return all(kind == "kv" for kind, _ in self.kinds)

    def reset(self, keep: int) -> None:
        """A new request: keep the first `keep` cached positions (a shared prompt prefix), or start fresh (0)."""
        self._snapshot, self._window = None, None
        if keep <= 0:
            self.kv = self.new_cache()
            return
        if not self.trimmable:
            raise RuntimeError(f"rank {self.rank}: asked to keep {keep} positions of a recurrent cache (only 0 is possible)")
        for c in self.kv:
            if keep > c.offset:
                raise RuntimeError(f"rank {self.rank}: asked to keep {keep} positions of a cache holding {c.offset}")
            c.trim(c.offset - keep)

    def end_round(self, round_id: int) -> None:
        """A verify window has passed: forecasts of this round have served; drop the stale ones."""
        if self.cache is not None and round_id:
            self.loader.cancel_stale(round_id + 1)
            self.cache.unprotect()

    def counters(self) -> dict:
        stats = self.cache.stats().values() if self.cache is not None else []
        return {
            "hits": sum(s.hits for s in stats), "misses": sum(s.misses for s in stats),
            "prefetch_hits": sum(s.prefetch_hits for s in stats), "prefetch_wasted": sum(s.prefetch_wasted for s in stats),
            "prefetch_cancelled": sum(s.prefetch_cancelled for s in stats),
            "bytes_read": self.loader.stats.bytes_read, "load_wait_ms": self.loader.stats.wait_ms,
            "host_syncs": {kind: {"windows": n, "host_syncs": syncs} for kind, (n, syncs) in self.syncs.items()},
            "window_reads": self.window_reads.to_json(),
            "device_pass": self.device_pass.stats.to_json() if self.device_pass is not None else None,
        }

    def memory(self) -> dict:
        return {"rank": self.rank, "layers": [self.layer_ids[0], self.layer_ids[-1]],
                "resident_bytes": self.resident_bytes, "cache_bytes": self.cache.nbytes if self.cache is not None else 0,
                "active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory()}

    def close(self) -> None:
        self.loader.close()
        self.store.close()
