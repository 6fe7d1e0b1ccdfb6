#!/usr/bin/env bash
# Creates .venv with the pinned CPU PyTorch and seqpar (editable, with test tools). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build. --no-compile: the modules are
# byte-compiled as they are first imported; pip's compiling of every installed file was 40% of the set-up (29 s
# of 72 s on the 2-core machine), most of it for modules nothing here imports.
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -e ".[dev]"
