#!/usr/bin/env bash
# Every GPU check in one command, sized for one lease of a device machine (well under 10 minutes):
#
#   bash scripts/gpu_check.sh --prepare   # here, where pip reaches PyPI: .gpu_wheels/ (carry it along)
#   bash scripts/gpu_suite.sh             # on the GPU machine (CUDA, Python 3.12, torch, transformers)
#   bash scripts/gpu_suite.sh tests memory  # some parts only: tests, gpu_check, memory, packing
#
# 1. the GPU tests: CUDA placement and bf16 (tests/fsdp/test_fsdp_gpu.py), megatron on the GPU
#    (tests/megatron/test_megatron_gpu.py), and the torch backend, torch engine, chunked log-probs, packing
#    and LoRA tests, which pick the GPU on a machine that has one;
# 2. scripts/gpu_check.sh: the 0.5B bf16 GRPO run through `python -m relax_launch cluster=in_process`,
#    NCCL, with the doctor's prediction beside the measured peak;
# 3. benchmarks/memory.py --device cuda: the doctor against max_memory_allocated per role;
# 4. benchmarks/packing.py --device cuda: packed vs padded micro-batches, chunked vs plain log-probs.
#
# Each part has its own time limit and its own log; a failing part does not stop the next. Everything lands
# in one archive, $OUT/gpu_suite.tar.gz (the device tool brings back at most 8 files), and a summary is
# printed last. The checkout runs uninstalled: conf/ is linked as relax_launch/conf for the run's length.
# GPU_SUITE_TESTS: the test files (default: those below); GPU_SUITE_MEMORY_POINTS: benchmarks/memory.py's
# --points (default: its GPU_POINTS).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-/tmp/relax_gpu_suite_out}
WORK=$(mktemp -d /tmp/relax_gpu_suite.XXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

[[ -d .gpu_wheels ]] || { echo "no .gpu_wheels/: run 'bash scripts/gpu_check.sh --prepare' first" >&2; exit 2; }
SITE=$WORK/site
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" .gpu_wheels/*.whl ||
    { echo "could not install .gpu_wheels" >&2; exit 2; }
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
linked=0
if [[ ! -e relax_launch/conf ]]; then
    ln -s ../conf relax_launch/conf && linked=1
fi
trap '((linked)) && rm -f relax_launch/conf' EXIT

PARTS=${*:-tests gpu_check memory packing}
part() { # name, time limit in seconds, command...
    local name=$1 limit=$2 start status
    shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    start=$(date +%s)
    echo "== $name (limit ${limit} s)"
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    status=$?
    echo "== $name: exit $status after $(($(date +%s) - start)) s" | tee -a "$WORK/summary.log"
}

{
    nvidia-smi -L 2>&1
    "$PY" -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")'
} | tee "$WORK/summary.log"

TESTS=${GPU_SUITE_TESTS:-tests/fsdp/test_fsdp_gpu.py tests/megatron/test_megatron_gpu.py \
tests/core/test_torch_backend.py tests/core/test_engine.py tests/algorithms/test_logprobs_chunked.py \
tests/core/test_packing.py tests/core/test_lora.py}
# shellcheck disable=SC2086  # a list of paths
part tests "${GPU_SUITE_TESTS_S:-140}" "$PY" -m pytest -q -p no:cacheprovider -o timeout=120 $TESTS
part gpu_check "${GPU_SUITE_CHECK_S:-140}" env OUT="$WORK/gpu_check" GPU_CHECK_TIMEOUT_S=130 \
    bash -c 'mkdir -p "$OUT" && bash scripts/gpu_check.sh'
part memory "${GPU_SUITE_MEMORY_S:-190}" "$PY" benchmarks/memory.py --device cuda \
    ${GPU_SUITE_MEMORY_POINTS:+--points "$GPU_SUITE_MEMORY_POINTS"}
part packing "${GPU_SUITE_PACKING_S:-80}" "$PY" benchmarks/packing.py --device cuda

tar -czf "$OUT/gpu_suite.tar.gz" -C "$WORK" --exclude site .
echo "== summary"
cat "$WORK/summary.log"
[[ -f $WORK/tests.log ]] && tail -n 25 "$WORK/tests.log"
[[ -f $WORK/gpu_check.log ]] && tail -n 1 "$WORK/gpu_check.log"
for log in "$WORK/memory.log" "$WORK/packing.log"; do
    [[ -f $log ]] && grep '^{' "$log" && tail -n 5 "$log" | grep -v '^{'
done
exit 0
