"""Pipeline stages over mx.distributed against one process, measured in one run.

Physics: one decode token runs the stages one after another, so a pipeline cannot make a
token faster than one machine that holds the model; it adds one message per hop (a
(1, T, D) hidden state) and per-process overhead, and it lets each machine's expert cache
cover a larger share of its own layers' experts. On one machine the ranks share the CPU,
so this bench measures the cost of the pipeline machinery (messages, per-rank bookkeeping,
process split), not a multi-Mac speed-up; the planner (runtime/plan/pipeline_plan.py)
projects real links.

Variants, all greedy on the same prompt and the tiny trained target at the same per-rank
budget, each a fresh `specmoe generate` (single: one process; pipeline N: `mlx.launch -n N
--backend ring` on 127.0.0.1), named N/mode: 1/plain, 2/plain, 3/plain, 1/spec, 2/spec (the tiny
drafter, adaptive K in both). Every variant decodes as the engine's default (in the pipeline: a
device pass per forward on each stage). Variants run interleaved, `--repeats` times; the table gives
decode tok/s (median, min-max), the ratio to the single process of the same mode per repeat
(median, min-max), host syncs per decode step (or verify window) on each rank, the mean K, the
time per message seen by rank 0 and the bytes each rank sent. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from runtime.pipeline.local import local_launch_command  # noqa: E402

TINY = REPO / "runtime" / "data" / "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. Experts live on disk and the loader fetches them."


def run(variant: str, args, out: Path) -> dict:
    n_ranks, spec = variant.split("/")
    cli = [sys.executable, "-m", "runtime.cli.app", "generate", "-m", str(args.model), "-p", PROMPT, "--raw-prompt",
           "-n", str(args.tokens), "--budget", args.budget, "--json", str(out)]
    if spec == "spec":
        cli += ["--draft", str(args.draft), "--num-draft", str(args.num_draft), "--predictor", "spmoe"]
    if n_ranks == "1":
        cmd = cli + ["--no-memory-governor"]  # the stages have no governor either
    else:
        cmd = local_launch_command(int(n_ranks), [*cli, "--pipeline", "--pipeline-timeout", "300"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if not out.exists():
        raise RuntimeError(f"{variant} failed:\n{r.stderr[-2000:]}")
    d = json.loads(out.read_text())
    out.unlink()
    s = d["detail"] if n_ranks == "1" else d["stats"]  # one process: the decoder's own record (docs/json.md)
    if n_ranks == "1" and spec == "spec":  # SpecStats: every token over the time of all rounds
        tps = s["n_tokens"] / s["decode_s"] if s["decode_s"] else 0.0
    else:  # GenerationStats, PipelineStats: the same definitions (see runtime/pipeline/generation.py)
        tps = s["tokens_per_s"]
    row = {"tokens_per_s": tps, "tokens": d["tokens"]}
    if s.get("n_rounds"):
        row["mean_k"] = s["n_drafted"] / s["n_rounds"]
    if n_ranks == "1":
        n = s.get("n_rounds") or max(1, s["n_tokens"] - 1)  # verify windows, or decode steps
        row["syncs"] = [s["host_syncs"] / n if "host_syncs" in s else s.get("host_syncs_per_token")]
    else:
        kind = "verify" if spec == "spec" else "step"
        row["syncs"] = [x["counters"]["host_syncs"].get(kind, {}).get("host_syncs", 0)
                        / max(1, x["counters"]["host_syncs"].get(kind, {}).get("windows", 0)) for x in s["ranks"]]
        r0 = s["ranks"][0]["channel"]
        row["ms_per_message"] = 1000 * r0["send_s"] / max(1, r0["n_sent"])
        row["kb_sent"] = [round(x["channel"]["bytes_sent"] / 1e3, 1) for x in s["ranks"]]
        row["resident_mb"] = [round(x["resident_bytes"] / 1e6, 3) for x in s["ranks"]]
        row["cache_mb"] = [round(x["cache_bytes"] / 1e6, 3) for x in s["ranks"]]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=TINY / "target")
    p.add_argument("--draft", type=Path, default=TINY / "drafter")
    p.add_argument("--budget", default="50%")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default="1/plain,2/plain,3/plain,1/spec,2/spec")
    args = p.parse_args()
    variants = args.variants.split(",")
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for v in variants:
                rows[v].append(run(v, args, Path(tmp) / "out.json"))
                print(f"  repeat {rep + 1} {v}: {rows[v][-1]['tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
    summary = {}
    print(f"{'variant':<13}{'tok/s median (min-max)':>24}{'vs single (min-max)':>22}  host syncs/step per rank  mean K"
          f"  ms/message  same tokens  kB sent per rank")
    for v in variants:
        tps = [r["tokens_per_s"] for r in rows[v]]
        base_key = "1/" + v.split("/")[1]  # the single process in the same mode
        base = [r["tokens_per_s"] for r in rows[base_key]] if base_key in rows else None
        ratios = [a / b for a, b in zip(tps, base)] if base else []  # per repeat: the two ran back to back
        same = all(r["tokens"] == rows[variants[0]][0]["tokens"] for r in rows[v])
        msg = [r.get("ms_per_message") for r in rows[v] if r.get("ms_per_message") is not None]
        syncs = [round(statistics.median(col), 2) for col in zip(*[r["syncs"] for r in rows[v]])]
        ks = [r["mean_k"] for r in rows[v] if "mean_k" in r]
        summary[v] = {"tokens_per_s": tps, "median": statistics.median(tps), "ratio_vs_single": ratios,
                      "ratio_median": statistics.median(ratios) if ratios else None, "same_tokens": same,
                      "host_syncs_per_window": syncs, "mean_k": ks, "ms_per_message": msg,
                      **{k: rows[v][-1][k] for k in ("kb_sent", "resident_mb", "cache_mb") if k in rows[v][-1]}}
        ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        print(f"{v:<13}{statistics.median(tps):>9.2f} ({min(tps):.2f}-{max(tps):.2f}){ratio:>24}  "
              f"{' / '.join(f'{x:.2f}' for x in syncs):>24}  {(statistics.median(ks) if ks else 0):>6.2f}"
              f"{(statistics.median(msg) if msg else 0):>12.2f}  {str(same):>11}  {summary[v].get('kb_sent', '-')}")
    print(json.dumps({"bench": "pipeline", "model": str(args.model.relative_to(REPO) if args.model.is_relative_to(REPO) else args.model),
                      "budget": args.budget, "tokens": args.tokens, "num_draft": args.num_draft, "repeats": args.repeats,
                      "machine": "shared 2-core x86 CPU, MLX CPU backend, ranks on 127.0.0.1",
                      "load_avg_after": os.getloadavg(), "variants": summary}))


if __name__ == "__main__":
    main()
