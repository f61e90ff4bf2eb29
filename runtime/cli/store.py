"""`specmoe convert`, `specmoe info`, `specmoe make-tiny`: checkpoints and stores."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from runtime.cache import format_bytes, kv_bytes_estimate, parse_budget, plan_budget
from runtime.cli import options as opt
from runtime.observe import console, err_console, progress_bar, write_json


def register(app: typer.Typer) -> None:
    @app.command()
    def convert(
        src: Path = opt.model_option(help="mlx-lm checkpoint to pack (directory or Hugging Face id; single or "
                                              "sharded safetensors)."),
        dst: Path = typer.Option(..., "--out", "-o", help="Directory to create for the packed store."),
        force: bool = typer.Option(False, "--force", help="Replace --out if it exists (atomically)."),
    ):
        """Pack a checkpoint: one contiguous, 16 KiB-aligned, checksummed record per expert."""
        from runtime.decode import check_supported, lazy_structure, match_expert_modules
        from storage import ExpertStore
        from storage.packer import convert as pack

        source = ExpertStore.open(src)
        try:
            check_supported(source.config, src / "config.json")
            # the stored expert tensors are exactly the model's expert modules, runnable over slabs
            match_expert_modules(lazy_structure(src), source.layouts(), src)
        finally:
            source.close()
        if dst.exists() and not force:
            raise ValueError(f"destination {dst} exists; pass --force to replace it")
        with progress_bar(TextColumn("[bold]packing experts"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                          TimeRemainingColumn(), console=err_console, transient=False, unit="bytes") as bar:
            task = bar.add_task("packing experts", total=None)
            pack(src, dst, force=force, on_start=lambda total: bar.update(task, total=total),
                 progress=lambda n: bar.advance(task, n))
        err_console.print(f"wrote {dst}")

    @app.command()
    def info(
        model: Path = opt.model_option(),
        budget: str = typer.Option(None, "--budget", "-b", help="Also show what fits this budget (6GB, 40%, auto)."),
        json_path: Path = opt.json_option("Write the facts as JSON to this path."),
    ):
        """Layers, experts, bytes per expert, resident vs expert bytes, and what fits a budget.

        Exits 2 (after the table) when specmoe cannot run the model."""
        from runtime.decode import check_supported, describe_expert_module, lazy_structure, match_expert_modules
        from runtime.decode import text_config, top_k
        from storage import ExpertStore

        store = ExpertStore.open(model)
        try:
            cfg = text_config(store.config)
            layouts = store.layouts()
            first = next(iter(layouts.values()), None)
            facts = {
                "path": str(model), "kind": store.kind, "model_type": store.config.get("model_type"),
                "supported": True, "layers": cfg.get("num_hidden_layers"), "moe_layers": len(layouts),
                "experts_per_layer": first.n_experts if first else 0, "top_k": cfg.get("num_experts_per_tok"),
                "bytes_per_expert": first.expert_bytes if first else 0,
                "resident_bytes": store.resident_bytes, "expert_bytes": store.expert_bytes_total,
                "quantization": {p: (q.__dict__ if q else None) for p, q in first.quant.items()} if first else {},
                "expert_module": re.sub(r"layers\.\d+\.", "layers.*.", first.prefix) if first else None,
                "expert_tensors": [t.name for t in first.tensors] if first else [],
                "moe_layer_ids": sorted(layouts),
            }
            unsupported = None
            try:
                check_supported(store.config, model)
                matched = match_expert_modules(lazy_structure(store.model_dir), layouts, model)
                facts["expert_class"] = describe_expert_module(matched[first.layer][1], first) if first else None
            except ValueError as e:
                facts["supported"], unsupported = False, e
            table = Table(title=f"{model}", show_header=False)
            for k, v in facts.items():
                table.add_row(k.replace("_", " "), format_bytes(v) if k.endswith("bytes") and k != "bytes_per_expert" else
                              (f"{v} ({format_bytes(v)})" if k == "bytes_per_expert" else str(v)))
            if budget is not None and layouts:
                plan = plan_budget(parse_budget(budget), expert_bytes={l: x.expert_bytes for l, x in layouts.items()},
                                   n_experts={l: x.n_experts for l, x in layouts.items()}, top_k=top_k(store.config),
                                   resident_bytes=store.resident_bytes, kv_bytes=kv_bytes_estimate(store.config, 4096))
                slots = min(plan.slots.values())
                facts["budget"] = {"text": budget, "cache_bytes": plan.budget_bytes, "slots_per_layer": slots,
                                   "fraction_of_experts": plan.fraction, "min_bytes": plan.min_bytes, "auto": plan.breakdown}
                table.add_row("budget", f"{budget}: {slots} of {first.n_experts} experts per layer "
                              f"({plan.fraction:.0%}, {format_bytes(plan.budget_bytes)}; minimum {format_bytes(plan.min_bytes)})")
            console.print(table)
            if json_path:
                write_json(json_path, facts)
            if unsupported is not None:
                raise unsupported  # one line, exit 2: a script must not take "supported: False" for success
        finally:
            store.close()

    @app.command("make-tiny")
    def make_tiny_cmd(
        out: Path = typer.Option(..., "--out", "-o", help="New directory to write the checkpoint into."),
        family: str = typer.Option("qwen3_moe", "--family", help="qwen3_moe, mixtral, qwen3_next, qwen3_5_moe, olmoe, deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, or qwen3 (a dense drafter)."),
        seed: int = opt.seed_option("Seed for the random weights."),
        layers: int = typer.Option(4, "--layers", min=1, help="Transformer layers."),
        experts: int = typer.Option(16, "--experts", min=2, help="Routed experts per MoE layer."),
        top_k: int = typer.Option(4, "--experts-per-tok", min=1, help="Experts each token is routed to "
                                  "(config num_experts_per_tok)."),
        hidden: int = typer.Option(64, "--hidden", min=32, help="Hidden size."),
        expert_hidden: int = typer.Option(32, "--expert-hidden", min=32, help="Expert intermediate size."),
        shards: int = typer.Option(1, "--shards", min=1, help="Split the weights into this many safetensors files."),
    ):
        """Write a tiny random-weight checkpoint in real mlx-lm layout (4-bit, with a tokenizer)."""
        from runtime.checkpoints import make_tiny

        if top_k > experts:
            raise ValueError(f"--experts-per-tok {top_k} exceeds --experts {experts}")
        make_tiny(out, family, seed=seed, shards=shards, layers=layers, n_experts=experts, top_k=top_k,
                  hidden=hidden, expert_hidden=expert_hidden)
        err_console.print(f"wrote {family} checkpoint to {out}")
