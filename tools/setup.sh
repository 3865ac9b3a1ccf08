#!/usr/bin/env bash
# Creates or refreshes .venv with every workspace package installed in editable mode.
#
# torch comes first and alone (pip), so no later step can pull a multi-GB CUDA build onto a CPU
# machine: the rest is installed by uv (seconds, where pip takes minutes) with torch pinned to the
# version just installed.
#   MILES_TORCH_SPEC   what to install when torch is missing (default: torch==2.13.0)
#   MILES_TORCH_INDEX  an index URL for it, e.g. PyTorch's CPU wheel index on machines whose pip
#                      would otherwise pick a CUDA build
# Re-running is cheap: the installs run only when a pyproject or requirements file changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "error: Miles needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

stamp=.venv/.miles-setup-stamp
want=$(cat tools/setup.sh tools/requirements-dev.txt packages/*/pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

echo "setting up .venv (first run takes under a minute)..." >&2
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  "${pip[@]}" install "${MILES_TORCH_SPEC:-torch==2.13.0}" ${MILES_TORCH_INDEX:+--index-url "$MILES_TORCH_INDEX"}
fi
"${pip[@]}" install "uv>=0.5"
torch_pin=$(mktemp)
trap 'rm -f "$torch_pin"' EXIT
.venv/bin/python -c 'from importlib.metadata import version; print("torch==" + version("torch"))' >"$torch_pin"
editables=()
for p in packages/*/; do editables+=(-e "$p"); done
# --compile-bytecode: every process (each test, each Ray actor) would otherwise compile
# transformers, Ray and the rest from source at every import, and never cache it where
# PYTHONDONTWRITEBYTECODE is set (as on this CPU machine): about a quarter of a short run's CPU.
.venv/bin/uv pip install --python .venv/bin/python -q --constraint "$torch_pin" --compile-bytecode \
  hatchling editables "${editables[@]}" -r tools/requirements-dev.txt
# The workspace's own sources (editable installs, outside site-packages) likewise. A later edit
# only makes its module's cache stale, and Python then compiles that module from source again.
.venv/bin/python -m compileall -q packages/*/src >/dev/null
echo "$want" >"$stamp"
