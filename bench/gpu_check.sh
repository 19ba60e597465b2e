#!/usr/bin/env bash
# GPU check: run from the repo root on an NVIDIA machine. It runs the GPU kernel tests (Triton for real,
# FlashInfer, CUDA-graph replay vs eager), then `bench/gpu_decode.py`: decode throughput per attention
# backend with and without CUDA graphs against HF `generate`, and the whole Engine on the GPU (greedy
# outputs equal across backends, a JSON-schema request, no KV left). Logs go to $OUT (default ./gpu_out):
# env.txt, pytest_gpu.log, pytest_kernels.log, gpu_decode.log, gpu_decode.json, summary.txt. Every step has a
# time limit (the whole script ends within about 8 minutes); a step that fails or times out is recorded and
# the next one still runs.
#
# Python: the first python3 whose torch sees CUDA (else ./.venv's). Missing packages come from, in order:
#   * wheels in $GPU_WHEELS (default ./.whl), installed with --no-deps into $GPU_SITE (default /tmp/site),
#     for machines without network (see /work/.library/device/README.md for how to download them);
#   * else pip from the index, into ./.venv-gpu (--system-site-packages, so torch is never replaced).
# The repo is always on PYTHONPATH, so nothing depends on an editable install.
# The model: $GPU_MODEL (default: "default", the bundled model). A folder holding only a config and a
# tokenizer is measured with random weights of its shapes (gpu_decode --random-weights), which is how a
# machine that cannot receive the 100 MB model is still measured; the JSON says so.
set -uo pipefail

REPO="$(pwd)"
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # FlashInfer JIT compiles with this many jobs
unset TRITON_INTERPRET                     # real kernels here

log() { echo "[gpu_check] $*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S LOGFILE CMD...: run with a time limit, record the exit status
step() {
    local name="$1" limit="$2" logfile="$3"
    shift 3
    local t0=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$logfile" 2>&1
    local rc=$?
    local verdict="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMEOUT after ${limit}s"; elif [ "$rc" -ne 0 ]; then verdict="FAILED rc=$rc"; fi
    log "$name: $verdict ($((SECONDS - t0))s) -> $(basename "$logfile")"
    tail -n 4 "$logfile" | sed 's/^/    /' >>"$SUMMARY"
    return 0
}

torch_sees_cuda() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

# ---- python environment ---------------------------------------------------------------------------------
PY=""
if command -v python3 >/dev/null && torch_sees_cuda python3; then
    PY=python3
elif [ -x .venv/bin/python ] && torch_sees_cuda .venv/bin/python; then
    PY=.venv/bin/python
else
    log "no python whose torch sees a CUDA device: stopping"
    exit 1
fi
WHEELS="${GPU_WHEELS:-$REPO/.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="${GPU_SITE:-/tmp/site}"
    step "install $(ls "$WHEELS"/*.whl | wc -l) carried wheels" 120 "$OUT/install.log" \
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE"
else
    [ -x .venv-gpu/bin/python ] || "$PY" -m venv --system-site-packages .venv-gpu
    PY=.venv-gpu/bin/python
    missing=()
    for mod_pkg in flashinfer:flashinfer-python pytest_timeout:pytest-timeout; do
        "$PY" -c "import ${mod_pkg%%:*}" >/dev/null 2>&1 || missing+=("${mod_pkg#*:}")
    done
    step "install radixlm's dependencies ${missing[*]}" 300 "$OUT/install.log" \
        "$PY" -m pip install --disable-pip-version-check -e ".[test]" "${missing[@]}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
log "python: $PY"

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    nvcc --version 2>&1 | tail -1
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for mod in ("triton", "flashinfer", "transformers", "llguidance", "outlines_core"):
    try:
        print(mod, importlib.import_module(mod).__version__)
    except Exception as e:  # report, do not fail
        print(mod, "unavailable:", type(e).__name__, e)
EOF
} >"$OUT/env.txt" 2>&1
log "env: $(tr '\n' ' ' <"$OUT/env.txt" | cut -c1-400)"

# ---- tests ----------------------------------------------------------------------------------------------
# The GPU-marked tests (FlashInfer's JIT compiles happen here, the slow part on a fresh machine) run in the
# background while the rest of tests/kernels runs the Triton kernels for real; both are correctness checks,
# so sharing the machine costs them nothing. The benchmark starts only after both have ended.
PYTEST=("$PY" -m pytest -p no:cacheprovider -rs --timeout 200)
# GPU_TESTS_K: a pytest -k selection of them (each FlashInfer dtype/head-dim pair is a JIT compile of
# about a minute on a fresh machine, so a short lease may take only the model's own pair).
step "pytest -m gpu tests/kernels ${GPU_TESTS_K:+-k '$GPU_TESTS_K'}" 240 "$OUT/pytest_gpu.log" \
    "${PYTEST[@]}" -v -m gpu ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} tests/kernels &
GPU_TESTS=$!
# (`slow`-marked kernel tests build radixlm's C++ CPU kernels: not what this machine is for)
step "pytest -m 'not gpu and not slow' tests/kernels" 120 "$OUT/pytest_kernels.log" \
    "${PYTEST[@]}" -q -m "not gpu and not slow" tests/kernels
wait "$GPU_TESTS"

# ---- decode throughput and the Engine on the GPU --------------------------------------------------------
MODEL="${GPU_MODEL:-default}"
EXTRA=()
[ -d "$MODEL" ] && ! compgen -G "$MODEL/*.safetensors" >/dev/null && EXTRA+=(--random-weights)
step "bench/gpu_decode.py ($MODEL ${EXTRA[*]})" "${GPU_DECODE_LIMIT:-200}" "$OUT/gpu_decode.log" \
    "$PY" -m bench.gpu_decode --model "$MODEL" "${EXTRA[@]}" --results-dir "$OUT" ${GPU_DECODE_ARGS:-}

log "done in ${SECONDS}s; logs in $OUT"
