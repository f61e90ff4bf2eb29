"""`specmoe generate` and `specmoe calibrate`: text from an offloaded model, plain or speculative."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from runtime.cache import format_bytes
from runtime.cli import engine_options as eo
from runtime.cli import options as opt
from runtime.observe import console, err_console, progress_bar, write_json


def describe_plan(om) -> str:
    plan = om.plan
    slots = sorted(set(plan.slots.values()))
    lines = [
        f"budget: {format_bytes(plan.budget_bytes)} for experts = {'/'.join(map(str, slots))} slots x {len(plan.slots)} MoE layers "
        f"({plan.fraction:.0%} of {format_bytes(plan.expert_bytes_total)} of experts; minimum {format_bytes(plan.min_bytes)})",
        f"resident weights: {format_bytes(om.store.resident_bytes)} | store: {om.store.kind} {om.store.model_dir}",
    ]
    if om.memory_limit is not None:
        m = om.memory_limit
        lines.append(f"memory limit: {format_bytes(m.limit_bytes)} (process before loading {format_bytes(m.baseline_bytes)}, "
                     f"drafter {format_bytes(m.drafter_bytes)}); a prompt is prefilled in one chunk unless its "
                     f"activations need smaller ones; expert slots give way as the KV cache grows")
    if plan.breakdown:
        lines.append("auto: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in plan.breakdown.items() if v))
    return "\n".join(lines)


def spec_line(stats, prefetch_layers) -> str:
    c = stats.counters
    n = max(1, stats.n_tokens)
    expert_bytes = c.get("bytes_read", 0)
    return (f"{stats.n_tokens / stats.decode_s if stats.decode_s else 0:.1f} tok/s | acceptance {stats.acceptance:.0%} | "
            f"{stats.tokens_per_verify:.2f} tokens/verify | hit rate {c['hits'] / max(1, c['hits'] + c['misses']):.1%} | "
            f"{c['misses'] / n:.2f} misses/token | {expert_bytes / 1e6 / n:.3f} MB read/token | "
            f"prefetch used {c['prefetch_hits']} / wasted {c['prefetch_wasted'] + c['prefetch_cancelled']} experts | "
            f"forecast recall {stats.recall(prefetch_layers or None):.0%} | "
            f"one-sync verifies {stats.one_sync_tries - stats.one_sync_fallbacks}/{stats.n_rounds}, "
            f"{stats.host_syncs / max(1, stats.n_rounds):.2f} host syncs/round, {stats.repairs} repairs | "
            f"mean K {stats.mean_k:.1f}, {stats.n_plain_rounds}/{stats.n_rounds} plain rounds" + _reads_note(stats))


def _reads_note(stats) -> str:
    """Verify reads per round and the share only the last draft needed (runtime/decode/window_reads.py)."""
    w = getattr(stats, "window_reads", None)
    return f" | {w.line()}" if w is not None and w.total else ""


def low_acceptance_note(stats) -> str | None:
    """A warning when adaptive K fell back to plain decoding in most rounds."""
    if stats.n_rounds and stats.n_plain_rounds > stats.n_rounds / 2:
        return (f"note: the drafter's proposals were rarely accepted ({stats.acceptance:.0%}); adaptive K fell back "
                f"to plain decoding in {stats.n_plain_rounds} of {stats.n_rounds} rounds. This drafter does not pay "
                "here: try another drafter, or none.")
    return None


def prompt_ids(tokenizer, prompt: str, system_prompt: str | None, *, chat: bool) -> list[int]:
    """The prompt's token ids: through the chat template (with the system prompt) when asked and available."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    if system_prompt:
        raise ValueError("--system-prompt needs the tokenizer's chat template; drop --raw-prompt")
    return list(tokenizer.encode(prompt))


SPECULATIVE_REFUSAL = {  # why each is refused with --draft (docs/prefill.md, "Conversations that resume")
    "--prompt-cache": "--prompt-cache with --draft: the drafter's KV cache is not saved or trimmed beside the target's "
                      "(not implemented); drop --draft or --prompt-cache",
    "--kv-bits": "--kv-bits with --draft: the speculative decoder keeps its KV caches unquantized (quantizing them and "
                 "rolling quantized caches back after rejected drafts is not implemented); drop --draft or --kv-bits",
}


