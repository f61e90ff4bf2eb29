"""Loading the engine for the long-running commands (`serve`, `chat`) and saying what was loaded."""

from __future__ import annotations

from pathlib import Path

from runtime.cli.options import check_route_ahead
from runtime.observe import err_console

__all__ = ["load_engine"]


def load_engine(model: Path, *, budget: str, draft: Path | None, num_draft: int | None = None,
                predictor: str | None = None, cutoff: int | None = None, policy: str | None = None,
                io_mode: str = "buffered", threads: int = 4, governor: bool = True, route_ahead: str | None = None):
    """runtime.api.load with the CLI's checks; prints the budget plan and where settings came from."""
    from runtime import load
    from runtime.cli.generate import describe_plan

    if num_draft is not None and num_draft < 1:
        raise ValueError(f"--num-draft {num_draft}; expected K >= 1")
    check_route_ahead(route_ahead)
    engine = load(model, budget=budget, draft=draft, num_draft=num_draft, predictor=predictor, cutoff=cutoff,
                  policy=policy, threads=threads, io_mode=io_mode, memory_governor=governor, route_ahead=route_ahead)
    for note in engine.notes:
        err_console.print(note, highlight=False)
    err_console.print(describe_plan(engine.model), highlight=False)
    if engine.draft is not None:
        d = engine.draft
        err_console.print(f"speculative: drafter {d.path}, K={d.num_draft}, predictor {d.predictor}, "
                          f"cutoff {'all' if d.cutoff is None else d.cutoff}", highlight=False)
    return engine
