#!/usr/bin/env bash
# Creates .venv-fused for the fused-kernel tier (pytest -m fused): seqpar's .venv set-up plus Triton, fla and a
# mamba_ssm built without CUDA, whose Triton kernels run on CPU under Triton's interpreter. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-fused
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
# torch first and pinned, as scripts/setup.sh: an unpinned torch would pull a multi-GB CUDA build
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[dev]"
"${PIP[@]}" triton==3.9.0 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 setuptools wheel packaging
if ! "$VENV/bin/python" -m pip show -q mamba-ssm >/dev/null 2>&1; then
    # its sdist imports torch to describe itself (so no build isolation) and fetches a prebuilt CUDA wheel unless
    # forced to build; skipping the CUDA build leaves the Triton kernels (and no selective_scan_cuda to import)
    MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "${PIP[@]}" --no-deps --no-build-isolation \
        --no-binary mamba-ssm mamba-ssm==2.3.2.post1
fi
