#!/usr/bin/env bash
# Sets up .venv and serves the documentation site locally with live reload (http://127.0.0.1:8000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/mkdocs serve "$@"
