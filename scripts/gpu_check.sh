#!/usr/bin/env bash
# The short GPU check (issue 37): on a machine with an NVIDIA GPU, torch, PyTorch Geometric and
# Triton installed, and no network, one command runs the Triton kernel checks on the GPU, then times
# the kernels and the 2-layer models (bench/gpu_check.py; its docstring says what), and writes
# report.md and gpu_check.csv under $OUT when set, else results/gpu. Nothing is installed or
# downloaded: it uses this tree and the Python found as GRANII_PYTHON (default: python3).
#
#   bash scripts/gpu_check.sh                    # 2M-node power-law graph, under 8 minutes
#   bash scripts/gpu_check.sh --nodes 500000     # arguments go to bench/gpu_check.py
#   bash scripts/gpu_check.sh --steps decisions  # about 3 minutes: the GPU path checks, the
#                                                # models (granii beside PyG) and the decisions
#
# The budget (GRANII_GPU_BUDGET seconds, default 390) bounds the Python steps: each step left when
# the budget is spent is skipped and reported as skipped; a hard stop at budget + 60 s leaves the
# report as written after the last finished step.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${GRANII_PYTHON:-python3}"
budget="${GRANII_GPU_BUDGET:-390}"
out="${OUT:-$root/results/gpu}"
mkdir -p "$out"
cd "$root"
unset TRITON_INTERPRET
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$py" - <<'PY' || { echo "granii: this Python lacks torch with CUDA or Triton" >&2; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "no CUDA device"
print(f"granii: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"triton {triton.__version__}")
PY
timeout --signal=INT --kill-after=20 "$((budget + 60))" \
  "$py" bench/gpu_check.py --budget "$budget" --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
echo "granii: report in $out/report.md (exit status $status)"
exit "$status"
