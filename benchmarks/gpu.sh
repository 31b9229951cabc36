#!/usr/bin/env bash
# The GPU comparison of offload strategies, in one script, after the CUDA hazard checks (gpu_checks.sh, one
# line each into OUT_DIR/gpu_checks.txt): synthetic Wan-14B- and Flux-shaped block stacks,
# bf16, every strategy timed round robin in one process per model, the disk tier (one Wan stack with half its
# blocks on disk; Wan 2.2's two experts sharing a host pool), the headline (Wan 2.2 A14B on a 24 GB device), then
# the cold start. About 18-21 minutes on one H200 (an estimate: the disk-tier and headline runs have not run on a
# GPU yet).
#
#   benchmarks/gpu.sh OUT_DIR
#
# Runs from a bare copy of this repository's working tree: layerstream comes from src/ on PYTHONPATH (nothing
# to install); diffusers is optional (without it the diffusers-group rows are skipped with a note). Wheels in
# $LAYERSTREAM_WHEELS (default benchmarks/wheels) are pip-installed offline first, e.g. a diffusers wheel and its
# missing dependencies. Writes OUT_DIR/table.md, OUT_DIR/results.json, OUT_DIR/<model>/results.{md,json}, the
# trace of one Flux-shaped layerwise forward (OUT_DIR/flux12b/trace.json, timeline.png) and OUT_DIR/gpu.log.
# Then the cold start (OUT_DIR/cold-start/results.{md,json}): real-width Wan and Flux checkpoint folders (about
# 1.2 and 1.3 GB, written once under COLD_START_DIR, default ${TMPDIR:-/tmp}/layerstream-cold-start, not in OUT_DIR)
# loaded from cold files: raw read, from_pretrained(...).to("cuda"), group offload with streams, layerstream.
# Timeouts: BENCH_TIMEOUT_S per model (default 300 s for Wan, 120 s for Flux, 420 s for the cold start).
set -uo pipefail

