#!/usr/bin/env bash
# GPU check: run from the repo root on an NVIDIA machine. Runs the GPU kernel tests (triton, flashinfer,
# CUDA-graph replay vs eager), the other kernel tests on real CUDA kernels, and a short decode throughput
# run. Logs go to $OUT (default ./gpu_out): env.txt, pytest_gpu.log, pytest_kernels.log,
# decode_throughput.log (+ its JSON when written), summary.txt. Each step has a time limit, so the whole
# script ends in under 8 minutes; a step that fails or times out is recorded and the next one still runs.
#
# Python (installs go only into ./.venv-gpu, which this script owns; an existing ./.venv is never changed):
#   1. system python3 whose torch sees CUDA -> ./.venv-gpu with --system-site-packages, missing packages
#      (triton, flashinfer-python, pytest, pytest-timeout) pip-installed there without touching torch;
#   2. else ./.venv whose torch sees CUDA -> used as it is (set GPU_CHECK_INSTALL=1 to let the script add
#      missing packages to it);
#   3. else a fresh ./.venv-gpu with `pip install -e .[triton,gpu,test]` (needs network).
# The repo is always on PYTHONPATH, so nothing depends on an editable install. Installing is best effort:
# a missing flashinfer makes its tests skip, which summary.txt shows.
set -uo pipefail

REPO="$(pwd)"
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
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
    tail -n 3 "$logfile" | sed 's/^/    /' >>"$SUMMARY"
    return 0
}

torch_sees_cuda() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

# ---- python environment ---------------------------------------------------------------------------------
PY="" INSTALL_MISSING=0
if command -v python3 >/dev/null && torch_sees_cuda python3; then
    [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu
    PY=.venv-gpu/bin/python INSTALL_MISSING=1
elif [ -x .venv/bin/python ] && torch_sees_cuda .venv/bin/python; then
    PY=.venv/bin/python INSTALL_MISSING="${GPU_CHECK_INSTALL:-0}"
else
    [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu
    PY=.venv-gpu/bin/python
fi
log "python: $PY"

PIP=("$PY" -m pip install --disable-pip-version-check --retries 0 --timeout 15)
if ! torch_sees_cuda "$PY"; then
    step "install .[triton,gpu,test]" 90 "$OUT/install.log" "${PIP[@]}" -e ".[triton,gpu,test]"
elif [ "$INSTALL_MISSING" = 1 ]; then
    # torch is there: add only what is missing, in one pip call, never letting pip replace torch
    missing=()
    for mod_pkg in triton:triton flashinfer:flashinfer-python pytest:pytest pytest_timeout:pytest-timeout; do
        "$PY" -c "import ${mod_pkg%%:*}" >/dev/null 2>&1 || missing+=("${mod_pkg#*:}")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        step "install ${missing[*]}" 90 "$OUT/install.log" "${PIP[@]}" "${missing[@]}"
    fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # works even when the editable install failed

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for mod in ("triton", "flashinfer"):
    try:
        print(mod, importlib.import_module(mod).__version__)
    except Exception as e:  # report, do not fail
        print(mod, "unavailable:", type(e).__name__, e)
EOF
} >"$OUT/env.txt" 2>&1
log "env: $(tr '\n' ' ' <"$OUT/env.txt" | cut -c1-300)"

if ! torch_sees_cuda "$PY"; then
    log "torch in $PY does not see a CUDA device: stopping"
    exit 1
fi

# ---- tests ----------------------------------------------------------------------------------------------
# GPU-marked tests first (backends agree in fp16/bf16, graph replay == eager; FlashInfer JIT compiles here),
# then the rest of tests/kernels, which on this machine runs the Triton kernels for real.
PYTEST=("$PY" -m pytest -p no:cacheprovider -rs)
"$PY" -c "import pytest_timeout" >/dev/null 2>&1 && PYTEST+=(--timeout 180)
step "pytest -m gpu tests/kernels" 210 "$OUT/pytest_gpu.log" "${PYTEST[@]}" -v -m gpu tests/kernels
step "pytest -m 'not gpu' tests/kernels" 50 "$OUT/pytest_kernels.log" "${PYTEST[@]}" -q -m "not gpu" tests/kernels

# ---- decode throughput ----------------------------------------------------------------------------------
if [ -f bench/decode_throughput.py ]; then
    step "bench/decode_throughput.py" 90 "$OUT/decode_throughput.log" \
        "$PY" -m bench.decode_throughput --device cuda --attention-backend flashinfer --batch-sizes 1,8,32 --quick
    [ -f bench/results/decode_throughput.json ] && cp bench/results/decode_throughput.json "$OUT/"
else
    log "bench/decode_throughput.py not present: skipped"
fi

log "done in ${SECONDS}s; logs in $OUT"
