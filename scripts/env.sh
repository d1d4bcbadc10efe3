#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment from requirements.lock.
# Usage: source-free; prints the path of the venv's python on its last line.
# Two stacks, chosen by GRANII_STACK: "dgl" (the default) is requirements.lock (torch 2.1.2 + DGL)
# in .venv (or GRANII_VENV); "current" is requirements-current.lock (current torch + PyTorch
# Geometric, no DGL) in .venv-current (or GRANII_VENV_CURRENT).
# Re-runs the install only when the stack's lock or pyproject.toml changed since the last install.
# The install builds granii's native kernels (setup.py: every granii/kernels/csrc/*.cpp into
# granii._native, in place, in granii/_native_builds/torch-<version>/: one build per torch);
# when a file of csrc/ or setup.py changed since that build, or the library is missing where a
# compiler exists, only the extension is rebuilt (incrementally, with ninja, in build/). Without a
# compiler the install still succeeds and granii uses its other kernels.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${GRANII_STACK:-dgl}" in
  dgl) lock="$root/requirements.lock"; venv="${GRANII_VENV:-$root/.venv}" ;;
  current) lock="$root/requirements-current.lock"; venv="${GRANII_VENV_CURRENT:-$root/.venv-current}" ;;
  *) echo "granii: GRANII_STACK is 'dgl' (the default) or 'current', not '$GRANII_STACK'" >&2; exit 2 ;;
esac
stamp="$venv/.granii-lock.sha"
native_stamp="$venv/.granii-native.sha"
want="$(cat "$lock" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
native_want="$( (cd "$root" && ls granii/kernels/csrc/*.cpp granii/kernels/csrc/*.h setup.py 2>/dev/null \
  | LC_ALL=C sort | xargs cat) | sha256sum | cut -d' ' -f1)"
# ninja (from the lock) must be on PATH for torch's extension builder
export PATH="$venv/bin:$PATH"
# one setup of a venv at a time (scripts/test.sh runs both stacks, engineers run it side by side)
mkdir -p "$venv"
exec 9>"$venv/.granii-setup.lock"
flock 9

# the build this venv's torch loads (granii/kernels/extension.py run by its path: no granii import)
native_lib() { "$venv/bin/python" "$root/granii/kernels/extension.py"; }

native_status() {
  if "$venv/bin/python" -c "import runpy, sys; runpy.run_path(sys.argv[1])['load']()" \
       "$root/granii/kernels/extension.py" >/dev/null 2>&1; then
    echo "granii: native kernels built ($(native_lib))" >&2
  else
    echo "granii: native kernels NOT available (no C++ compiler, or the build failed: see" \
         "'cd $root && $venv/bin/python setup.py build_ext --inplace'); granii uses its DGL/torch kernels" >&2
  fi
}

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "granii: setting up $venv from $(basename "$lock") (first time: about 3-5 minutes)..." >&2
  # The lock holds torch's CUDA build (about 5 GB installed): no wheel cache, so the disk holds one
  # copy, and the large wheels one pip call each, since pip keeps every wheel it downloaded until it
  # exits (all at once: 3 GB more at the peak)
  free_kb="$(df -Pk "$(dirname "$venv")" | awk 'NR==2 {print $4}')"
  if [ "${free_kb:-0}" -lt 6500000 ]; then
    echo "granii: only $((free_kb / 1024)) MB free beside $venv; the environment needs about 6.5 GB." \
         "Free some disk, or set GRANII_VENV (GRANII_VENV_CURRENT for the current stack) to a" \
         "directory on a larger disk, and run this again." >&2
    exit 1
  fi
  python3 -m venv "$venv"
  pip_install() { "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check "$@" >&2; }
  # an environment from an older lock may hold xgboost, whose files xgboost-cpu would overwrite
  "$venv/bin/python" -m pip uninstall -q -y xgboost >/dev/null 2>&1 || true
  for req in $(grep -E '^(torch|triton|nvidia-|cuda-)[a-z0-9-]*==' "$lock"); do
    pip_install --no-deps "$req"
  done
  pip_install -r "$lock"
  # the package without the extension, then the extension as the rebuild below makes it: ninja
  # reuses the object files of this torch's earlier build (build/<temp>/torch-<version>), where
  # pip's editable build would compile everything again in a folder of its own
  GRANII_NO_NATIVE=1 "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check --no-deps --no-build-isolation -e "$root" >&2
  (cd "$root" && "$venv/bin/python" setup.py -q build_ext --inplace >&2) || true
  echo "$want" > "$stamp"
  echo "$native_want" > "$native_stamp"
  native_status
elif [ "$(cat "$native_stamp" 2>/dev/null)" != "$native_want" ] || \
     { [ ! -f "$(native_lib)" ] && command -v "${CXX:-c++}" >/dev/null; }; then
  echo "granii: building the native kernels (granii/kernels/csrc changed)..." >&2
  (cd "$root" && "$venv/bin/python" setup.py -q build_ext --inplace >&2) || true
  echo "$native_want" > "$native_stamp"
  native_status
fi
echo "$venv/bin/python"
