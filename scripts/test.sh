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
# one pytest process: the multi-rank tests keep both cores busy, and a second worker's ranks only contend with them
# (measured on the 2-core machine: the suite took 968 s on two workers, 927 s on one)
if ((fast)); then
    exec .venv/bin/python -m pytest -q -m fast "$@"
fi
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
# the zoo sweep (tests/test_zoo.py, marker zoo: every family of the installed transformers) is read last; its sp 2
# sweeps run in the background from the start (tests/zoo_sweeps.py)
.venv/bin/python -m pytest -q "$@"
