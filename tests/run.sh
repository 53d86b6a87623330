#!/usr/bin/env bash
# The test command of the README. Run it inside the project's venv (see README "Install").
#  - starts a throwaway single-node Slurm (root + apt needed) so the Slurm tests run; skipped otherwise
#  - runs the whole pytest suite, slow end-to-end runs included
#  - fails when pytest collected no tests (its exit code 5)
set -uo pipefail
cd "$(dirname "$0")/.."

python -c "import relax_launch, relax_core" 2>/dev/null || {
  echo "relax is not installed in this Python; follow the README's install line first" >&2; exit 2; }

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -x tests/slurm/start_cluster.sh ]; then
  if exports=$(bash tests/slurm/start_cluster.sh 2> /tmp/relax-slurm-start.log); then
    eval "$exports"
    echo "Slurm up (SLURM_CONF=${SLURM_CONF:-unset})"
  else
    echo "Slurm did not start; Slurm tests will skip (log: /tmp/relax-slurm-start.log)"
    tail -5 /tmp/relax-slurm-start.log
  fi
fi

python -m pytest -q "$@"
rc=$?
if [ "$rc" = 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
