#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one run that installs nothing (the machine has torch + triton):
#   1. the kernel tests with CUDA tensors (DSV4_TEST_DEVICE=cuda: no interpreter),
#   2. the engine on CUDA against CPU fp32, CUDA graphs on and off, and with 1 and 2 speculative drafts per decode, and
#      with programmatic dependent launch and a layer's independent branches on a second stream; seeded sampling drawn
#      on the device repeating, with and without drafts (scripts/check_engine_device.py),
#   3. device launches and host syncs of a decode step on CUDA (scripts/count_launches.py --device cuda),
#   4. the kernels' tiles tuned on this device at DeepSeek-V4-Flash's shapes (scripts/tune_kernels.py, `tune`): written
#      to kernels/configs/<device>.json, which the parts after it launch with, and copied into the results folder
#      (commit it from there),
#   5. every kernel against its reference and timed at DeepSeek-V4-Flash shapes (scripts/bench_kernels.py),
#   6. the host loop on CUDA (scripts/bench_host_overhead.py): host ms per decode step with a stub forward, and
#      steps/s of the tiny model's real forward with overlap scheduling on and off; `host_verify`: host ms per static
#      decode step and per verify step of 1 and 2 drafts (stub forward and draft layer), what speculation adds to a
#      step it cannot overlap,
#   7. structured outputs on CUDA (scripts/bench_structured.py: pinned masks, the mask kernel in the engine, the
#      decode tok/s cost of constrained rows), when xgrammar is installed (it is in requirements.txt),
#   8. speculative decoding on CUDA (scripts/bench_speculative.py): decode tok/s with k = 0, 1, 2 drafts side by
#      side, CUDA graphs on (decode steps, verify steps whose rows carry k drafts each, and the draft passes after
#      them as one static chain), the chain against the eager draft passes (--draft-chains static eager), and each
#      verify step's cost over a decode step's with the speed-up it gives at V4-Flash's published acceptance
#      (speculative_step_cost.csv, speculative_step_cost.png). The trained draft when checkpoints/dsv4-tiny-mtp is
#      there, else the built-in checkpoint's random one (almost never accepted: what speculation costs, its worst
#      case). speculative_v4: the same step costs at V4-Flash's widths (dummy weights, 4 layers and the MTP layer).
#      speculative_adaptive: k = 1 against k = 0 with adaptive_speculation (drafting only at the batch sizes where
#      verify steps measure faster than plain ones), after a warm-up run in which it measures both.
#   sampling: drawing sampled rows at V4's vocabulary, filtered together on the device against each row on the host
#      (scripts/bench_sampling.py, sampling.csv).
#   v4_shapes: V4-Flash's widths with dummy weights in the published formats, as many layers as fit (scripts/bench_v4.py):
#      decode steps at 1, 16, 64, 256 requests of 8K positions and an 8K prefill, per layer and extrapolated to 43
#      layers, beside their rooflines at this device's measured copy bandwidth; then, on the same model in the same
#      run, the decode steps at 1 and 16 requests again with programmatic dependent launch (every kernel launched
#      while the one before it runs; and without the weight prefetch while a kernel waits, what that adds), with a
#      layer's independent branches on a second stream, and with both (rows named by `variant`; v4_shapes.json, .csv).
#   v4_serving: the same model served by tritonserver (scripts/bench_v4_serving.py: serve.sh, perf_analyzer streaming
#      at concurrency 1, 16, 64; TTFT and ITL from the server's histograms). Needs tritonserver, its Python stub and
#      perf_analyzer with their libraries: without this checkout's venv, carry the bundle of scripts/pack_serving.sh
#      as .serving/dsv4-serving.txz; what is missing otherwise is in v4_serving.log (exit status 3).
# Results go to ${RESULTS:-results/gpu_check}; a summary table is printed last. Exit status 1 if any part failed.
# Each part has a time limit (seconds, GPU_CHECK_LIMITS below), so the whole run fits a short lease; a part over
# its limit is reported as such, and the rest still run. With GPU_CHECK_ARCHIVE=FILE the results folder is also
# packed into that one .tgz after every part (a lease that returns few files still gets them all).
# Wheels in .whl/ (`bash scripts/gpu_wheels.sh` downloads them: pyzmq, which the engine imports, and xgrammar with its
# needs, none of which the GPU image has) are installed into a temporary folder first; carry .whl with the run.
#
#   bash scripts/gpu_check.sh            # from the repository root, on the GPU machine
set -u
cd "$(dirname "$0")/.."
RESULTS="${RESULTS:-results/gpu_check}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
    .whl/*.whl && export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
serving_path=()  # (the serving part's numpy < 2: .whl/serving, first on its PYTHONPATH alone)
if compgen -G ".whl/serving/*.whl" >/dev/null && "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/gpu_check_serving_site .whl/serving/*.whl; then
  serving_path=(env "PYTHONPATH=/tmp/gpu_check_serving_site${PYTHONPATH:+:$PYTHONPATH}")
fi
if ! "$PY" -c "import backend.engine" 2>"$RESULTS/imports.log"; then  # (every part but the kernels' builds an engine)
  echo "!!! the engine does not import here: $(tail -1 "$RESULTS/imports.log"); bash scripts/gpu_wheels.sh, then carry .whl"
fi
# every part but the kernels' serves the built-in checkpoint (and its tokenizer): built here when not carried
[ -f checkpoints/dsv4-tiny/config.json ] || "$PY" scripts/make_checkpoint.py --out checkpoints/dsv4-tiny \
  >"$RESULTS/make_checkpoint.log" 2>&1 || echo "!!! the built-in checkpoint could not be built: $RESULTS/make_checkpoint.log"
MTP_CHECKPOINT=checkpoints/dsv4-tiny-mtp   # scripts/train_mtp_draft.py: a draft that is accepted sometimes
[ -f "$MTP_CHECKPOINT/config.json" ] || MTP_CHECKPOINT=checkpoints/dsv4-tiny
# what each part took on an H200 (2026-12-04), with some room (kernel_tests: 453 tests since, against 297 then, each
# new configuration compiled: 60 s more; engine: 30 s more since its sampled runs, 20 s more
# since its runs with one draft a decode, 30 s more since its runs with programmatic dependent launch and the second
# stream; host_loop ran past its 60 s there, in its real-forward part's 64 requests of 16K positions: now of 1K, as
# the run that measured it by hand, and 120 s)
declare -A limit=([kernel_tests]=150 [engine]=170 [launches]=30 [tune]=200 [bench_kernels]=150 [host_loop]=120
                  [speculative]=150 [structured]=40)  # tune: never run yet; its sweep is budgeted to 150 s (TUNE_BUDGET_S)
# not yet run on a GPU: building the dummy model, compiling, the loads (speculative: 90 s before the eager chains
# were measured beside the static ones; v4_shapes: 60 s for its variants)
limit+=([v4_shapes]=300 [v4_serving]=300 [speculative_v4]=240 [sampling]=40 [host_verify]=60
        [speculative_adaptive]=120)
# The parts run in the order of what the open work needs measured first (with GPU_CHECK_DEADLINE_S, a part whose
# limit does not fit is left and the smaller ones after it still run): the kernels' and the engine's correctness,
# the tiles tuned for this device (the parts after it launch with them), V4-Flash's shapes end to end, the kernels
# timed, speculative decoding and structured outputs, then the rest; v4_serving last (it carries other files).
for kv in ${GPU_CHECK_LIMITS:-}; do limit[${kv%=*}]=${kv#*=}; done   # e.g. GPU_CHECK_LIMITS="engine=200"
for name in ${GPU_CHECK_PARTS:-}; do  # (a misspelt part would skip every part and pass)
  [ -n "${limit[$name]:-}" ] || {
    echo "gpu_check.sh: GPU_CHECK_PARTS names no part '$name' (parts: ${!limit[*]})" >&2; exit 2; }
done
# GPU_CHECK_PARTS="engine speculative": only those parts (a rerun after a fix)
# GPU_CHECK_DEADLINE_S=540: a part is started only if its limit ends within that many seconds of the start (the limits
# add up to more than one command of a lease may run); the summary names the parts left, as a GPU_CHECK_PARTS= line.
# The parts that write their results as they go (tune after each sweep, v4_shapes after each case, bench_kernels after
# each kernel) start anyway when at least this many seconds are left, limited to them: what they wrote before the
# deadline cut them is kept, and they are named for the next run as well.
declare -A keeps_partial=([tune]=60 [v4_shapes]=120 [bench_kernels]=60)

echo "=== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$RESULTS/device.txt"
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)' \
  2>&1 | tee -a "$RESULTS/device.txt"

declare -A status
left=()
run() {  # name, command...
  local name="$1"; shift
  if [ -n "${GPU_CHECK_PARTS:-}" ] && [[ " $GPU_CHECK_PARTS " != *" $name "* ]]; then status[$name]="skipped"; return; fi
  local part_limit=${limit[$name]} cut=""
  if [ -n "${GPU_CHECK_DEADLINE_S:-}" ] && [ $((SECONDS + part_limit)) -gt "$GPU_CHECK_DEADLINE_S" ]; then
    local remaining=$((GPU_CHECK_DEADLINE_S - SECONDS))
    if [ -z "${keeps_partial[$name]:-}" ] || [ "$remaining" -lt "${keeps_partial[$name]}" ]; then
      status[$name]="not started (its $part_limit s limit would end past GPU_CHECK_DEADLINE_S)"; left+=("$name"); return
    fi
    part_limit=$remaining; cut=" (cut to what is left before GPU_CHECK_DEADLINE_S)"
  fi
  echo "=== $name (limit $part_limit s$cut): $*"
  local start=$SECONDS rc
  PART_LIMIT_S=$part_limit timeout -k 5 "$part_limit" "$@" > >(tee "$RESULTS/$name.log") 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then status[$name]="ok ($((SECONDS - start)) s)"
  elif { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ -n "$cut" ]; then
    status[$name]="cut at GPU_CHECK_DEADLINE_S after $((SECONDS - start)) s (what it wrote is kept; see $RESULTS/$name.log)"
    left+=("$name")
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status[$name]="FAILED (over its $part_limit s limit, see $RESULTS/$name.log)"
  else status[$name]="FAILED (rc $rc, $((SECONDS - start)) s, see $RESULTS/$name.log)"; fi
  [ -n "${GPU_CHECK_ARCHIVE:-}" ] && tar czf "$GPU_CHECK_ARCHIVE" -C "$RESULTS" .
}

# xdist, where installed, compiles the kernels' variants on several cores at once. test_compile.py is left to the
# CPU suite: it checks what the pinned Triton compiles for sm_90 (registers, spills), and a GPU image may carry another.
xdist=(); "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)
run kernel_tests env DSV4_TEST_DEVICE=cuda "$PY" -m pytest tests/kernels -q -p no:cacheprovider "${xdist[@]}" \
  --deselect tests/kernels/test_compile.py
run engine "$PY" scripts/check_engine_device.py --device cuda --num-speculative-tokens 1 2 \
  --variants pdl side_stream pdl+side_stream --json "$RESULTS/engine.json"
run tune "$PY" scripts/tune_kernels.py --budget-s "${TUNE_BUDGET_S:-150}" --copy-to "$RESULTS"
run v4_shapes "$PY" scripts/bench_v4.py --variants pdl pdl+no_prefetch side_stream pdl+side_stream --variant-batches 1 16 \
  --out "$RESULTS/v4_shapes.json"
run bench_kernels "$PY" scripts/bench_kernels.py --json "$RESULTS/kernels.json" --csv "$RESULTS/kernels.csv"
run speculative "$PY" scripts/bench_speculative.py --checkpoint "$MTP_CHECKPOINT" --device cuda --cuda-graphs --ks 0 1 2 --concurrency 1 8 32 \
  --draft-chains static eager --runs 3 --json "$RESULTS/speculative.json" --csv "$RESULTS/speculative.csv" \
  --plot "$RESULTS/speculative.png"
if "$PY" -c "import xgrammar" 2>/dev/null; then
  run structured "$PY" scripts/bench_structured.py --device cuda --skip-compile --repeats 3 \
    --json "$RESULTS/structured.json" --csv "$RESULTS/structured.csv" --plot "$RESULTS/structured.png"
else
  status[structured]="not run (xgrammar not installed)"
fi
run speculative_v4 "$PY" scripts/bench_speculative.py --checkpoint docs/configs/deepseek-v4-flash.config.json --load-format dummy \
  --hf-overrides '{"num_hidden_layers": 4}' --device cuda --cuda-graphs --ks 0 1 2 --concurrency 1 8 32 --max-tokens 32 \
  --engine-settings '{"weight_format": "fp8", "numerics": "deepseek", "kv_cache_dtype": "fp8", "num_tokens": 16384}' \
  --runs 3 --json "$RESULTS/speculative_v4.json" --csv "$RESULTS/speculative_v4.csv"
run launches "$PY" scripts/count_launches.py --device cuda --json "$RESULTS/launches.json"
run sampling "$PY" scripts/bench_sampling.py --device cuda --csv "$RESULTS/sampling.csv"
run host_verify "$PY" scripts/bench_host_overhead.py --device cuda --rows 1 8 32 --contexts 1024 --repeats 3 --steps 50 \
  --skip-stand-in --cuda-graphs --num-speculative-tokens 0 1 2 --json "$RESULTS/host_verify.json"
run host_loop "$PY" scripts/bench_host_overhead.py --device cuda --rows 8 64 256 --contexts 1024 16384 \
  --repeats 3 --steps 50 --real-forward --sleep-context 1024 --json "$RESULTS/host_loop.json"
run speculative_adaptive "$PY" scripts/bench_speculative.py --checkpoint "$MTP_CHECKPOINT" --device cuda --cuda-graphs \
  --ks 0 1 --concurrency 1 8 32 --runs 3 --warm-up-tokens 64 --engine-settings '{"adaptive_speculation": true}' \
  --json "$RESULTS/speculative_adaptive.json" --csv "$RESULTS/speculative_adaptive.csv"
bundle=(); [ -f .serving/dsv4-serving.txz ] && bundle=(--bundle .serving/dsv4-serving.txz)
run v4_serving "${serving_path[@]}" "$PY" scripts/bench_v4_serving.py --device cuda --measurement-interval-ms 4000 \
  --out "$RESULTS/v4_serving" "${bundle[@]}"
echo
echo "=== summary ($("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null || echo 'no GPU'))"
failed=0
for name in kernel_tests engine tune v4_shapes bench_kernels speculative structured speculative_v4 launches sampling \
    host_verify host_loop speculative_adaptive v4_serving; do
  printf '%-14s %s\n' "$name" "${status[$name]}"
  case "${status[$name]}" in FAILED*) failed=1 ;; esac
done
[ ${#left[@]} -gt 0 ] && echo "left for another run: GPU_CHECK_PARTS=\"${left[*]}\" bash scripts/gpu_check.sh"
[ -f "$RESULTS/v4_shapes.json" ] && "$PY" -c "import json,sys; rows=[r for r in json.load(open(sys.argv[1])) if r['kind'] == 'decode' and r['extrapolated'] and not r['variant']]; print('V4-Flash decode step at 8K, extrapolated to 43 layers: ' + ', '.join(f\"batch {r['batch']} {r['step_ms']:.2f} ms ({r['ratio']:.2f}x its roofline)\" for r in rows))" "$RESULTS/v4_shapes.json"
[ -f "$RESULTS/v4_shapes.json" ] && "$PY" -c "import json,sys; rows=[r for r in json.load(open(sys.argv[1])) if r['kind'] == 'decode' and r['extrapolated']]; base={r['batch']: r['step_ms'] for r in rows if not r['variant']}; print('decode step variants: ' + ', '.join(f\"{r['variant']} batch {r['batch']} {r['step_ms']:.2f} ms ({base[r['batch']] / r['step_ms']:.2f}x)\" for r in rows if r['variant']))" "$RESULTS/v4_shapes.json"
[ -f "$RESULTS/launches.json" ] && "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"launches per layer {r['per_layer_mean']:.1f}, per step {r['per_step']:.0f}, host syncs per step {r['syncs_per_step']:g}\")" "$RESULTS/launches.json"
exit $failed
