#!/usr/bin/env bash
# The benchmark command: sets up the environment if needed, then runs the suite and writes
# results/bench/report.md. Options go to the suite, e.g. --quick, --models gcn,sage, --minutes 25.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh" | tail -n 1)"
cd "$root"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" exec "$py" -m scripts.benchmark "$@"
