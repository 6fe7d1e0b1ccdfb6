#!/usr/bin/env bash
# Creates .venv with the pinned CPU PyTorch and seqpar (editable, with test tools). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
