"""Published lossless Mac decode runs the planner is validated against, and how each engine works.

Each row is one published measurement with its source key (shared/reference/mac-and-models.md,
peers-and-limits-2026.md; [GW] github.com/rayl15/Godwit docs/RESULTS.md; [QW] the community table
github.com/penta2himajin/qwisp bench/RESULTS.md, issue number per row). Inputs a source does not
state are assumptions, listed in the row's note. Every row is lossless: lossy modes (qwisp "bolt",
flash-moe forks that run fewer experts than the model's top-k with a quality claim) are left out,
except the [M1P] K-sweep rows, which run the model at a reduced top-k on purpose and are projected at
that top-k.

An engine kind says what its code does per forward, in the terms of runtime/plan/engine_costs.py:
host syncs per forward and per MoE layer, and command-buffer boundaries per MoE layer. Raw-Metal
engines wait on command buffers; their wait is priced like MLX's default fence (an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.plan.engine_costs import EngineProfile

_ALL = 10**15  # "every expert cached"


@dataclass(frozen=True)
class EngineKind:
    label: str  # short name in the table
    syncs_per_forward: float  # host syncs per forward regardless of depth
    syncs_per_layer: float  # host syncs per MoE layer per forward
    command_buffers_per_layer: float  # command-buffer boundaries per MoE layer
    how: str  # what the code does, with its source

    def profile(self, layer_us: float) -> EngineProfile:
        return EngineProfile(name=self.label, syncs_per_forward=self.syncs_per_forward,
                             syncs_per_layer=self.syncs_per_layer,
                             command_buffers_per_layer=self.command_buffers_per_layer,
                             repairs_per_token=0.0 if self.syncs_per_layer else None, layer_us=layer_us)


ENGINES = {
    "flash-moe": EngineKind("flash-moe (raw Metal)", 1, 2, 2,
                            "two command buffers per layer, each waited on: attention+router, then experts [M1P]"),
    "godwit": EngineKind("Godwit (raw Metal)", 1, 2, 4.5,
                         "router read back and norm+residual on the CPU every layer; 108 submissions/token [GW]"),
    "qwisp-stream": EngineKind("qwisp strict (raw Metal)", 1, 1, 1,
                               "raw Metal buffers outside the MLX graph, int32 routing read-back per layer [QW]"),
    "mlx-per-layer": EngineKind("MLX, per-layer read-back", 1, 1, 2,
                                "MLX graph, routing read back to Python every MoE layer (peers doc; [MLX1438])"),
    "one-graph": EngineKind("one graph per token", 1, 0, 0.5,
                            "all weights resident, one graph and one host sync per token (llama.cpp, resident MLX)"),
}


@dataclass(frozen=True)
class Row:
    key: str  # short id
    group: str  # engine family: "pread+page cache", "raw Metal streaming", "MLX app cache", "resident"
    engine: str  # key of ENGINES
    mac: str  # planner Mac id
    ssd_gb: int | None  # SSD capacity, None = the chip's default
    model: str  # planner preset
    bits: int  # expert/weight bits
    top_k: int | None  # experts per token the engine used, None = the model's
    cache_bytes: int  # app-level expert cache (0 for page-cache engines; _ALL = resident)
    page_cache: bool  # engine relies on the OS page cache
    published_hit: float | None  # published hit rate (all tiers), None = planner prior
    published_tok_s: float  # the measurement
    source: str  # where it was published
    differences: str  # engine differences from specmoe that matter for this row
    note: str  # assumptions made for this row
    ssd_gbps: float | None = None  # the row's own SSD figure when the source gives one
    cache_fraction: float | None = None  # app cache as a share of expert bytes (instead of cache_bytes)
    quant_mode: str = "affine"  # mlx quantization mode the row's checkpoint uses (gpt-oss: mxfp4)


_PAGE = "pread + OS page cache, per-layer sync"
_K = "runs top-K below the model's 8 (quality checked by [M1P])"
ROWS = (
    Row("m1pro-35b-k8", "pread+page cache", "flash-moe", "m1pro-16gb", None, "qwen3.5-35b-a3b", 4, 8, 0, True,
        None, 8.28, "[M1P] flash-moe-M1", _PAGE, "SSD 5.24 GB/s [M1P]; v1 fitted its constant on this row"),
    Row("m1pro-35b-k6", "pread+page cache", "flash-moe", "m1pro-16gb", None, "qwen3.5-35b-a3b", 4, 6, 0, True,
        None, 9.71, "[M1P] flash-moe-M1", _PAGE + "; " + _K, "as above"),
    Row("m1pro-35b-k5", "pread+page cache", "flash-moe", "m1pro-16gb", None, "qwen3.5-35b-a3b", 4, 5, 0, True,
        None, 11.13, "[M1P] flash-moe-M1", _PAGE + "; " + _K, "as above"),
    Row("m1pro-35b-k4", "pread+page cache", "flash-moe", "m1pro-16gb", None, "qwen3.5-35b-a3b", 4, 4, 0, True,
        None, 12.22, "[M1P] flash-moe-M1", _PAGE + "; " + _K, "as above"),
    Row("m4-35b-k6", "pread+page cache", "flash-moe", "m4-16gb", None, "qwen3.5-35b-a3b", 4, 6, 0, True,
        None, 11.5, "[M1P] tayoun flash-moe", _PAGE + "; " + _K, "SSD size not stated: 256 GB assumed"),
    Row("m4-35b-k4", "pread+page cache", "flash-moe", "m4-16gb", 256, "qwen3.5-35b-a3b", 4, 4, 0, True,
        None, 6.61, "[FM35] flash-moe-35b", _PAGE + "; " + _K, "conflicts with the row above on the same machine class"),
    Row("m3max-397b-k4", "pread+page cache", "flash-moe", "m3max-48gb", 1000, "qwen3.5-397b-a17b", 4, 4, 0, True,
        0.71, 4.36, "[FM] flash-moe", _PAGE + "; K=4 of 10",
        "SSD 17.5 GB/s is disputed (U); page-cache GB/s was derived from this run"),
    Row("m4pro64-397b-k4", "pread+page cache", "flash-moe", "m4pro-64gb", 512, "qwen3.5-397b-a17b", 4, 4, 0, True,
        None, 3.17, "[HH] internal SSD", _PAGE + "; K=4 of 10", "K=4 as in flash-moe"),
    Row("m4pro24-397b", "pread+page cache", "flash-moe", "m4pro-24gb", None, "qwen3.5-397b-a17b", 4, 4, 0, True,
        None, 3.50, "flash-moe PR #21", _PAGE + "; K=4 of 10", "K and SSD size not stated: K=4, 512 GB assumed"),
    Row("m4air-gptoss20b", "raw Metal streaming", "godwit", "m4-16gb", 256, "gpt-oss-20b", 4, None, 0, False,
        None, 3.0, "[GW] Godwit RESULTS.md",
        "raw Metal; F_NOCACHE reads (no page cache); LFU 8 of 32 slots per layer; CPU norm+residual per layer",
        "2.8-3.2 tok/s, midpoint; MXFP4 experts (13.2 MB, priced as mxfp4); hit rate not published: prior",
        ssd_gbps=2.15, cache_fraction=0.25, quant_mode="mxfp4"),
    Row("m4air-gptoss120b", "raw Metal streaming", "godwit", "m4-16gb", 256, "gpt-oss-120b", 4, None, 0, False,
        0.40, 1.45, "[GW] Godwit RESULTS.md",
        "raw Metal; F_NOCACHE reads; LFU 8 of 128 slots per layer (38-42% hits published); CPU norm+residual",
        "1.4-1.5 tok/s, midpoint; MXFP4 experts priced as mxfp4; SSD ~2 GiB/s measured by [GW]",
        ssd_gbps=2.15, cache_fraction=8 / 128, quant_mode="mxfp4"),
    Row("m1pro-36b-qwisp", "raw Metal streaming", "qwisp-stream", "m1pro-16gb", 512, "qwen3.6-35b-a3b", 4, None, 0,
        False, None, 2.3, "[QW] qwisp #41 strict", "raw Metal outside MLX; 128 of 256 experts per layer pinned; MTP "
        "speculation in strict mode not stated", "one report; checkpoint ~4-bit (MTPLX ~20 GB); hit rate: prior",
        cache_fraction=0.5),
    Row("m1pro14-36b-qwisp", "raw Metal streaming", "qwisp-stream", "m1pro-16gb", 512, "qwen3.6-35b-a3b", 4, None, 0,
        False, None, 2.0, "[QW] qwisp #61 strict", "as above", "14-core GPU binned part, projected as 16-core",
        cache_fraction=0.5),
    Row("m1-36b-qwisp", "raw Metal streaming", "qwisp-stream", "m1-16gb", 512, "qwen3.6-35b-a3b", 4, None, 0, False,
        None, 1.4, "[QW] qwisp #55/#67 strict", "as above", "median of two reports", cache_fraction=0.5),
    Row("m2-36b-qwisp", "raw Metal streaming", "qwisp-stream", "m2-16gb", 256, "qwen3.6-35b-a3b", 4, None, 0, False,
        None, 3.4, "[QW] qwisp #57 strict", "as above", "one report; 256 GB single-NAND SSD", cache_fraction=0.5),
    Row("m3pro18-36b-qwisp", "raw Metal streaming", "qwisp-stream", "m3pro-18gb", 512, "qwen3.6-35b-a3b", 4, None, 0,
        False, None, 9.8, "[QW] qwisp #59 strict", "as above", "one report; 14-core GPU projected as 18-core",
        cache_fraction=0.5),
    Row("m4-30b-mlxvlm", "MLX app cache", "mlx-per-layer", "m4-16gb", 256, "qwen3-30b-a3b", 4, None, 9_230_000_000,
        False, None, 14.1, "mlx-vlm PR #1813", "MLX graph; one sync per MoE layer; plain LRU, no prefetch",
        "10.6 GB process: cache = 10.6 - 0.87 resident - 0.5 KV/scratch (assumed)"),
    Row("m4-30b-sniper", "MLX app cache", "mlx-per-layer", "m4-16gb", 256, "qwen3-30b-a3b", 4, None, 8_000_000_000,
        False, 0.86, 3.3, "[WG] MLX sniper", "MLX; Python-side expert handling per layer; LRU + prefetch",
        "8 GB LRU + prefetch"),
    Row("m4-36b-3bit-2gb", "MLX app cache", "mlx-per-layer", "m4-16gb", 256, "qwen3.6-35b-a3b", 3, None,
        2_000_000_000, False, 0.60, 3.0, "turboquant-mlx PR #11", "MLX; per-layer read-back; 3-bit experts", "3-bit"),
    Row("m4-36b-3bit-8gb", "MLX app cache", "mlx-per-layer", "m4-16gb", 256, "qwen3.6-35b-a3b", 3, None,
        8_000_000_000, False, 0.91, 4.5, "turboquant-mlx PR #11", "as above", "3-bit"),
    Row("m4-36b-mlx1438", "MLX app cache", "mlx-per-layer", "m4-16gb", 256, "qwen3.6-35b-a3b", 4, None,
        7_800_000_000, False, None, 17.2, "[MLX1438]", "MLX streaming; router read-back per layer (63% of a token)",
        "RAM and bits not stated: 16 GB, 4-bit; cache = 9.7 GB ceiling - 1.39 - 0.5"),
    Row("m3max-35b-resident", "resident", "one-graph", "m3max-64gb", None, "qwen3.5-35b-a3b", 4, None, _ALL, False,
        1.0, 58.3, "[HI] llama-server", "llama.cpp: one graph per token, no per-layer sync",
        "Q4_K_M approximated as mlx 4-bit"),
    Row("m4pro-35b-resident", "resident", "one-graph", "m4pro-48gb", None, "qwen3.5-35b-a3b", 4, None, _ALL, False,
        1.0, 30.0, "[WGr]", "engine not stated; fully resident", "published as '30+'; Q4 approximated as mlx 4-bit"),
    Row("m4-35b-iq2-resident", "resident", "one-graph", "m4-16gb", 256, "qwen3.5-35b-a3b", 2, None, _ALL, False,
        1.0, 30.0, "[WGr] llama.cpp", "llama.cpp: one graph per token; the whole model fits in RAM at IQ2_M",
        "IQ2_M (~2.7 bits per weight, 10.6 GB) approximated as mlx 2-bit"),
    Row("m4pro-80b-mlx-resident", "resident", "one-graph", "m4pro-64gb", None, "qwen3-next-80b-a3b", 4, None, _ALL,
        False, 1.0, 60.0, "[LC19366] MLX", "MLX (mlx-lm), fully resident: one graph per token",
        "Qwen3-Coder-Next projected with the Qwen3-Next-80B-A3B preset (same architecture assumed); RAM not "
        "stated: 64 GB assumed"),
    Row("m4pro-80b-llamacpp-resident", "resident", "one-graph", "m4pro-64gb", None, "qwen3-next-80b-a3b", 4, None,
        _ALL, False, 1.0, 24.0, "[LC19366] llama.cpp", "llama.cpp, fully resident; same machine and model as above",
        "Q4_K_M approximated as mlx 4-bit; as above"),
    Row("m1max-36b-qwisp", "resident", "one-graph", "m1max-64gb", None, "qwen3.6-35b-a3b", 4, None, _ALL, False,
        1.0, 87.1, "[QW] qwisp #36 strict", "raw Metal, fully resident, strict (bit-exact)",
        "one report; MTP speculation in strict mode not stated"),
)
