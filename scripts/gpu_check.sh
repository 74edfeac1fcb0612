#!/usr/bin/env bash
# The GPU check: on a machine with CUDA GPUs and sglang installed, run the seed's real-rollout mode
# with real sglang servers as the rollout engines (4 engines x 1 GPU, dummy weights until the
# trainer's first push) behind the sglang router. Everything stays on 127.0.0.1.
#
#   bash scripts/gpu_check.sh [extra Hydra overrides]
#
# Exit 0: the run passed. Exit 1: the run's verdict failed (see the report it names). Exit 2: this
# machine cannot run the check (no GPU, no sglang), said in one line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine" >&2; exit 2
fi
if ! "$PY" -c "import sglang" 2>/dev/null; then
  echo "gpu_check: sglang is not installed in $PY's environment (pip install sglang, CUDA build)" >&2; exit 2
fi
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -lt 4 ]; then
  echo "gpu_check: the mode runs 4 rollout engines on 1 GPU each; this machine has $GPUS GPU(s)" >&2; exit 2
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PY" -m ftexp mode=dp2_cp2_real_rollout scenario=no_failure trainer.rollout.backend=sglang \
  hydra.run.dir="outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)" "$@"
