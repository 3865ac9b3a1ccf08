#!/usr/bin/env bash
# The whole test suite from a fresh clone: set-up, lint, format check, type check, tests.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k plugins`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "== ruff check" && ruff check .
echo "== ruff format --check" && ruff format --check .
echo "== mypy (miles-core)" && mypy packages/miles-core/src
echo "== pytest" && python -m pytest "$@"
