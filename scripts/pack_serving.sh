#!/usr/bin/env bash
# Pack what serving needs beyond a Python with torch into one .txz (about 31 MB): tritonserver with its Python backend
# stub, perf_analyzer, and every shared library they load that the system does not provide (from this checkout's
# venv). For a machine without the venv, as a GPU image: scripts/bench_v4_serving.py --bundle FILE unpacks it and
# serves from it (its TRITON_HOME and PERF_ANALYZER; scripts/env.sh keeps them).
#
#   bash scripts/pack_serving.sh [OUT]        # default .serving/dsv4-serving.txz (ignored by git)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$REPO_ROOT/.serving/dsv4-serving.txz}"
# shellcheck source=scripts/env.sh
source "$REPO_ROOT/scripts/env.sh"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

mkdir -p "$STAGE/tritonserver/lib" "$(dirname "$OUT")"
cp -r "$TRITON_HOME/bin" "$TRITON_HOME/backends" "$TRITON_HOME/caches" "$STAGE/tritonserver/"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
cp "$PERF_ANALYZER" "$STAGE/perf_analyzer"
# The stub embeds one Python: every version the wheel ships goes along, and the one of the machine's python3 is put in
# place when the bundle is unpacked (scripts/bench_v4_serving.py; the last GPU image had Python 3.12).
cp -r "$DSV4_SITE_PACKAGES/pytriton/tritonserver/python_backend_stubs" "$STAGE/stubs"
binaries=("$TRITON_BIN" "$TRITON_BACKEND_DIR/python/triton_python_backend_stub"
          "$TRITON_BACKEND_DIR/python/libtriton_python.so" "$PERF_ANALYZER")
# The libraries found outside the system's own directories, but libpython: the stub must use the Python it runs.
ldd "${binaries[@]}" | awk '/=> \// { print $3 }' | sort -u | grep -v -E '^/(usr/)?lib(64)?/' |
  grep -v /libpython | while read -r lib; do cp -L "$lib" "$STAGE/tritonserver/lib/"; done
tar cJf "$OUT" -C "$STAGE" .
echo "[pack] $OUT: $(du -h "$OUT" | cut -f1)"
