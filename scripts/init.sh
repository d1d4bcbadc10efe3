#!/usr/bin/env bash
# The per-machine init command: sets up the environment if needed, then profiles this machine and
# trains its cost models (granii/profiling/init_machine.py, also the console command granii-init).
# Usage: bash scripts/init.sh [--quick] [...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh" | tail -n 1)"
cd "$root"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" exec "$py" -m granii.profiling.init_machine "$@"
