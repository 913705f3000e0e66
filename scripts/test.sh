#!/usr/bin/env bash
# THE test command: set up (idempotent), then run the whole suite with the venv.
#   bash scripts/test.sh [PYTEST_ARGS...]     (default: tests/ -q --durations=25 -n WORKERS --dist loadfile: the
#                                              slowest tests listed last, where the suite's time goes; one worker
#                                              process a core, up to 4 (DSV4_TEST_WORKERS sets it), each test file's
#                                              tests on one worker, so a file's module fixtures start once)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
bash scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

args=("$@")
cores="$(nproc)"
workers="${DSV4_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
[ ${#args[@]} -gt 0 ] || args=(tests/ -q --durations=25 -n "$workers" --dist loadfile)
set +e
python -m pytest "${args[@]}"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: treated as a failure" >&2
  exit 1
fi
exit "$rc"
