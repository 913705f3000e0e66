#!/usr/bin/env bash
# perf_analyzer over a concurrency sweep, streaming over gRPC, against an already served model
# (start one with `bash scripts/serve.sh`).
#
#   bash scripts/perf_analyzer.sh [--model dsv4] [--url 127.0.0.1:8001] [--concurrency 1,4,16]
#        [--input-tokens 128] [--output-tokens 32] [--tokenizer checkpoints/dsv4-tiny/tokenizer.json]
#        [--measurement-interval-ms 10000] [--stability-percentage 50] [--out results/perf_analyzer-DATE]
#        [-- EXTRA_PERF_ANALYZER_FLAGS...]
#
# Every request is the same: a text_input of --input-tokens tokens (counted with --tokenizer),
# max_tokens=--output-tokens with ignore_eos (so each request generates exactly that many),
# stream=true, temperature 0. Writes OUT/input_data.json, OUT/c<N>.csv per level (perf_analyzer -f),
# OUT/c<N>.log, and OUT/summary.csv (one row per concurrency level).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=dsv4
URL=127.0.0.1:8001
CONCURRENCY=1,4,16
INPUT_TOKENS=128
OUTPUT_TOKENS=32
TOKENIZER="$REPO_ROOT/checkpoints/dsv4-tiny/tokenizer.json"
INTERVAL_MS=10000
STABILITY=50
OUT="$REPO_ROOT/results/perf_analyzer-$(date +%Y%m%d-%H%M%S)"
EXTRA=()

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
while [ $# -gt 0 ]; do
  case "$1" in  # (a flag that takes a value, given last without one)
    --model|--url|--concurrency|--input-tokens|--output-tokens|--tokenizer|--measurement-interval-ms|--stability-percentage|--out) [ $# -ge 2 ] || { echo "perf_analyzer.sh: $1 needs a value" >&2; usage >&2; exit 2; } ;;
  esac
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --url) URL="$2"; shift 2 ;;
    --concurrency) CONCURRENCY="$2"; shift 2 ;;
    --input-tokens) INPUT_TOKENS="$2"; shift 2 ;;
    --output-tokens) OUTPUT_TOKENS="$2"; shift 2 ;;
    --tokenizer) TOKENIZER="$2"; shift 2 ;;
    --measurement-interval-ms) INTERVAL_MS="$2"; shift 2 ;;
    --stability-percentage) STABILITY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "perf_analyzer.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

for count in "$INPUT_TOKENS" "$OUTPUT_TOKENS"; do
  [[ "$count" =~ ^[1-9][0-9]*$ ]] || { echo "perf_analyzer.sh: token counts must be positive integers, got '$count'" >&2; exit 2; }
done
bash "$REPO_ROOT/scripts/setup.sh" >/dev/null
[ -f "$TOKENIZER" ] || { echo "perf_analyzer.sh: --tokenizer $TOKENIZER: no such file" >&2; exit 2; }
# shellcheck source=scripts/env.sh
source "$REPO_ROOT/scripts/env.sh"
mkdir -p "$OUT"
DATA="$OUT/input_data.json"

python3 - "$TOKENIZER" "$INPUT_TOKENS" "$OUTPUT_TOKENS" "$DATA" <<'EOF'
import json, sys
from tokenizers import Tokenizer

tokenizer_path, input_tokens, output_tokens, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tokenizer = Tokenizer.from_file(tokenizer_path)
words = "the quick brown fox jumps over the lazy dog while the engine keeps decoding".split()
text, i = "", 0
while len(tokenizer.encode(text).ids) < input_tokens:
    text += (" " if text else "") + words[i % len(words)]
    i += 1
while len(tokenizer.encode(text).ids) > input_tokens and " " in text:  # trim back to at most N
    text = text.rsplit(" ", 1)[0]
row = {
    "text_input": [text],
    "max_tokens": [output_tokens],
    "stream": [True],
    "exclude_input_in_output": [True],
    "sampling_parameters": [json.dumps({"temperature": 0, "ignore_eos": True})],
}
json.dump({"data": [row]}, open(out, "w"), indent=1)
print(f"[perf] input data: {len(tokenizer.encode(text).ids)} prompt tokens, {output_tokens} output tokens -> {out}")
EOF

SUMMARY="$OUT/summary.csv"
rm -f "$SUMMARY"
IFS=',' read -r -a LEVELS <<<"$CONCURRENCY"
for c in "${LEVELS[@]}"; do
  echo "[perf] concurrency $c: perf_analyzer -m $MODEL -i grpc -u $URL --streaming (log: $OUT/c$c.log)"
  "$PERF_ANALYZER" -m "$MODEL" -i grpc -u "$URL" --streaming \
    --input-data "$DATA" --concurrency-range "$c:$c" \
    --measurement-interval "$INTERVAL_MS" --stability-percentage "$STABILITY" --max-trials 10 \
    -f "$OUT/c$c.csv" "${EXTRA[@]}" >"$OUT/c$c.log" 2>&1 || {
      echo "[perf] perf_analyzer failed at concurrency $c:" >&2; tail -20 "$OUT/c$c.log" >&2; exit 1; }
  grep -E "Concurrency: $c,|Avg latency|Avg response|throughput" "$OUT/c$c.log" | sed 's/^/[perf]   /' || true
  if [ ! -f "$SUMMARY" ]; then head -n1 "$OUT/c$c.csv" >"$SUMMARY"; fi
  tail -n +2 "$OUT/c$c.csv" >>"$SUMMARY"
done
echo "[perf] summary: $SUMMARY"
