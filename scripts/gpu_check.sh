#!/usr/bin/env bash
# CUDA checks on a machine with a GPU and PyTorch already installed: the CUDA tests (attention kernels, NCCL
# strategies, and per hybrid family the kernel each mixer step ran, P = 1 against one process in time and peak
# memory, the delta rule opening call in bf16), the GPU kernel benchmark,
# and a short bf16 `seqpar train` under torchrun (NCCL). Logs go to $OUT (default ./gpu_check).
#   scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPU(s)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"
"$PY" -m seqpar.cli bench cuda "$@" 2>&1 | tee "$OUT/bench.log"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m seqpar.cli train --sp 1 --steps 60 \
    --precision bf16 --save-every 1000 --run-dir /tmp/seqpar_gpu_run --no-progress 2>&1 | tail -n 25 | tee "$OUT/train.log"
