#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs first on a GPU machine whose image lacks them, downloaded into .whl/ (ignored
# by git: a device run carries it). The image has torch, triton, transformers, tokenizers, safetensors, numpy, pytest
# and pytest-xdist, but not:
#   pyzmq       the engine's rank messages (backend/parallel/data_parallel.py, imported with the engine: without it
#               every part that builds an engine fails);
#   xgrammar    structured outputs, with apache-tvm-ffi and pydantic (pydantic-core, annotated-types,
#               typing-inspection, and typing-extensions: pydantic-core needs 4.14's `Sentinel`, which the image's
#               may predate);
#   pytest-timeout  the suite's per-test time limit (pyproject.toml; without it pytest only warns of the setting);
#   numpy < 2   in .whl/serving/: the Python backend's stub needs it (requirements.txt), the image has numpy 2;
#               gpu_check.sh puts it first for its v4_serving part alone (the other parts keep the image's).
# Each at the version this checkout's venv holds (requirements.txt's pins), for the image's Python (3.12 by default).
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]      # from the repository root, where pip can reach the index
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION="${1:-3.12}"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
NAMES=(pyzmq xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions
       pytest-timeout)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
download() {  # name, folder: the venv's version of it
  local version
  version=$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1")
  mkdir -p "$2"
  rm -f "$2/${1//-/_}"-*.whl  # (one version of each: two would stop the whole install)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$2" "$1==$version"
}
for name in "${NAMES[@]}"; do download "$name" .whl; done
download numpy .whl/serving
ls -lR .whl
du -sh .whl
