#!/usr/bin/env bash
# Sets up .venv, runs the linter, builds the documentation site strictly (a broken link or docstring reference
# fails) and runs the whole test suite (multi-rank tests spawn gloo ranks on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
.venv/bin/python -m pytest -q "$@"
