#!/usr/bin/env bash
# The GPU check, for a person (or a machine) with an NVIDIA GPU; not for CI.
#
#   scripts/gpu_check.sh [MODEL [OUT_DIR]]
#
# MODEL: a transformers model directory, a hub id already in the local Hugging Face cache
# (verispec never downloads), or "random" (the default): random-weight Llama models built on the
# GPU by scripts/gpu_models.py (GPU_CHECK_SIZE=7b|1b|tiny, default 7b; a 68M draft model with the
# same vocabulary; an untrained exit head). Random weights are valid for step costs and exactness,
# not for acceptance rates. OUT_DIR: where the report goes (default gpu-check/<timestamp>).
# DRAFT_MODEL: the draft model of sps, mtad and transformers' assisted generation (random: the
# 68M one). EXIT_HEAD: eesd's exit head (random: the untrained one). PYTHON: the interpreter
# (default .venv/bin/python; it needs a CUDA build of torch). GPU_CHECK_COMPILE=1 benchmarks
# with the compiled decode step (--compile). MAX_NEW_TOKENS: tokens per prompt (default 128).
#
# 1. prints the GPU as nvidia-smi and torch see it;
# 2. runs tests/test_device.py with VERISPEC_TEST_DEVICE=cuda: greedy ar, pld, anpd (single paths
#    and trees), eesd and sps equal ar through load(device="cuda") on the fast-path families'
#    PyTorch path, mtad runs, a model moved to CUDA decodes through transformers' generate(), the
#    compiled step, and no tensor of a request leaves the GPU (the CPU versions run too); fails
#    if any CUDA test was skipped;
# 3. times forwards of 1..32 tokens against one (`verispec profile`);
# 4. benchmarks every method against transformers' own decoding (hf-ar), prompt lookup (hf-pld)
#    and assisted generation with the same draft model (hf-assisted): greedy on the built-in
#    prompts, then sampled (temperature 1, top-k 10, top-p 0.9) for ar, sps, mtad, hf-ar and
#    hf-assisted;
# 5. writes OUT_DIR/gpu_report.md (GPU, models, tests, forward costs, the two tables) and prints
#    its path.
set -euo pipefail

if [ -n "${CI:-}" ]; then
    echo "gpu_check.sh needs a GPU: it is run by hand, not by CI" >&2
    exit 2
