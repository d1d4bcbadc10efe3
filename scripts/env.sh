#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment from requirements.lock.
# Usage: source-free; prints the path of the venv's python on its last line.
# Re-runs the install only when requirements.lock or pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GRANII_VENV:-$root/.venv}"
stamp="$venv/.granii-lock.sha"
want="$(cat "$root/requirements.lock" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "granii: setting up $venv from requirements.lock (first time: about 3-5 minutes)..." >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements.lock" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