def open_prompt_cache(path: Path, om, ids: list[int], *, speculative: bool):
    """(PromptCache, the full prompt): the file's cache and its prompt + `ids` if it exists, else a new cache."""
    from runtime.decode import PromptCache

    if speculative:
        raise ValueError(SPECULATIVE_REFUSAL["--prompt-cache"])
    if path.suffix != ".safetensors":
        raise ValueError(f"--prompt-cache {path}: expected a file name ending in .safetensors")
    digest = om.model_id()["digest"]
    if path.exists():
        pc, prefix = PromptCache.load(path, om.model, digest=digest)
        return pc, prefix + ids
    if not path.parent.is_dir():
        raise ValueError(f"--prompt-cache {path}: directory {path.parent} does not exist")
    return PromptCache(om.model, digest=digest), ids


def register(app: typer.Typer) -> None:
    @app.command()
    def generate(
        model: Path = opt.model_option(),
        prompt: str = opt.prompt_option(),
        system_prompt: str = opt.system_prompt_option(),
        budget: str = opt.budget_option(),
        max_tokens: int = opt.max_tokens_option(),
        temp: float = opt.temp_option(),
        top_p: float = opt.top_p_option(),
        top_k: int = opt.top_k_option(),
        min_p: float = opt.min_p_option(),
        seed: int = opt.seed_option(),
        draft: Path = opt.draft_option(),
        num_draft: int = opt.num_draft_option(),
        predictor: str = opt.predictor_option(),
        cutoff: int = opt.cutoff_option(),
        projection: Path = typer.Option(None, "--projection", help="Projection file from `specmoe calibrate` (default: looked up next to the model)."),
        policy: str = opt.policy_option(),
        io_mode: str = eo.io_mode_option(),
        verify: bool = typer.Option(True, "--verify/--no-verify", help="Check each packed record's CRC32 after reading it."),
        chat: bool = typer.Option(True, "--chat/--raw-prompt", help="Apply the tokenizer's chat template if it has one."),
        json_path: Path = opt.json_option("Write the text and stats as JSON to this path."),
        governor: bool = eo.governor_option(),
        prompt_cache_file: Path = typer.Option(None, "--prompt-cache",
                                               help="Reuse a processed prompt prefix (KV cache and state) from this "
                                                    "file; the prompt is appended to it. If the file does not exist, "
                                                    "the prompt's prefix is processed and saved there (as mlx_lm.cache_prompt)."),
        memory_limit: str = eo.memory_limit_option(),
        kv_bits: int = eo.kv_bits_option(),
        inject: str = typer.Option(None, "--inject", hidden=True, help="Debug: inject disk faults (spec: storage/faults.py)."),
        pipeline: bool = opt.pipeline_option("generate"),
        pipeline_split: str = opt.pipeline_split_option(),
        pipeline_timeout: float = opt.pipeline_timeout_option(),
        pipeline_fault: str = typer.Option(None, "--pipeline-fault", hidden=True, help="Debug: die:RANK:WINDOW or hang:RANK:WINDOW."),
    ):
        """Generate text with routed experts paged from disk into a fixed-budget cache."""
        if pipeline:
            from runtime.cli.pipeline import generate_pipeline

            return generate_pipeline(locals())

        from runtime.api import load, stream_generate

        prompt = opt.read_prompt(prompt)
        if num_draft is not None and num_draft < 1:
            raise ValueError(f"--num-draft {num_draft}; expected K >= 1")
        eo.check_kv_bits(kv_bits, None)  # with --draft: SPECULATIVE_REFUSAL below
        if draft is not None and (prompt_cache_file is not None or kv_bits is not None):
            raise ValueError(SPECULATIVE_REFUSAL["--prompt-cache" if prompt_cache_file is not None else "--kv-bits"])
        engine = load(model, budget, draft, num_draft=num_draft, predictor=predictor, cutoff=cutoff, policy=policy,
                      io_mode=io_mode, verify=verify, memory_governor=governor, projection=projection,
                      inject=inject or "", memory_limit=eo.memory_limit_value(memory_limit))
        with engine:
            om = engine.model
            for note in engine.notes:
                err_console.print(note, highlight=False)
            err_console.print(describe_plan(om), highlight=False)
            ids = prompt_ids(om.tokenizer, prompt, system_prompt, chat=chat)
            tokens = []
            from runtime.observe import PrefillProgress

            pc = None
            if prompt_cache_file is not None:
                pc, ids = open_prompt_cache(prompt_cache_file, om, ids, speculative=engine.draft is not None)
            for r in stream_generate(engine, ids, max_tokens, temp=temp, top_p=top_p,
                                     top_k=top_k, min_p=min_p, seed=seed,
                                     progress=PrefillProgress(len(ids)), prompt_cache=pc, kv_bits=kv_bits):
                tokens.append(r.token)
                sys.stdout.write(r.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            stats = r.detail  # the decoder's own record: the console lines and --json's "detail"
            # --json: one schema for plain and speculative runs (docs/json.md); "stats" is runtime.api's RunStats
            result = {"model": str(model), "budget": budget, "budget_bytes": om.plan.budget_bytes, "slots": om.plan.slots,
                      "policy": engine.policy, "draft": None, "num_draft": None, "predictor": None, "cutoff": None,
                      "stats": r.stats.to_json(), "detail": stats.to_json(), "governor": None}
            if engine.draft is None:
                line = stats.line()
            else:
                d = engine.draft
                line = spec_line(stats, stats.prefetch_layers)
                result.update(draft=str(draft), num_draft=d.num_draft, predictor=d.predictor, cutoff=d.cutoff)
            err_console.print(line, highlight=False)
            if stats.prefill is not None:
                err_console.print(stats.prefill.line(), highlight=False)
            if pc is not None and not prompt_cache_file.exists():
                pc.reuse(ids)  # back to the prompt's prefix (its last token not yet fed): trim, or its snapshot
                pc.save(prompt_cache_file, prompt=ids)
                err_console.print(f"wrote prompt cache {prompt_cache_file} ({len(pc.tokens)} tokens)", highlight=False)
            if engine.draft is not None and low_acceptance_note(stats):
                err_console.print(low_acceptance_note(stats), highlight=False)
            if json_path:
                result.update(tokens=tokens, text=om.tokenizer.decode(tokens))
                if om.governor is not None:
                    result["governor"] = {**om.governor.stats.to_json(), **om.governor.counters()}
                write_json(json_path, result)

    @app.command()
    def calibrate(
        model: Path = opt.model_option(),
        draft: Path = opt.draft_option(required=True, help="Drafter to fit the projections for (path or hub id)."),
        out: Path = typer.Option(None, "--out", help="Projection file to write (default: next to the target, named for the drafter)."),
        text: Path = typer.Option(None, "--text", help="Calibration text file (default: the built-in sample, fine for tiny models only)."),
        max_tokens: int = typer.Option(8192, "--tokens", min=512, help="Calibration tokens to use at most."),
        budget: str = opt.budget_option(),
    ):
        """Fit per-layer drafter->target projections for spmoe forecasting (ridge regression)."""
        from rich.table import Table

        from runtime.tune import calibrate as fit
        from runtime.decode import default_projection_path, load_drafter
        from runtime.decode import OffloadConfig, OffloadedModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # long calibration texts exceed model_max_length on purpose
        om = OffloadedModel.load(model, OffloadConfig(budget=budget))
        try:
            draft_model, draft_config = load_drafter(draft, om)
            if text is None:
                from importlib.resources import files

                corpus = (files("runtime") / "data" / "calibration.txt").read_text()
            else:
                corpus = text.read_text(encoding="utf-8", errors="replace")
            with progress_bar(console=err_console) as bar:
                task = bar.add_task("calibrating", total=min(max_tokens, len(om.tokenizer.encode(corpus))))
                proj, report = fit(om, draft_model, draft_config, corpus, max_tokens=max_tokens,
                                   progress=lambda n: bar.advance(task, n))
            default = default_projection_path(om.store.model_dir, draft_config)
            base = report.baseline_agreement
            table = Table(title=f"projection fit on {report.n_tokens - report.held_out_tokens} tokens; "
                                f"scores on {report.held_out_tokens} held-out tokens")
            table.add_column("layer"), table.add_column("R^2"), table.add_column("router top-k agreement")
            if base:
                table.add_column("no projection")
            worse = set(report.worse_layers())
            for l in sorted(report.r2):
                row = [str(l), f"{report.r2[l]:.3f}", f"{report.agreement[l]:.1%}"] + ([f"{base[l]:.1%}"] if base else [])
                table.add_row(*row, style="red" if l in worse else None)
            console.print(table)
            if worse:
                what = "lower router agreement than no projection" if base else "R^2 < 0"
                err_console.print(f"warning: the projection does worse than none on layers {sorted(worse)} "
                                  f"(held-out {what})", highlight=False)
            why = report.worse_than_none()
            if why is not None and (out is None or out == default):
                err_console.print(f"warning: not installed: {why}. `generate` will not use it; "
                                  f"pass --out PATH to keep it elsewhere (and --projection PATH to try it)", highlight=False)
                if default.exists():
                    err_console.print(f"note: an earlier projection is still at {default}; remove it if it is stale",
                                      highlight=False)
                return
            path = out or default
            proj.save(path)
            if why is not None:
                err_console.print(f"warning: {why}; written to {path} because --out asked for it", highlight=False)
            err_console.print(f"wrote {path}")
        finally:
            om.close()
