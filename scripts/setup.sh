#!/usr/bin/env bash
# Idempotent set-up of everything the project runs on, inside the repository:
#   .venv/                     Python 3.11 venv with requirements.txt
#   build/tritonserver/        tritonserver 2.51 laid out from the nvidia-pytriton wheel
#                              (bin/, backends/ with the python3.11 stub, caches/, lib/ for perf_analyzer)
#   checkpoints/dsv4-tiny/     the small built-in checkpoint (scripts/make_checkpoint.py)
# Each step is skipped when its stamp says it is up to date, so a second run takes about a second.
# Override the interpreter with DSV4_PYTHON=/path/to/python3.11. DSV4_SKIP_SETUP=1: nothing is done (a machine whose
# environment is given, as a GPU image with its own torch: scripts/bench_v4_serving.py checks what serving needs).
set -euo pipefail
[ -n "${DSV4_SKIP_SETUP:-}" ] && exit 0

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
VENV="$REPO_ROOT/.venv"
TRITON_HOME="$REPO_ROOT/build/tritonserver"
CHECKPOINT="$REPO_ROOT/checkpoints/dsv4-tiny"

say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

# One set-up at a time (serve.sh and test.sh may both call this).
mkdir -p "$REPO_ROOT/build"
exec 9>"$REPO_ROOT/build/.setup.lock"
flock 9

is_py311() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' >/dev/null 2>&1; }

find_python() {
  local candidate
  for candidate in "${DSV4_PYTHON:-}" python3.11 python3 /usr/bin/python3.11; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if is_py311 "$candidate"; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

# 1. The venv.
if [ -x "$VENV/bin/python" ] && is_py311 "$VENV/bin/python"; then
  say "venv: $VENV (Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'))"
else
  PYTHON="$(find_python)" || die "no Python 3.11 found (tried \$DSV4_PYTHON, python3.11, python3, /usr/bin/python3.11)"
  [ -e "$VENV" ] && { say "removing unusable venv $VENV"; rm -rf "$VENV"; }
  say "creating venv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# 2. Requirements, skipped while requirements.txt is unchanged.
REQ_STAMP="$VENV/.dsv4-requirements.sha256"
req_hash="$(sha256sum requirements.txt | cut -d' ' -f1)"
if [ -f "$REQ_STAMP" ] && [ "$(cat "$REQ_STAMP")" = "$req_hash" ]; then
  say "requirements: up to date (requirements.txt unchanged)"
else
  say "installing requirements.txt into the venv (about a minute on a fresh venv)"
  "$PY" -m pip install --disable-pip-version-check -q -r requirements.txt
  "$PY" - <<'EOF'
import numpy
assert int(numpy.__version__.split(".")[0]) < 2, f"numpy {numpy.__version__}: the Triton Python stub needs numpy < 2"
EOF
  echo "$req_hash" >"$REQ_STAMP"
fi

# (tab-separated: the checkout's path may hold spaces)
IFS=$'\t' read -r SITE_PACKAGES PY_VERSION PYTRITON_VERSION < <("$PY" - <<'EOF'
import importlib.metadata as md, sys, sysconfig
print(sysconfig.get_paths()["purelib"], f"{sys.version_info[0]}.{sys.version_info[1]}", md.version("nvidia-pytriton"),
      sep="\t")
EOF
)
PYTRITON_DIR="$SITE_PACKAGES/pytriton/tritonserver"
LIBS_DIR="$SITE_PACKAGES/nvidia_pytriton.libs"

# 3. tritonserver laid out from the wheel, with the stub for this Python.
# The wheel records only its own version; the server's release is printed by a running server alone (server_version in
# its start-up table), so the wheels requirements.txt has pinned are mapped here.
server_version() {
  case "$1" in
    0.7.0) echo 2.51.0 ;;
    *) echo "(release: server_version in its start-up log)" ;;
  esac
}
TRITON_STAMP="$TRITON_HOME/.stamp"
triton_key="nvidia-pytriton=$PYTRITON_VERSION python=$PY_VERSION site=$SITE_PACKAGES"
if [ -f "$TRITON_STAMP" ] && [ "$(cat "$TRITON_STAMP")" = "$triton_key" ] && [ -x "$TRITON_HOME/bin/tritonserver" ]; then
  say "tritonserver: up to date in $TRITON_HOME"
