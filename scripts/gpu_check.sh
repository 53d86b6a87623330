#!/usr/bin/env bash
# The GPU check (issue 41): a short bf16 GRPO run of a 0.5B random-init Qwen3 on one GPU, in one process
# (cluster=in_process: torch engine, torch trainer as one FSDP2 rank over NCCL), ending in one JSON line with
# s/step, tokens/s and torch.cuda.max_memory_allocated ("ok": false and exit status 1 when it breaks).
#
#   bash scripts/gpu_check.sh --prepare       # here, where pip reaches PyPI: the wheels the run needs
#   bash scripts/gpu_check.sh [overrides]     # on the GPU machine: no network, no Ray/Hydra/MLflow/vLLM
#
# The GPU machine has CUDA, Python 3.12, torch and transformers only. --prepare puts the pure-Python wheels
# the in-process run needs beyond those (Hydra, OmegaConf, ANTLR's runtime; < 1 MB) into .gpu_wheels/
# (git-ignored): carry it along with the checkout (the device tool: carry [".gpu_wheels"]). The run unpacks
# them into a folder on PYTHONPATH and runs scripts/gpu_check.py (its docstring lists the settings) under a
# hard timeout (GPU_CHECK_TIMEOUT_S, 360 s). GPU_CHECK_DEVICE=cpu runs the same path on the CPU with a
# 2-layer model; PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=.gpu_wheels
# what `python -m relax_launch cluster=in_process logger=jsonl` imports beyond torch + transformers (and
# their dependencies); the versions this repository's CPU venv runs
PURE=(hydra-core==1.3.8 omegaconf==2.3.1)
ANTLR=antlr4-python3-runtime==4.9.3 # OmegaConf's pin; on PyPI as an sdist only: built into a wheel here
# megatron-core for the GPU tests of the megatron backend (scripts/gpu_suite.sh): a CPython 3.12 build
MEGATRON=megatron-core==0.16.1

if [[ ${1:-} == --prepare ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
        --abi none --platform any -d "$WHEELS" "${PURE[@]}"
    "$PY" -m pip wheel --quiet --no-deps -w "$WHEELS" "$ANTLR"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$WHEELS" "$MEGATRON"
    for wheel in "$WHEELS"/*; do
        # pure Python or CPython 3.12 on x86-64 only: it must install on the GPU machine's Python 3.12
        [[ $wheel == *-py3-none-any.whl || $wheel == *-cp312-cp312-*x86_64*.whl ]] ||
            { echo "not a wheel for the GPU machine's Python 3.12: $wheel" >&2; exit 1; }
    done
    size_kb=$(du -sk "$WHEELS" | cut -f1)
    ((size_kb < 64 * 1024)) || { echo "$WHEELS is ${size_kb} KiB: over the 64 MiB a device run carries" >&2; exit 1; }
    ls "$WHEELS"
    echo "prepared $WHEELS (${size_kb} KiB); run on the GPU machine: bash scripts/gpu_check.sh"
    exit 0
fi

[[ -d $WHEELS ]] || { echo "no $WHEELS/: run 'bash scripts/gpu_check.sh --prepare' first (needs PyPI)" >&2; exit 2; }
SITE=${GPU_CHECK_SITE:-/tmp/relax_gpu_check/site}
rm -rf "$SITE" && mkdir -p "$SITE"
if ! "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
    # no pip there: a pure-Python wheel unpacked onto the path is installed as far as imports go
    for wheel in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE"; done
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# well under the 8 minutes a bare machine is given; the helper prints the JSON line when the run ends
status=0
timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-360}" "$PY" scripts/gpu_check.py "$@" || status=$?
if ((status == 124 || status == 137)); then
    echo "{\"ok\": false, \"error\": \"timed out after ${GPU_CHECK_TIMEOUT_S:-360} s\"}"
fi
exit "$status"
