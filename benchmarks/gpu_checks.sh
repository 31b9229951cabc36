#!/usr/bin/env bash
# The CUDA path's hazard checks, one line per check, under 12 minutes on one GPU (an estimate: not yet run on
# one). First without, then with the CUDA sanitizer (TORCH_CUDA_SANITIZER=1 checks every kernel's stream
# ordering against the tensors it reads and writes). benchmarks/gpu.sh runs it first.
#
#   benchmarks/gpu_checks.sh [check ...]   (pinning paths delays drop sync-debug capture second-gpu
#                                           compute-thread write-back backward)
#   benchmarks/gpu_checks.sh --cpu-simulation   (no GPU: the compute-thread figure on the CPU, one line)
#
# pinning: every host buffer of a dim-256 toy and of the disk tier registered; paths: three forwards of the
# packed, prefetch-depth-2 (deferred copies), disk-tier and float8 paths (again under the sanitizer); delays:
# slow compute (torch.cuda._sleep in a hook) and slow copies on a user stream; drop: a pipeline dropped without
# disable(), then slot-sized allocations whose values survive; sync-debug: set_sync_debug_mode("error") in the
# steady state; capture: CUDA graph capture refused; second-gpu: a model on cuda:1 from a thread that never set
# its device leaves no context on GPU 0 (two GPUs); compute-thread, write-back, backward: what streaming still
# costs the compute thread (ratios of one run).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--cpu-simulation" ]; then
    exec timeout 600 "$PY" "$ROOT/benchmarks/gpu_checks.py" --cpu-simulation
fi
status=0
echo "== gpu checks"
timeout 420 "$PY" "$ROOT/benchmarks/gpu_checks.py" "$@" || status=1
echo "== gpu checks under TORCH_CUDA_SANITIZER=1 (packed, depth-2, disk tier, float8)"
TORCH_CUDA_SANITIZER=1 timeout 240 "$PY" "$ROOT/benchmarks/gpu_checks.py" paths || status=1
exit $status
