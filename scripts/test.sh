#!/usr/bin/env bash
# Sets up .venv, runs the linter, builds the documentation site strictly (a broken link or docstring reference
# fails) and runs the whole test suite (multi-rank tests run on shared gloo ranks on CPU): the CI command.
# `scripts/test.sh --fast` is the quick tier for the inner loop: set-up, the linter and the tests marked `fast`
# (the exactness core, the structure rules, the documentation records), no docs build. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [[ ${1:-} == --fast ]]; then
    fast=1
    shift
fi
scripts/setup.sh
.venv/bin/ruff check .
if ((fast)); then
    exec .venv/bin/python -m pytest -q -m fast "$@"
fi
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
# the zoo sweep (every family of the installed transformers) is its own tier, run after the rest
.venv/bin/python -m pytest -q -m "not zoo" "$@"
.venv/bin/python -m pytest -q -m zoo "$@"
