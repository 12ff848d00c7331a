#!/usr/bin/env bash
# The GPU checks in one go, on a host with a CUDA GPU: install what they need, run every
# test marked `gpu` and fail if any of them is skipped (on a GPU host a skip means the GPU
# path went untested), then the benchmark get_tensor_into vs a device-to-device cudaMemcpy.
#
#   bash loadtest/gpu_check.sh               (from anywhere; it runs in the repository root)
#
# Installs: the project with the `gpu` extra (cupy-cuda12x) unless a working cupy is there
# already (a second cupy package would clash with it), pytest and pytest-timeout, and a
# CUDA torch unless the interpreter's torch sees a GPU (the default torch wheel on Linux is
# a CUDA build). Environment:
#   PYTHON          interpreter (default .venv/bin/python when present, else python3)
#   KVSTORE_WHEELS  a folder of wheels, for a host without a package registry
#   TORCH_SPEC      the torch requirement to install when needed (default: torch)
#   BENCH_ARGS      arguments of loadtest/bench_gpu.py (default: its own)
#   SKIP_INSTALL=1  use the interpreter as it is (a host prepared beforehand)
#   STRICT_GOAL=1   also fail when the benchmark misses its goal (>= 0.8x)
# Exit status: 0 all tests passed, none skipped (and the goal met, with STRICT_GOAL=1);
# 1 otherwise. The tests' log is kept in a temporary file, named at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
PIP=("$PYTHON" -m pip install -q --disable-pip-version-check)
if [ -n "${KVSTORE_WHEELS:-}" ]; then PIP+=(--no-index --find-links "$KVSTORE_WHEELS"); fi
LOG=$(mktemp -t gpu_check.XXXXXX)
export PYTHONUNBUFFERED=1

works() { "$PYTHON" -c "$1" >/dev/null 2>&1; }

echo "== host"
nvidia-smi -L || echo "nvidia-smi: not found"
"$PYTHON" --version

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    echo "== install"
    extras=""
    works "import cupy; cupy.cuda.runtime.getDeviceCount()" || extras="[gpu]"
    "${PIP[@]}" -e ".${extras}" pytest pytest-timeout
    works "import torch, sys; sys.exit(not torch.cuda.is_available())" || "${PIP[@]}" "${TORCH_SPEC:-torch}"
fi
"$PYTHON" -c "import cupy, torch; print('cupy', cupy.__version__, '| torch', torch.__version__, \
'cuda', torch.version.cuda, '| devices', cupy.cuda.runtime.getDeviceCount())" \
    || echo "cupy or a CUDA torch is not usable: the gpu tests will be skipped, and this check fail"

echo "== tests marked gpu"
mapfile -t files < <(grep -lE "mark\.gpu|@on_gpu" tests/test_*.py)
set +e
"$PYTHON" -m pytest -m gpu -rs -p no:cacheprovider "${files[@]}" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
summary=$(grep -E "^=+ .*(passed|failed|skipped|error|no tests ran).* =+$" "$LOG" | tail -n 1)
count() { grep -oE "[0-9]+ $1" <<<"$summary" | grep -oE "^[0-9]+" || echo 0; }
passed=$(count passed) skipped=$(count skipped) failed=$(count failed) errors=$(count "errors?")
echo "gpu tests: ${passed} passed, ${failed} failed, ${errors} errors, ${skipped} skipped" \
     "(pytest status ${status}; log: ${LOG})"
if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$errors" -ne 0 ]; then
    echo "gpu_check: FAILED (tests)"
    exit 1
fi
if [ "$skipped" -ne 0 ] || [ "$passed" -eq 0 ]; then
    echo "gpu_check: FAILED (${skipped} gpu tests skipped, ${passed} ran: on a GPU host every one must run)"
    exit 1
fi

echo "== benchmark"
BENCH_LOG=$(mktemp -t gpu_bench.XXXXXX)
set +e
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words
"$PYTHON" -m loadtest.bench_gpu ${BENCH_ARGS:-} 2>&1 | tee "$BENCH_LOG"
bench_status=${PIPESTATUS[0]}
set -e
if [ "$bench_status" -ne 0 ]; then
    echo "gpu_check: FAILED (benchmark)"
    exit 1
fi
if [ "${STRICT_GOAL:-0}" = 1 ] && ! grep -q ": met$" "$BENCH_LOG"; then
    echo "gpu_check: FAILED (benchmark goal missed)"
    exit 1
fi
echo "gpu_check: OK (${passed} gpu tests passed, none skipped)"