OUT=${1:?usage: benchmarks/gpu.sh OUT_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu.log") 2>&1

echo "== environment"
date -u
nvidia-smi || echo "(nvidia-smi is not available)"
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "error: $PY cannot import torch; set PYTHON to an interpreter that has it" >&2
    exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| python', __import__('sys').version.split()[0])"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: torch sees no CUDA device; this script benchmarks a GPU (on a CPU use: PYTHONPATH=src $PY benchmarks/strategies.py --smoke)" >&2
    exit 2
fi

WHEELS=${LAYERSTREAM_WHEELS:-$ROOT/benchmarks/wheels}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "== installing wheels from $WHEELS (offline)"
    timeout 120 "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$WHEELS"/*.whl \
        || echo "warning: the offline wheel install failed; continuing with what is installed"
fi
if "$PY" -c "import diffusers" 2>/dev/null; then
    "$PY" -c "import diffusers; print('diffusers', diffusers.__version__)"
else
    echo "diffusers is not installed: the diffusers-group rows are skipped"
fi

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
failed=()

echo
if ! PYTHON="$PY" "$ROOT/benchmarks/gpu_checks.sh" | tee "$OUT/gpu_checks.txt"; then  # the hazards first
    failed+=(gpu-checks)
fi

bench() {  # bench NAME TIMEOUT_S ARGS...: one model, every strategy, into $OUT/NAME
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name: benchmarks/strategies.py $*"
    local start=$SECONDS
    if ! timeout --kill-after=10 "${BENCH_TIMEOUT_S:-$limit}" "$PY" "$ROOT/benchmarks/strategies.py" --device cuda --out "$OUT/$name" "$@"; then
        echo "error: the $name benchmark failed or timed out" >&2
        failed+=("$name")
    fi
    echo "($name took $((SECONDS - start)) s)"
}

# Wan 2.x 14B blocks at video length: compute-bound (~70 ms per block against ~15 ms of transfer), so layerwise
# should match resident; resident layers would change nothing here, and module mode would move 5.6 GB a forward.
# The compiled rows compile every block in place (regional compilation, as diffusers' compile_repeated_blocks);
# the goal is layerwise-compiled within 2% of resident-compiled. Two warm-up forwards pay the compilation.
bench wan14b 300 --model wan14b --blocks 8 --tokens 32768 --context-tokens 512 --dtype bfloat16 \
    --strategies resident,layerwise,diffusers-group,naive,resident-compiled,layerwise-compiled --repeats 3 --warmup 2

# The disk tier on the Wan shape: a host budget of half the blocks (4 of 8 blocks of 0.70 GB), the other half
# spilled to files under the layerstream cache on the local disk and read at every use; each read drops its
# pages from the page cache, so it reaches the disk. "x disk floor" compares with disk bytes / a disk speed the
# run does not know: read it from "disk MiB/fwd" and the drive's rating.
bench wan14b-disk 240 --model wan14b --blocks 8 --tokens 32768 --context-tokens 512 --dtype bfloat16 \
    --strategies resident,layerwise --host-budget-gb 2.85 --repeats 3 --warmup 1

# Wan 2.2's two experts (two Wan-shaped stacks of 8 blocks, one per step, two forwards a step) under a host
# budget of a third of their bytes: the shared host pool against a static split of the budget, and resident.
echo
echo "== wan22-pool: benchmarks/wan22_pool.py --device cuda"
start=$SECONDS
mkdir -p "$OUT/wan22-pool"
if ! timeout --kill-after=10 "${BENCH_TIMEOUT_S:-240}" "$PY" "$ROOT/benchmarks/wan22_pool.py" --device cuda --shape wan14b \
    --blocks 8 --tokens 8192 --context-tokens 512 --dtype bfloat16 --steps 8 --repeats 1 \
    --json "$OUT/wan22-pool/results.json" >"$OUT/wan22-pool/results.md"; then
    echo "error: the wan22-pool benchmark failed or timed out" >&2
    failed+=("wan22-pool")
fi
cat "$OUT/wan22-pool/results.md"
echo "(wan22-pool took $((SECONDS - start)) s)"

# The headline on a real GPU (benchmarks/headline.py --device cuda; on a CPU the same script is a simulation):
# Wan 2.2 A14B at its real widths (2 x 40 blocks of 0.70 GB + UMT5-XXL, about 66 GB built in host memory) and
# 720p x 81 frames' 75,600 tokens, resident first (the ideal: the GPU holds everything), then the device limited
# to 24 GB (torch.cuda.set_per_process_memory_fraction) and each row running the planner's configuration for a
# 24 GB / 32 GB machine: bfloat16, float8 in host memory (the exactness reference) and float8 with the disk tier,
# spill files on the local disk (about 38 GB at most, removed after each row). 3 steps (2 high-noise, 1
# low-noise: one change of expert). Not yet run on a GPU: about 10 minutes is an estimate (0.3 s a block forward).
echo
echo "== headline: benchmarks/headline.py --device cuda"
start=$SECONDS
if ! timeout --kill-after=10 "${BENCH_TIMEOUT_S:-900}" "$PY" "$ROOT/benchmarks/headline.py" --device cuda --steps 3 \
    --disk-dir "${HEADLINE_DISK_DIR:-${TMPDIR:-/tmp}}" --out "$OUT/headline"; then
    echo "error: the headline benchmark failed or timed out" >&2
    failed+=("headline")
fi
echo "(headline took $((SECONDS - start)) s)"

# Flux blocks at 4k image tokens: transfer-bound (a block computes in less time than it takes to copy), where
# keeping some blocks resident pays off, and where float8 storage (layerwise-fp8, and diffusers' group offloading
# with the same layerwise casting as its peer) moves fewer bytes; "max |diff|" says how far the output moves.
bench flux12b 120 --model flux12b --blocks 8 --tokens 4096 --context-tokens 512 --dtype bfloat16 \
    --strategies resident,layerwise,layerwise-resident-2,layerwise-auto,module,diffusers-group,naive,layerwise-fp8,diffusers-group-fp8 \
    --repeats 5 --warmup 1 --trace "$OUT/flux12b"

# Cold start, from the same files for every row, each row a fresh process with the files dropped from the page
# cache: the raw read (ceiling), DiffusionPipeline.from_pretrained(...).to("cuda") in the saved dtype (bf16) and
# in float32, diffusers' group offload with streams (pinned copies), and layerstream's load + enable (pinned).
echo
echo "== cold-start: benchmarks/cold_start.py --device cuda"
COLD_START_DIR=${COLD_START_DIR:-${TMPDIR:-/tmp}/layerstream-cold-start}
start=$SECONDS
if ! "$PY" -c "import diffusers" 2>/dev/null; then
    echo "diffusers is not installed: the cold start (which loads diffusers pipelines) is skipped"
elif ! timeout --kill-after=10 "${BENCH_TIMEOUT_S:-420}" "$PY" "$ROOT/benchmarks/cold_start.py" --device cuda \
    --dir "$COLD_START_DIR" --out "$OUT/cold-start"; then
    echo "error: the cold-start benchmark failed or timed out" >&2
    failed+=("cold-start")
fi
echo "(cold-start took $((SECONDS - start)) s)"

echo
echo "== lossless decode on the device (one real-width Wan block, bit-exact check included)"
mkdir -p "$OUT/lossless"
start=$SECONDS
# LOSSLESS_WEIGHTS: a folder of trained models' safetensors (one model a folder) to decode on the device too
if timeout 300 env PYTHONPATH="$ROOT/src" "$PY" "$ROOT/benchmarks/lossless.py" --device cuda --repeats 20 \
    ${LOSSLESS_WEIGHTS:+--weights "$LOSSLESS_WEIGHTS"} >"$OUT/lossless/results.md"; then
    cat "$OUT/lossless/results.md"
else
    echo "error: the lossless decode benchmark failed or timed out" >&2
    failed+=("lossless")
fi
echo "(lossless took $((SECONDS - start)) s)"

echo
echo "== single-file formats: one real-width Wan block's host bytes, dequantise on the device vs the copy it saves"
mkdir -p "$OUT/quantized-blocks"
if timeout 300 env PYTHONPATH="$ROOT/src" "$PY" "$ROOT/benchmarks/quantized_blocks.py" --device cuda --repeats 10 \
    >"$OUT/quantized-blocks/results.md"; then
    cat "$OUT/quantized-blocks/results.md"
else
    echo "error: the quantized-blocks benchmark failed or timed out (it needs diffusers and gguf)" >&2
    failed+=("quantized-blocks")
fi

echo
echo "== combined table: $OUT/table.md"
{
    echo "# layerstream GPU benchmark"
    echo
    for name in wan14b wan14b-disk wan22-pool headline flux12b cold-start lossless; do
        echo "## $name"
        echo
        if [ -f "$OUT/$name/results.md" ]; then cat "$OUT/$name/results.md"; else echo "(no results: see gpu.log)"; fi
        echo
    done
} >"$OUT/table.md"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {p.parent.name: json.loads(p.read_text()) for p in sorted(out.glob("*/results.json"))}
(out / "results.json").write_text(json.dumps(runs, indent=2) + "\n")
PYEOF
cat "$OUT/table.md"

if [ ${#failed[@]} -gt 0 ]; then
    echo "error: failed: ${failed[*]}" >&2
    exit 1
fi
