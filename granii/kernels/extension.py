"""Where the native extension built for the running torch lives, and loading it.

A C++ extension is compiled against one torch's headers and libraries, and only that torch can load
it; the file name Python gives it (``_native.cpython-311-x86_64-linux-gnu.so``) names the Python
ABI, not the torch. So each torch gets its own build, in a folder named for its version::

    granii/_native_builds/torch-<torch.__version__>/_native<EXT_SUFFIX>

(``setup.py`` builds there; ``scripts/env.sh`` asks this file, run as a script, for the path), and
two environments with different torch versions use one checkout without overwriting each other's
build. ``load()`` imports that file as the module ``granii._native``.

Imports only the standard library and torch: ``setup.py`` and ``scripts/env.sh`` run this file by
its path, without importing granii.
"""
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch

NAME = "granii._native"
BUILDS = "_native_builds"
PACKAGE_DIR = Path(__file__).resolve().parent.parent       # granii/


def build_dir_name(version=None):
    """``torch-<version>``: the folder, under ``granii/_native_builds/``, of the build for torch
    ``version`` (the running torch's ``torch.__version__`` by default, local tag included: a CPU
    and a CUDA build of one version are different libraries)."""
    return f"torch-{torch.__version__ if version is None else version}"


def path(version=None):
    """The extension's file for torch ``version`` (the running one by default), present or not."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return PACKAGE_DIR / BUILDS / build_dir_name(version) / f"_native{suffix}"


class _BuildFinder:
    """Finds ``granii._native`` at ``path()``. It sits just before the path finder, so a finder
    placed first (a test's, blocking the module) is still asked first, and a library left at the
    old in-place location (``granii/_native*.so``) is never the one imported."""

    @staticmethod
    def find_spec(name, import_path=None, target=None):
        if name != NAME or not path().is_file():
            return None
        return importlib.util.spec_from_file_location(NAME, path())


def _install_finder():
    if not any(isinstance(f, _BuildFinder) for f in sys.meta_path):
        at = next((i for i, f in enumerate(sys.meta_path)
                   if f is importlib.machinery.PathFinder), len(sys.meta_path))
        sys.meta_path.insert(at, _BuildFinder())


def load():
    """The module ``granii._native`` built for the running torch, imported through the import
    system; ``ImportError`` (saying which file was looked for) when there is none or it does not
    load."""
    _install_finder()
    if NAME not in sys.modules and not path().is_file():
        raise ImportError(f"no build for torch {torch.__version__} ({path()} does not exist)",
                          name=NAME, path=str(path()))
    return importlib.import_module(NAME)


if __name__ == "__main__":      # scripts/env.sh: the file this environment's torch loads
    print(path())
