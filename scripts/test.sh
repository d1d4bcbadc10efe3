#!/usr/bin/env bash
# The test command of README.md: sets up each stack's environment if needed (scripts/env.sh), then
# runs the suite on the DGL stack (requirements.lock, .venv: every test) and then on the current
# stack (requirements-current.lock, .venv-current: current torch with PyTorch Geometric, no DGL;
# the tests that need DGL are skipped there, tests/conftest.py). Arguments go to pytest, for both
# stacks. GRANII_STACK=dgl or GRANII_STACK=current runs one stack only. Fails if either suite fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
status=0
for stack in ${GRANII_STACK:-dgl current}; do
  py="$(GRANII_STACK="$stack" bash "$root/scripts/env.sh" | tail -n 1)"
  echo "granii: tests on the $stack stack ($py)" >&2
  (cd "$root" && OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$py" -m pytest -q tests "$@") || status=$?
done
exit "$status"
