#!/usr/bin/env bash
# Serve the model repository with tritonserver (on 127.0.0.1 unless --address says otherwise; Ctrl-C stops it).
#   bash scripts/serve.sh [--set KEY=VALUE ...] [--model-repository DIR] [--address A] [--http-port P]
#                         [--grpc-port P] [--metrics-port P] [-- EXTRA_TRITONSERVER_FLAGS...]
# Defaults: model_repository/ of this checkout, address 127.0.0.1 (0.0.0.0: every interface), ports 8000 (HTTP) /
# 8001 (gRPC) / 8002 (metrics).
# --set changes a config.pbtxt parameter (e.g. --set checkpoint=/data/DeepSeek-V4-Flash): the
# repository is then written to build/model_repository by scripts/make_model_repository.py, which
# checks the values first.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL_REPOSITORY="$REPO_ROOT/model_repository"
ADDRESS=127.0.0.1
HTTP_PORT=8000
GRPC_PORT=8001
METRICS_PORT=8002
EXTRA=()
SETS=()

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
while [ $# -gt 0 ]; do
  case "$1" in  # (a flag that takes a value, given last without one)
    --model-repository|--set|--address|--http-port|--grpc-port|--metrics-port) [ $# -ge 2 ] || { echo "serve.sh: $1 needs a value" >&2; usage >&2; exit 2; } ;;
  esac
  case "$1" in
    --model-repository) MODEL_REPOSITORY="$2"; shift 2 ;;
    --set) SETS+=(--set "$2"); shift 2 ;;
    --address) ADDRESS="$2"; shift 2 ;;
    --http-port) HTTP_PORT="$2"; shift 2 ;;
    --grpc-port) GRPC_PORT="$2"; shift 2 ;;
    --metrics-port) METRICS_PORT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "serve.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
MODEL_REPOSITORY="$(cd "$MODEL_REPOSITORY" && pwd)"

bash "$REPO_ROOT/scripts/setup.sh"
# shellcheck source=scripts/env.sh
source "$REPO_ROOT/scripts/env.sh"

if [ ${#SETS[@]} -gt 0 ]; then
  [ "$MODEL_REPOSITORY" = "$REPO_ROOT/model_repository" ] || { echo "serve.sh: --set needs the default repository" >&2; exit 2; }
  MODEL_REPOSITORY="$REPO_ROOT/build/model_repository"
  python3 "$REPO_ROOT/scripts/make_model_repository.py" --out "$MODEL_REPOSITORY" "${SETS[@]}" >/dev/null
fi

echo "[serve] tritonserver: model repository $MODEL_REPOSITORY;" \
  "HTTP $ADDRESS:$HTTP_PORT, gRPC $ADDRESS:$GRPC_PORT, metrics $ADDRESS:$METRICS_PORT"
exec "$TRITON_BIN" \
  --model-repository="$MODEL_REPOSITORY" \
  --backend-directory="$TRITON_BACKEND_DIR" \
  --http-address="$ADDRESS" --http-port="$HTTP_PORT" \
  --grpc-address="$ADDRESS" --grpc-port="$GRPC_PORT" \
  --metrics-address="$ADDRESS" --metrics-port="$METRICS_PORT" \
  --allow-gpu-metrics=false \
  --pinned-memory-pool-byte-size=0 \
  --exit-timeout-secs=10 \
  "${EXTRA[@]}"
