#!/usr/bin/env bash
# The GPU check, for a person with an NVIDIA GPU (not for CI: it needs a GPU and a model).
#
#   scripts/gpu_check.sh MODEL [OUT_DIR]
#
# MODEL: a transformers model directory, or a hub id already in the local Hugging Face cache
# (verispec never downloads). OUT_DIR: where the report goes (default gpu-check/<timestamp>).
# PYTHON: the interpreter to use (default .venv/bin/python); it needs a CUDA build of torch.
# GPU_CHECK_COMPILE=1 runs the benchmark with the compiled decode step (--compile).
#
# 1. prints the GPU as nvidia-smi and torch see it;
# 2. runs tests/test_device.py with VERISPEC_TEST_DEVICE=cuda: the greedy equivalence of ar, pld
#    and anpd through load(device="cuda"), a model moved to CUDA through transformers'
#    generate(), the compiled step, and the check that no tensor of a request leaves the GPU
#    (the CPU versions run too); fails if any CUDA test was skipped;
# 3. benchmarks ar, pld, anpd and transformers' own decoding (hf-ar) and prompt lookup (hf-pld)
#    on MODEL with --device cuda (the built-in prompts, 64 new tokens);
# 4. writes OUT_DIR/gpu_report.md (GPU, test summary, benchmark table) and prints its path.
set -euo pipefail

if [ -n "${CI:-}" ]; then
    echo "gpu_check.sh needs a GPU and a model: it is run by hand, not by CI" >&2
    exit 2
fi
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
MODEL=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${2:-"$ROOT/gpu-check/$(date +%Y%m%d-%H%M%S)"}
PYTHON=${PYTHON:-"$ROOT/.venv/bin/python"}
mkdir -p "$OUT"
REPORT="$OUT/gpu_report.md"
cd "$ROOT"

echo "== GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/nvidia-smi.txt" \
    || echo "(nvidia-smi not found)"
if ! "$PYTHON" - > "$OUT/torch-gpu.txt" <<'EOF'
import sys
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    print("CUDA is not available to this torch: install a CUDA build of torch (see pytorch.org) in this environment")
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
EOF
then
    cat "$OUT/torch-gpu.txt" >&2
    exit 1
fi
cat "$OUT/torch-gpu.txt"

echo "== device tests (VERISPEC_TEST_DEVICE=cuda)"
set +e
VERISPEC_TEST_DEVICE=cuda "$PYTHON" -m pytest tests/test_device.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt"
TESTS_STATUS=${PIPESTATUS[0]}
set -e
if grep -q "VERISPEC_TEST_DEVICE" "$OUT/tests.txt"; then
    echo "some CUDA tests were skipped (see $OUT/tests.txt)" >&2
    TESTS_STATUS=1
fi

echo "== benchmark on $MODEL"
COMPILE_FLAGS=()
if [ "${GPU_CHECK_COMPILE:-0}" = 1 ]; then
    COMPILE_FLAGS=(--compile)
fi
set +e
"$PYTHON" -m verispec.cli bench --model "$MODEL" --device cuda ${COMPILE_FLAGS[@]+"${COMPILE_FLAGS[@]}"} \
    --methods ar,pld,anpd --peers hf-ar,hf-pld --dataset builtin --max-new-tokens 64 --seed 0 \
    --no-progress --out "$OUT/bench" 2>&1 | tee "$OUT/bench.txt"
BENCH_STATUS=${PIPESTATUS[0]}
set -e

{
    echo "# verispec GPU check"
    echo
    echo "- date: $(date -Iseconds)"
    echo "- model: $MODEL"
    echo "- verispec: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo "## GPU"
    echo
    echo '```'
    cat "$OUT/nvidia-smi.txt" 2>/dev/null || true
    cat "$OUT/torch-gpu.txt"
    echo '```'
    echo
    echo "## Device tests (exit status $TESTS_STATUS)"
    echo
    echo '```'
    tail -n 25 "$OUT/tests.txt"
    echo '```'
    echo
    echo "## Benchmark (exit status $BENCH_STATUS)"
    echo
    if [ -f "$OUT/bench/report.md" ]; then
        cat "$OUT/bench/report.md"
    else
        echo '```'
        tail -n 25 "$OUT/bench.txt"
        echo '```'
    fi
} > "$REPORT"

echo "report: $REPORT"
[ "$TESTS_STATUS" = 0 ] && [ "$BENCH_STATUS" = 0 ]
