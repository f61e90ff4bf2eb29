"""`specmoe generate`: text from an offloaded model, with paging stats."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from runtime.budget import format_bytes
from runtime.report import err_console, write_json


def describe_plan(om) -> str:
    plan = om.plan
    slots = sorted(set(plan.slots.values()))
    n_layers = len(plan.slots)
    lines = [
        f"budget: {format_bytes(plan.budget_bytes)} for experts = {'/'.join(map(str, slots))} slots x {n_layers} MoE layers "
        f"({plan.fraction:.0%} of {format_bytes(plan.expert_bytes_total)} of experts; minimum {format_bytes(plan.min_bytes)})",
        f"resident weights: {format_bytes(om.store.resident_bytes)} | store: {om.store.kind} {om.store.model_dir}",
    ]
    if plan.breakdown:
        b = plan.breakdown
        lines.append("auto: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in b.items() if v))
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command()
    def generate(
        model: Path = typer.Option(..., "--model", "-m", help="mlx-lm checkpoint directory or a store made by `specmoe convert`."),
        prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
        budget: str = typer.Option("50%", "--budget", "-b", help="Expert cache size: 6GB, 512MiB, 40% (of expert bytes) or auto."),
        max_tokens: int = typer.Option(100, "--max-tokens", "-n", min=1, help="Tokens to generate."),
        temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature; 0 is greedy."),
        top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass."),
        seed: int = typer.Option(0, "--seed", help="Random seed for sampling."),
        policy: str = typer.Option("lru", "--policy", help="Cache eviction policy: lru or lfu."),
        io_mode: str = typer.Option("buffered", "--io-mode", help="buffered (page cache) or direct (O_DIRECT/F_NOCACHE)."),
        threads: int = typer.Option(4, "--threads", min=1, max=64, help="Loader I/O threads."),
        verify: bool = typer.Option(True, "--verify/--no-verify", help="Check each packed record's CRC32 after reading it."),
        chat: bool = typer.Option(True, "--chat/--raw-prompt", help="Apply the tokenizer's chat template if it has one."),
        json_path: Path = typer.Option(None, "--json", help="Write the text and stats as JSON to this path."),
    ):
        """Generate text with routed experts paged from disk into a fixed-budget cache."""
        import mlx.core as mx

        from runtime.generation import encode_prompt, generate_tokens
        from runtime.offloaded_model import OffloadConfig, OffloadedModel

        mx.random.seed(seed)
        om = OffloadedModel.load(model, OffloadConfig(budget=budget, policy=policy, threads=threads, io_mode=io_mode, verify_checksums=verify))
        try:
            err_console.print(describe_plan(om), highlight=False)
            ids = encode_prompt(om.tokenizer, prompt, chat=chat)
            detok = om.tokenizer.detokenizer
            detok.reset()

            def show(token: int) -> None:
                detok.add_token(token)
                sys.stdout.write(detok.last_segment)
                sys.stdout.flush()

            tokens, stats = generate_tokens(om.model, ids, max_tokens=max_tokens, temp=temp, top_p=top_p,
                                            eos_ids=set(om.tokenizer.eos_token_ids), om=om, on_token=show)
            detok.finalize()
            sys.stdout.write(detok.last_segment + "\n")
            err_console.print(stats.line(), highlight=False)
            if json_path:
                write_json(json_path, {"model": str(model), "budget": budget, "budget_bytes": om.plan.budget_bytes,
                                       "slots": om.plan.slots, "tokens": tokens,
                                       "text": om.tokenizer.decode(tokens), "stats": stats.to_json()})
        finally:
            om.close()
