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
# two pytest workers, each test file on one of them (its module fixtures and shared ranks stay together): the
# suite's launches and subprocesses leave a core idle part of the time
workers=(-n 2 --dist loadfile)
if ((fast)); then
    exec .venv/bin/python -m pytest -q "${workers[@]}" -m fast "$@"
fi
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
# the zoo sweep (every family of the installed transformers) is its own tier, run after the rest
.venv/bin/python -m pytest -q "${workers[@]}" -m "not zoo" "$@"
.venv/bin/python -m pytest -q -m zoo "$@"
