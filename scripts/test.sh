#!/usr/bin/env bash
# The test command of README.md: sets up the environment if needed, then runs the suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh" | tail -n 1)"
cd "$root"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" exec "$py" -m pytest -q tests "$@"
