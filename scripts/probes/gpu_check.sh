#!/usr/bin/env bash
# The device machine's side of scripts/probes/gpu_train.py. The machine has PyTorch, transformers' dependencies and
# CUDA but not this project's other packages: they travel as wheels in .whl/ (carried; see scripts/probes/README.md
# for the download command), are installed into /tmp/site, and the probe runs with the machine's python3.
#   run: bash scripts/probes/gpu_check.sh [gpu_train.py options]   (carry: .whl data models/adapted)
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi -L
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in .whl/ (carry .whl; scripts/probes/README.md)" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 DO_NOT_TRACK=1
python3 scripts/probes/gpu_train.py --out "$OUT" "$@" 2>&1 | grep -v "^\[20..-..-.. " | tee "$OUT/probe.log"
