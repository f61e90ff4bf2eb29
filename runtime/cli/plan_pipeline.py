"""`specmoe plan-pipeline`: project a MoE model over N Macs joined by a link (a projection, not a measurement)."""

from __future__ import annotations

from pathlib import Path

import typer

from runtime.cli.options import DEFAULT_NUM_DRAFT
from runtime.observe import console, write_json


def register(app: typer.Typer) -> None:
    @app.command("plan-pipeline")
    def plan_pipeline(
        model: str = typer.Option(..., "--model", "-m", help="Preset (e.g. qwen3.5-35b-a3b) or a config.json (file or "
                                                             "directory)."),
        mac: str = typer.Option(..., "--mac", help="Mac of every rank, e.g. m4-16gb, m4-pro-64gb."),
        ranks: str = typer.Option("1,2,3,4", "--ranks", help="Numbers of Macs to project, comma-separated."),
        link: str = typer.Option("tb5-rdma,tb4,10gbe", "--link", help="Links: tb4, tb5, tb5-rdma, 10gbe (comma-separated)."),
        budget: str = typer.Option("auto", "--budget", "-b", help="Expert cache per rank: auto, a size, or a share of its experts."),
        context: int = typer.Option(4096, "--context", help="Context tokens for the KV cache."),
        bits: int = typer.Option(None, "--bits", help="Weight bits (mlx affine). Default: the config's, else 4."),
        draft_len: int = typer.Option(DEFAULT_NUM_DRAFT, "--num-draft", "-k",
                                      help="K for the speculative column (0: no speculation)."),
        acceptance: float = typer.Option(0.75, "--acceptance", help="Per-token acceptance rate assumed for speculation."),
        json_path: Path = typer.Option(None, "--json", help="Write every projection as JSON."),
    ):
        """Per-rank memory, hit rate, per-hop latency and tok/s of a pipeline of Macs (projection)."""
        from rich.table import Table

        from runtime.cache import parse_budget
        from runtime.plan import load_model_config, mac_profile, model_costs
        from runtime.plan import link_profile, project_pipeline
        from runtime.plan import SpecAssumptions

        name, config, _ = load_model_config(model)
        from runtime.cli.plan import resolve_quantization

        bits, group_size, mode = resolve_quantization(config, bits, None, None)  # as `specmoe plan`
        costs = model_costs(config, bits=bits, group_size=group_size, mode=mode, name=name)
        profile = mac_profile(mac)
        spec = SpecAssumptions(draft_len=draft_len, acceptance_rate=acceptance) if draft_len else None
        try:
            counts = [int(x) for x in ranks.split(",")]
        except ValueError:
            raise ValueError(f"--ranks {ranks!r}: expected numbers of Macs, e.g. 1,2,3") from None
        plans = []
        table = Table(title=f"{name} on {profile.label} x N (projection)")
        # 80 columns: narrow numeric columns (two-line headers) leave room for the per-rank lists, which fold
        # onto more lines rather than being cut short when there are many ranks
        widest = min(max(counts) * 4 - 1, 15)
        for col, width in (("Macs", None), ("link", None), ("GB per rank", widest), ("hit % per rank", widest),
                           ("hop\nms", None), ("plain\ntok/s", None), ("spec\ntok/s", None)):
            table.add_column(col, justify="left" if col in ("Macs", "link") else "right", overflow="fold",
                             min_width=width)
        for lk in link.split(","):
            lp = link_profile(lk.strip())
            for n in counts:
                p = project_pipeline(costs, config, profile, n, lp, budget=parse_budget(budget), context_tokens=context,
                                     spec=spec, bits=bits)
                plans.append(p)
                mem = "/".join(f"{r.memory_bytes / 1e9:.1f}" + ("" if r.fits else "!") for r in p.ranks)
                hit = "/".join(f"{100 * r.hit_rate:.0f}" for r in p.ranks)
                table.add_row(str(n), lp.name, mem, hit, f"{p.hop_ms:.3f}", f"{p.plain_tok_s:.2f}",
                              f"{p.spec_tok_s:.2f}" if p.spec_tok_s else "-")
        console.print(table)
        if plans:  # one Mac alone is the same for every row: one line, not a column
            one = plans[0]
            console.print(f"1 Mac alone: plain {one.single_tok_s:.2f} tok/s, speculative "
                          + (f"{one.single_spec_tok_s:.2f} tok/s" if one.single_spec_tok_s else "-")
                          + ("" if one.single_fits else " (does not fit)"), highlight=False)
        console.print("! = does not fit that Mac's GPU working set. Links: " +
                      "; ".join(f"{k}: {link_profile(k).source}" for k in dict.fromkeys(x.strip() for x in link.split(","))),
                      highlight=False)
        if json_path:
            write_json(json_path, {"kind": "projection", "plans": [p.to_json() for p in plans]})
