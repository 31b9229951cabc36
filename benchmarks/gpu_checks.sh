#!/usr/bin/env bash
# The CUDA path's hazard checks, one line per check, under 12 minutes on one GPU (an estimate: not yet run on
# one). First without, then with the CUDA sanitizer (TORCH_CUDA_SANITIZER=1 checks every kernel's stream
# ordering against the tensors it reads and writes). benchmarks/gpu.sh runs it first.
#
#   benchmarks/gpu_checks.sh [check ...]     (pinning paths delays drop sync-debug capture second-gpu)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
echo "== gpu checks"
timeout 300 "$PY" "$ROOT/benchmarks/gpu_checks.py" "$@" || status=1
echo "== gpu checks under TORCH_CUDA_SANITIZER=1 (packed, depth-2, disk tier, float8)"
TORCH_CUDA_SANITIZER=1 timeout 300 "$PY" "$ROOT/benchmarks/gpu_checks.py" paths || status=1
exit $status