fi
if [ $# -gt 2 ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
MODEL=${1:-random}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${2:-"$ROOT/gpu-check/$(date +%Y%m%d-%H%M%S)"}
PYTHON=${PYTHON:-"$ROOT/.venv/bin/python"}
TOKENS=${MAX_NEW_TOKENS:-128}
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

if [ "$MODEL" = random ]; then
    echo "== random-weight models (${GPU_CHECK_SIZE:-7b})"
    "$PYTHON" scripts/gpu_models.py "$OUT/models" --size "${GPU_CHECK_SIZE:-7b}" --device cuda 2>&1 | tee "$OUT/models.txt"
    MODEL="$OUT/models/target"
    DRAFT_MODEL=${DRAFT_MODEL:-"$OUT/models/draft"}
    EXIT_HEAD=${EXIT_HEAD:-"$OUT/models/exit-head"}
    WEIGHTS="random weights (scripts/gpu_models.py, size ${GPU_CHECK_SIZE:-7b}): step costs and exactness, not acceptance"
else
    WEIGHTS="the model's own weights"
fi
METHODS=ar,pld,anpd,anpd/tree=8
SAMPLED=ar
PEERS=hf-ar,hf-pld
SAMPLED_PEERS=hf-ar
DRAFT_FLAGS=()    # the greedy bench's: eesd's head and sps's draft model
SAMPLED_FLAGS=()  # the sampled bench's (no eesd there): sps and mtad draft with one of them
HEAD_FLAGS=()
if [ -n "${EXIT_HEAD:-}" ]; then
    METHODS="$METHODS,eesd"
    HEAD_FLAGS=(--exit-head "$EXIT_HEAD")
    DRAFT_FLAGS+=("${HEAD_FLAGS[@]}")
fi
if [ -n "${DRAFT_MODEL:-}" ]; then
    METHODS="$METHODS,sps,sps/constant:4"
    SAMPLED="$SAMPLED,sps,mtad,mtad/tau=0.1"
    PEERS="$PEERS,hf-assisted"
    SAMPLED_PEERS="$SAMPLED_PEERS,hf-assisted"
    DRAFT_FLAGS+=(--draft-model "$DRAFT_MODEL")
    SAMPLED_FLAGS=(--draft-model "$DRAFT_MODEL")
elif [ -n "${EXIT_HEAD:-}" ]; then  # sps and mtad draft with the exit head
    METHODS="$METHODS,sps"
    SAMPLED="$SAMPLED,sps,mtad,mtad/tau=0.1"
    SAMPLED_FLAGS=("${HEAD_FLAGS[@]}")
fi
COMPILE_FLAGS=()
if [ "${GPU_CHECK_COMPILE:-0}" = 1 ]; then
    COMPILE_FLAGS=(--compile)
fi

echo "== forward costs on $MODEL"
set +e
"$PYTHON" -m verispec.cli profile --model "$MODEL" --device cuda ${COMPILE_FLAGS[@]+"${COMPILE_FLAGS[@]}"} \
    ${HEAD_FLAGS[@]+"${HEAD_FLAGS[@]}"} --widths 2,4,8,16,32 --sequences '' --prefill 0 2>&1 | tee "$OUT/profile.txt"
PROFILE_STATUS=${PIPESTATUS[0]}

echo "== benchmark on $MODEL: greedy"
"$PYTHON" -m verispec.cli bench --model "$MODEL" --device cuda ${COMPILE_FLAGS[@]+"${COMPILE_FLAGS[@]}"} \
    ${DRAFT_FLAGS[@]+"${DRAFT_FLAGS[@]}"} --methods "$METHODS" --peers "$PEERS" --dataset builtin \
    --max-new-tokens "$TOKENS" --seed 0 --no-progress --out "$OUT/bench" 2>&1 | tee "$OUT/bench.txt"
BENCH_STATUS=${PIPESTATUS[0]}

echo "== benchmark on $MODEL: sampled"
"$PYTHON" -m verispec.cli bench --model "$MODEL" --device cuda ${COMPILE_FLAGS[@]+"${COMPILE_FLAGS[@]}"} \
    ${SAMPLED_FLAGS[@]+"${SAMPLED_FLAGS[@]}"} --methods "$SAMPLED" --peers "$SAMPLED_PEERS" --dataset builtin \
    --temperature 1 --top-k 10 --top-p 0.9 --max-new-tokens "$TOKENS" --seed 0 --no-progress \
    --out "$OUT/bench-sampled" 2>&1 | tee "$OUT/bench-sampled.txt"
SAMPLED_STATUS=${PIPESTATUS[0]}
set -e

section() {  # a benchmark's report, or the tail of its log
    if [ -f "$1/report.md" ]; then
        cat "$1/report.md"
    else
        echo '```'
        tail -n 25 "$2"
        echo '```'
    fi
}

{
    echo "# verispec GPU check"
    echo
    echo "- date: $(date -Iseconds)"
    echo "- model: $MODEL ($WEIGHTS)"
    echo "- draft model: ${DRAFT_MODEL:-none}; exit head: ${EXIT_HEAD:-none}"
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
    echo "## Forward costs (exit status $PROFILE_STATUS)"
    echo
    echo '```'
    tail -n 30 "$OUT/profile.txt"
    echo '```'
    echo
    echo "## Greedy benchmark (exit status $BENCH_STATUS)"
    echo
    section "$OUT/bench" "$OUT/bench.txt"
    echo
    echo "## Sampled benchmark (exit status $SAMPLED_STATUS)"
    echo
    section "$OUT/bench-sampled" "$OUT/bench-sampled.txt"
} > "$REPORT"

echo "report: $REPORT"
[ "$TESTS_STATUS" = 0 ] && [ "$PROFILE_STATUS" = 0 ] && [ "$BENCH_STATUS" = 0 ] && [ "$SAMPLED_STATUS" = 0 ]
