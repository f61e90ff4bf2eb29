"""The engine flags `generate`, `chat` and `serve` share, and loading the engine for the long-running ones.

One factory per flag (`--io-mode`, `--memory-governor`, `--memory-limit`, `--kv-bits`), so the three
commands take the same name, default and help text; the sampling flags (`--temp`, `--seed`, ...) live in
runtime.cli.options with the rest of mlx-lm's names. Engine settings without a flag keep runtime.api.load's
defaults: decoding as `one_sync="auto"`, DEFAULT_THREADS loader threads (docs/flags.md says why).

Invariants: a bad value is a ValueError naming the flag and what it takes (the CLI prints one line,
exit 2); `--kv-bits` with `--draft` is refused before anything loads; `load_engine` prints the budget
plan and where the drafter's settings came from.
"""

from __future__ import annotations

from pathlib import Path

import typer

from runtime.observe import err_console

__all__ = ["load_engine", "io_mode_option", "governor_option", "memory_limit_option", "kv_bits_option",
           "check_kv_bits", "memory_limit_value", "KV_BITS_WITH_DRAFT"]

KV_BITS = (2, 3, 4, 5, 6, 8)  # mlx-lm's quantized KV cache widths
KV_BITS_WITH_DRAFT = ("--kv-bits with --draft: the speculative decoder keeps its KV caches unquantized (quantizing them "
                      "and rolling quantized caches back after rejected drafts is not implemented); drop --draft or "
                      "--kv-bits")


def io_mode_option():
    return typer.Option("buffered", "--io-mode",
                        help="buffered (through the page cache) or direct (O_DIRECT/F_NOCACHE: reads bypass the page "
                             "cache, so paged experts are not held in RAM twice, and on Linux the loaded weights' file pages are dropped; "
                             "docs/flags.md).")


def governor_option():
    return typer.Option(True, "--memory-governor/--no-memory-governor",
                        help="Shrink the expert cache while available RAM is low; grow it back after.")


def memory_limit_option():
    return typer.Option("auto", "--memory-limit",
                        help="Cap on the whole process (weights, KV and state, drafter, expert cache): 12GB, 900MiB, "
                             "auto (RAM or the GPU working set), or none. The expert cache gives slots back as the KV "
                             "cache grows.")


def kv_bits_option():
    return typer.Option(None, "--kv-bits",
                        help="Quantize the KV cache to 4 or 8 bits from its 5000th token on, as mlx-lm's kv_bits "
                             "(plain decoding): less memory at long contexts, lossy (greedy tokens may change).")


def check_kv_bits(kv_bits: int | None, draft) -> int | None:
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise ValueError(f"--kv-bits {kv_bits}; expected 4 or 8 (mlx-lm also takes 2, 3, 5, 6)")
    if kv_bits is not None and draft is not None:
        raise ValueError(KV_BITS_WITH_DRAFT)
    return kv_bits


def memory_limit_value(value: str) -> str | None:
    """runtime.api.load's memory_limit for the flag's value ("none" -> no cap)."""
    return None if value.strip().lower() == "none" else value


def load_engine(model: Path, *, budget: str, draft: Path | None, num_draft: int | None = None,
                predictor: str | None = None, cutoff: int | None = None, policy: str | None = None,
                io_mode: str = "buffered", governor: bool = True, memory_limit: str = "auto",
                kv_bits: int | None = None):
    """runtime.api.load with the CLI's checks; prints the budget plan and where settings came from."""
    from runtime import load
    from runtime.cli.generate import describe_plan

    if num_draft is not None and num_draft < 1:
        raise ValueError(f"--num-draft {num_draft}; expected K >= 1")
    check_kv_bits(kv_bits, draft)
    engine = load(model, budget=budget, draft=draft, num_draft=num_draft, predictor=predictor, cutoff=cutoff,
                  policy=policy, io_mode=io_mode, memory_governor=governor, memory_limit=memory_limit_value(memory_limit))
    for note in engine.notes:
        err_console.print(note, highlight=False)
    err_console.print(describe_plan(engine.model), highlight=False)
    if engine.draft is not None:
        d = engine.draft
        err_console.print(f"speculative: drafter {d.path}, K={d.num_draft}, predictor {d.predictor}, "
                          f"cutoff {'all' if d.cutoff is None else d.cutoff}", highlight=False)
    return engine
