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


def load():
    """The module ``granii._native`` built for the running torch; ``ImportError`` (saying which
    file was looked for) when there is none or it does not load."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    lib = path()
    if not lib.is_file():
        raise ImportError(f"no build for torch {torch.__version__} ({lib} does not exist)",
                          name=NAME, path=str(lib))
    spec = importlib.util.spec_from_file_location(NAME, lib)
    mod = importlib.util.module_from_spec(spec)       # runs the library's PyInit__native
    sys.modules[NAME] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[NAME]
        raise
    if "granii" in sys.modules:         # as an import statement would: granii._native
        sys.modules["granii"]._native = mod
    return mod


if __name__ == "__main__":      # scripts/env.sh: the file this environment's torch loads
    print(path())
