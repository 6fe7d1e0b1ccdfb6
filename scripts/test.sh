#!/usr/bin/env bash
# Sets up .venv and runs the linter and the whole test suite (multi-rank tests spawn gloo ranks on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
