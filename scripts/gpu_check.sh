#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one run that installs nothing (the machine has torch + triton):
#   1. the kernel tests with CUDA tensors (DSV4_TEST_DEVICE=cuda: no interpreter),
#   2. the engine on CUDA against CPU fp32, CUDA graphs on and off, and with 2 speculative drafts per decode
#      (scripts/check_engine_device.py),
#   3. device launches and host syncs of a decode step on CUDA (scripts/count_launches.py --device cuda),
#   4. every kernel against its reference and timed at DeepSeek-V4-Flash shapes (scripts/bench_kernels.py),
#   5. the host loop on CUDA (scripts/bench_host_overhead.py): host ms per decode step with a stub forward, and
#      steps/s of the tiny model's real forward with overlap scheduling on and off,
#   6. structured outputs on CUDA (scripts/bench_structured.py: pinned masks, the mask kernel in the engine, the
#      decode tok/s cost of constrained rows), when xgrammar is installed (it is in requirements.txt),
#   7. speculative decoding on CUDA (scripts/bench_speculative.py): decode tok/s with k = 0, 1, 2 drafts side by
#      side, CUDA graphs on (decode steps and verify steps whose rows carry k drafts each; the draft passes run
#      eagerly). The built-in checkpoint's drafts are random (almost never accepted): this measures what
#      speculation costs, its worst case.
# Results go to ${OUT:-results/gpu_check}; a summary table is printed last. Exit status 1 if any part failed.
#
#   bash scripts/gpu_check.sh            # from the repository root, on the GPU machine
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
unset TRITON_INTERPRET

declare -A status
run() {  # name, command...
  local name="$1"; shift
  echo "=== $name: $*"
  local start=$SECONDS
  if "$@" > >(tee "$OUT/$name.log") 2>&1; then status[$name]="ok ($((SECONDS - start)) s)"
  else status[$name]="FAILED ($((SECONDS - start)) s, see $OUT/$name.log)"; fi
}

run kernel_tests env DSV4_TEST_DEVICE=cuda "$PY" -m pytest tests/kernels -q -x -p no:cacheprovider
run engine "$PY" scripts/check_engine_device.py --device cuda --num-speculative-tokens 2 --json "$OUT/engine.json"
run launches "$PY" scripts/count_launches.py --device cuda --json "$OUT/launches.json"
run bench_kernels "$PY" scripts/bench_kernels.py --json "$OUT/kernels.json" --csv "$OUT/kernels.csv"
run host_loop "$PY" scripts/bench_host_overhead.py --device cuda --rows 8 64 256 --contexts 1024 16384 \
  --repeats 3 --steps 50 --real-forward --json "$OUT/host_loop.json"
if "$PY" -c "import xgrammar" 2>/dev/null; then
  run structured "$PY" scripts/bench_structured.py --device cuda --skip-compile --repeats 3 \
    --json "$OUT/structured.json" --csv "$OUT/structured.csv" --plot "$OUT/structured.png"
else
  status[structured]="not run (xgrammar not installed)"
fi
run speculative "$PY" scripts/bench_speculative.py --device cuda --cuda-graphs --ks 0 1 2 --concurrency 1 8 32 \
  --runs 3 --json "$OUT/speculative.json" --csv "$OUT/speculative.csv"

echo
echo "=== summary ($("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null || echo 'no GPU'))"
failed=0
for name in kernel_tests engine launches bench_kernels host_loop structured speculative; do
  printf '%-14s %s\n' "$name" "${status[$name]}"
  case "${status[$name]}" in FAILED*) failed=1 ;; esac
done
[ -f "$OUT/launches.json" ] && "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"launches per layer {r['per_layer_mean']:.1f}, per step {r['per_step']:.0f}, host syncs per step {r['syncs_per_step']:g}\")" "$OUT/launches.json"
exit $failed
