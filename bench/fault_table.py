"""The reliability table: every fault and bad input the tests try, and what each produced.

Runs the very cases of tests/test_faults.py (FAULT_CASES), tests/test_fuzz_inputs.py
(INPUT_CASES) and tests/test_convert_kill.py (SIGKILL points) on freshly built
tiny checkpoints, applies the tests' own checks, and prints markdown tables (pasted
into docs/reliability.md) and a last JSON line. A row whose check fails says so:
the table reports, the tests decide.

    python bench/fault_table.py [--skip-kill]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.checkpoints import make_tiny  # noqa: E402
from storage.packer import convert  # noqa: E402
from tests.conftest import PROMPT, TINY  # noqa: E402
from tests.test_convert_kill import count_points, kill_at  # noqa: E402
from tests.test_faults import FAULT_CASES, N_TOKENS, check_outcome, run_fault_case  # noqa: E402
from tests.test_fuzz_inputs import INPUT_CASES, check_input_outcome, run_input_case  # noqa: E402


def _short(msg: str, root: Path) -> str:
    """An error message with the temporary directory cut out, safe inside a table cell."""
    msg = str(msg).replace(str(root) + "/", "").replace(str(root), "")
    msg = re.sub(r"/tmp/\S*?/(?=[^/\s]+(\s|:|$))", "", msg)
    return msg.replace("|", "\\|")


def _verdict(check, out) -> str:
    try:
        check(out)
        return "ok"
    except AssertionError as e:
        return f"CHECK FAILED: {str(e).splitlines()[0][:80]}"


def fault_rows(root: Path, paths: dict, drafter) -> tuple[list[str], int]:
    rows = ["| fault (`--inject` spec) | store | run | fired | retries | outcome | check |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    failed = 0
    for case in FAULT_CASES:
        out = run_fault_case(case, paths, PROMPT, drafter)
        verdict = _verdict(check_outcome, out)
        failed += verdict != "ok"
        tokens, expected, err = out["tokens"], out["expected"], out["error"]
        if err is not None:
            outcome = f"ended after {len(tokens)}/{len(expected)} tokens (all correct): `{_short(err, root)}`"
        elif tokens == expected:
            outcome = f"{len(tokens)}/{len(expected)} tokens identical to the fault-free run"
        else:
            first = next(i for i, (a, b) in enumerate(zip(tokens + [None] * N_TOKENS, expected)) if a != b)
            outcome = f"**tokens differ from token {first}** (no checksum to catch it)"
        fired = ", ".join(f"{k} x{v}" for k, v in sorted(out["fired"].items()))
        run = "speculative + prefetch" if case.speculative else "greedy"
        rows.append(f"| {case.name}: `{case.spec}` | {case.store} | {run} | {fired} | {out['retries']} | {outcome} | {verdict} |")
    return rows, failed


def input_rows(root: Path, sources: dict) -> tuple[list[str], int]:
    rows = ["| bad input | opened as | outcome | peak alloc | time | check |", "| --- | --- | --- | --- | --- | --- |"]
    failed = 0
    for i, case in enumerate(INPUT_CASES):
        out = run_input_case(case, root / f"input{i}", sources)
        verdict = _verdict(check_input_outcome, out)
        if case.known_bug:
            verdict = ("KNOWN DEFECT: " + case.known_bug) if verdict != "ok" else "ok (known defect fixed: drop the xfail)"
        else:
            failed += verdict != "ok"
        err = out["error"]
        outcome = "accepted" if err is None else f"{type(err).__name__}: `{_short(err, root / f'input{i}')}`"
        if len(outcome) > 160:
            outcome = outcome[:157] + "...`"
        rows.append(f"| {case.name} | {case.target} | {outcome} | {out['peak_bytes'] / 1024:.0f} KiB | "
                    f"{out['seconds'] * 1e3:.1f} ms | {verdict} |")
    return rows, failed


def kill_rows(root: Path, src: Path) -> list[str]:
    rows = ["| SIGKILL at point | mode | left next to DST (name: opens as complete store?) | next convert |",
            "| --- | --- | --- | --- |"]
    shown = {None: "does not open", True: "complete store", False: "OPENS BUT CORRUPT"}
    for force in (False, True):
        total = count_points(src, root / f"dry-{int(force)}" / "store", force=force)
        points = [1, 3, total // 2] + list(range(total - 8, total + 1))
        for n in points:
            dst = root / f"kill-{int(force)}-{n}" / "store"
            if force:
                convert(src, dst)
            label, survey = kill_at(src, dst, n, force=force)
            left = ", ".join(f"`{k.split('-')[0]}`: {shown[v]}" for k, v in survey.items()) or "nothing"
            try:
                convert(src, dst, force=force)
                nxt = "succeeds"
            except ValueError as e:
                nxt = f"refused: {_short(e, root)}" if "exists" in str(e) else f"ERROR {e}"
            rows.append(f"| {n}/{total} ({label}) | {'--force over a store' if force else 'new DST'} | {left} | {nxt} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-kill", action="store_true", help="Leave out the SIGKILL rows (they spawn ~25 processes).")
    args = ap.parse_args()
    from mlx_lm import load

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = make_tiny(root / "raw", "qwen3_moe", seed=1, **TINY)
        packed = convert(raw, root / "packed")
        dpath = make_tiny(root / "drafter", "qwen3", seed=9, layers=TINY["layers"])
        drafter = (load(str(dpath))[0], {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": TINY["layers"]})
        paths = {"raw": raw, "packed": packed}
        print(f"## Disk faults (qwen3_moe tiny, {TINY['layers']} MoE layers x {TINY['n_experts']} experts, "
              f"top-{TINY['top_k']}, budget 25%, {N_TOKENS} tokens, loader max_retries=3)\n")
        rows, fault_failed = fault_rows(root, paths, drafter)
        print("\n".join(rows))
        print("\n## Hostile inputs\n")
        rows, input_failed = input_rows(root, paths)
        print("\n".join(rows))
        if not args.skip_kill:
            print("\n## `specmoe convert` killed with SIGKILL\n")
            print("\n".join(kill_rows(root, make_tiny(root / "kill-src", "qwen3_moe", seed=2, **TINY))))
    known = sum(1 for c in INPUT_CASES if c.known_bug)
    print(json.dumps({"fault_cases": len(FAULT_CASES), "fault_checks_failed": fault_failed,
                      "input_cases": len(INPUT_CASES), "input_checks_failed": input_failed, "known_defects": known}))


if __name__ == "__main__":
    main()
