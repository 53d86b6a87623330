#!/usr/bin/env bash
# Install SGLang (with its own CUDA torch) into a virtual environment of its own for `rollout=sglang`.
#
# sglang 0.5.23 pins torch 2.14.1 (and CUDA builds of flashinfer, torchaudio, ...), which cannot share the
# project's venv (torch 2.13), so Relax starts `python -m sglang.launch_server` with this venv's Python.
# Run it on the GPU machine. Idempotent: exits at once when the venv already has this sglang version.
#
#   bash scripts/install_sglang.sh               # into $RELAX_SGLANG_VENV (default ~/.cache/relax/sglang-0.5.23)
#   bash scripts/install_sglang.sh --dry-run     # print the commands only
#   then: python -m relax_launch rollout=sglang  # finds that venv; or rollout.sglang_python=/path/to/bin/python
# The base interpreter is $RELAX_SGLANG_BASE_PYTHON (default python3; sglang needs Python >= 3.11).
# Extra pip options (a CUDA wheel index, say) go through pip's own variables, e.g. PIP_EXTRA_INDEX_URL.
set -euo pipefail

SGLANG_VERSION=0.5.23 # relax_core/engines/sglang.py's SGLANG_VERSION names the same venv
VENV="${RELAX_SGLANG_VENV:-$HOME/.cache/relax/sglang-$SGLANG_VERSION}"
PY="$VENV/bin/python"
BASE_PYTHON="${RELAX_SGLANG_BASE_PYTHON:-python3}"
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "unknown argument: $arg (usage: $0 [--dry-run])" >&2; exit 2 ;;
  esac
done

run() {
  echo "+ $*" >&2
  [ "$DRY_RUN" = 1 ] || "$@"
}

# metadata only: importing sglang's runtime needs the GPU stack this check must not depend on
installed() {
  [ -x "$PY" ] && "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null
}

if installed; then
  echo "sglang $SGLANG_VERSION already installed in $VENV"
  exit 0
fi
echo "installing sglang $SGLANG_VERSION and its torch into $VENV (several GB, minutes)" >&2
run "$BASE_PYTHON" -m venv "$VENV"
run "$VENV/bin/pip" install -q --upgrade pip
run "$VENV/bin/pip" install -q "sglang==$SGLANG_VERSION"
[ "$DRY_RUN" = 1 ] && exit 0
# the server's entry point must resolve; a full import needs the GPU driver, which the run checks at start
installed && "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang.launch_server') is None)" ||
  { echo "sglang does not install cleanly: $PY -m pip check" >&2; exit 1; }
echo "sglang $SGLANG_VERSION ready: $PY"