else
  [ -d "$PYTRITON_DIR" ] || die "$PYTRITON_DIR missing: is nvidia-pytriton installed?"
  stub="$PYTRITON_DIR/python_backend_stubs/$PY_VERSION/triton_python_backend_stub"
  [ -x "$stub" ] || die "no Python backend stub for Python $PY_VERSION in $PYTRITON_DIR/python_backend_stubs"
  say "laying out tritonserver $(server_version "$PYTRITON_VERSION") from the nvidia-pytriton $PYTRITON_VERSION wheel in $TRITON_HOME"
  rm -rf "$TRITON_HOME"
  mkdir -p "$TRITON_HOME/lib"
  cp -r "$PYTRITON_DIR/bin" "$PYTRITON_DIR/backends" "$PYTRITON_DIR/caches" "$TRITON_HOME/"
  cp "$stub" "$TRITON_HOME/backends/python/triton_python_backend_stub"
  say "  copied bin/, backends/, caches/ and the Python $PY_VERSION stub"
  # perf_analyzer (from tritonclient 2.51) links libb64.so.0d and libcudart.so.12; both are bundled
  # (under mangled names) in nvidia_pytriton.libs. Copies, not links: they survive a moved venv.
  b64="$(ls "$LIBS_DIR"/libb64-*.so.0d 2>/dev/null | head -n1)"
  cudart="$(ls "$LIBS_DIR"/libcudart-*.so.12* 2>/dev/null | head -n1)"
  [ -n "$b64" ] || die "libb64 not found in $LIBS_DIR"
  [ -n "$cudart" ] || die "libcudart not found in $LIBS_DIR"
  cp "$b64" "$TRITON_HOME/lib/libb64.so.0d"
  cp "$cudart" "$TRITON_HOME/lib/libcudart.so.12"
  say "  perf_analyzer libraries: $TRITON_HOME/lib/{libb64.so.0d,libcudart.so.12}"
  echo "$triton_key" >"$TRITON_STAMP"
fi

# shellcheck source=scripts/env.sh
source "$REPO_ROOT/scripts/env.sh"

# 4. The built-in checkpoint, rebuilt when scripts/make_checkpoint.py changes (it is deterministic).
CKPT_STAMP="$CHECKPOINT/.dsv4-make_checkpoint.sha256"
ckpt_hash="$(sha256sum scripts/make_checkpoint.py | cut -d' ' -f1)"
if [ -f "$CHECKPOINT/config.json" ] && [ -f "$CKPT_STAMP" ] && [ "$(cat "$CKPT_STAMP")" = "$ckpt_hash" ]; then
  say "checkpoint: $CHECKPOINT up to date"
else
  say "building the built-in checkpoint: python scripts/make_checkpoint.py --out checkpoints/dsv4-tiny"
  rm -rf "$CHECKPOINT"
  "$PY" scripts/make_checkpoint.py --out checkpoints/dsv4-tiny
  [ -f "$CHECKPOINT/config.json" ] || die "scripts/make_checkpoint.py did not write $CHECKPOINT/config.json"
  echo "$ckpt_hash" >"$CKPT_STAMP"
fi

# 5. Smoke checks, cheap enough to run every time.
# (`tritonserver --help` exits 1, so look for its usage text instead of the exit code.)
triton_help="$("$TRITON_BIN" --help 2>&1 || true)"
[[ "$triton_help" == *--model-repository* ]] || die "tritonserver does not start (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
"$PERF_ANALYZER" --version >/dev/null 2>&1 || die "perf_analyzer does not start (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
say "ready: tritonserver=$TRITON_BIN perf_analyzer=$PERF_ANALYZER"
