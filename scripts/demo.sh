#!/usr/bin/env bash
# The demo command of README.md: sets up the environment if needed, then optimizes a 2-layer GCN on Cora.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh" | tail -n 1)"
cd "$root"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" exec "$py" -m scripts.demo "$@"
