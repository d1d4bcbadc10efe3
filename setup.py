"""Build of granii's native kernels, the extension ``granii._native`` (metadata: pyproject.toml).

Every ``granii/kernels/csrc/*.cpp`` is compiled into the one extension ``granii._native``. Each
file registers its own operators when the library loads, with a fragment of the ``granii``
operator library::

    #include "native.h"                 // shared helpers: merge-path partition, checks, dispatch
    #include <torch/library.h>

    TORCH_LIBRARY_FRAGMENT(granii, m) {  // schemas: torch.ops.granii.<name>
      m.def("my_op(Tensor x, int flag=0) -> Tensor");
    }
    TORCH_LIBRARY_IMPL(granii, CPU, m) {  // the CPU kernel (a CUDA file would add its own IMPL)
      m.impl("my_op", &my_op);
    }

So a second kernel file adds ops by being dropped into ``csrc/`` (nothing to list here); the
Python side calls ``torch.ops.granii.my_op`` after ``granii.kernels.native.load()`` succeeded.
``module.cpp`` only makes the library importable as a Python module. Operator names must be
unique across files.

Built by ``pip install --no-deps --no-build-isolation -e .`` (``scripts/env.sh``): setuptools
builds the extension in place, into the folder of the torch that builds it
(``granii/_native_builds/torch-<version>/_native*.so``, ``granii/kernels/extension.py``, which
loads it): environments with different torch versions share the checkout, each with its own build
(and its own object files, in ``build/<temp>/torch-<version>``). Flags: ``-O3 -march=native``
(built on the machine that runs it) and ``-fopenmp`` so ``at::parallel_for`` runs in torch's own
OpenMP pool (libgomp.so.1 resolves to the copy torch already loaded). ``GRANII_CXXFLAGS`` appends
flags (experiments); ``GRANII_NO_NATIVE=1`` skips the build. ``scripts/env.sh`` rebuilds the
extension with ``python setup.py build_ext --inplace`` when a file of ``csrc/`` or this file
changed: ninja (in the lock) recompiles only the changed files in ``build/``. Without torch or a
compiler, or if the compilation fails, the install still succeeds: the build says why and granii
uses its other kernels.
"""
import glob
import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

CSRC = os.path.join("granii", "kernels", "csrc")
NAME = "granii._native"


def _say(msg):
    print(f"granii: {msg}", file=sys.stderr, flush=True)


def _by_path(name):
    """A module of ``granii/kernels/`` loaded by its path (importing granii would import all of
    it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        f"granii_{name}_by_path", os.path.join(here, "granii", "kernels", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _extension_paths():
    """``granii/kernels/extension.py``: where the build for the running torch goes."""
    return _by_path("extension")


def _native():
    """``(ext_modules, cmdclass)`` for the extension, or why it is not built."""
    if os.environ.get("GRANII_NO_NATIVE", "") not in ("", "0"):
        return [], {}, "GRANII_NO_NATIVE is set"
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    if not sources:
        return [], {}, f"no sources in {CSRC}"
    cxx = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(cxx) is None:
        return [], {}, f"no C++ compiler ({cxx!r} is not on PATH)"
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as e:
        return [], {}, f"torch is not importable in the build environment ({e})"

    where = _extension_paths()

    class TolerantBuild(BuildExtension):
        """torch's BuildExtension; a failed compilation is reported, not fatal. The library goes
        to the running torch's folder (``extension.path()``), the object files to a folder of
        their own per torch version."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(self.build_temp, where.build_dir_name())

        def get_ext_filename(self, fullname):
            name = super().get_ext_filename(fullname)
            if fullname.split(".")[-1] != NAME.split(".")[-1]:
                return name
            head, base = os.path.split(name)
            return os.path.join(head, where.BUILDS, where.build_dir_name(), base)

        def _get_inplace_equivalent(self, build_py, ext):
            # setuptools copies an in-place build to <package>/<file name>; keep the folder
            inplace_file, regular_file = super()._get_inplace_equivalent(build_py, ext)
            if ext.name == NAME:
                inplace_file = str(where.path())
            return inplace_file, regular_file

        def run(self):
            if self.inplace or getattr(self, "editable_mode", False):
                os.makedirs(os.path.dirname(where.path()), exist_ok=True)
            try:
                super().run()
            except Exception as e:  # noqa: BLE001 (a compiler error may be of any type)
                _say(f"native kernels NOT built ({type(e).__name__}: {e}); granii will use its "
                     f"DGL/torch kernels")

    flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-Wno-unused-parameter"]
    flags += os.environ.get("GRANII_CXXFLAGS", "").split()
    # the sources' hashes (``granii/kernels/sources.py``: all of them, and those the cost models'
    # timings depend on) go to module.cpp alone, through a generated header, so that a change in
    # one kernel file recompiles that file and module.cpp, not all of them
    gen_dir = os.path.abspath(os.path.join("build", "granii_generated"))
    os.makedirs(gen_dir, exist_ok=True)
    header = os.path.join(gen_dir, "granii_sources_sha.h")
    here = os.path.dirname(os.path.abspath(__file__))
    shas = _by_path("sources")
    text = (f"#define GRANII_SOURCES_SHA h{shas.sources_sha(here)}\n"
            f"#define GRANII_KERNELS_SHA h{shas.kernels_sha(here)}\n")
    if not os.path.isfile(header) or open(header).read() != text:
        with open(header, "w") as f:
            f.write(text)
    ext = CppExtension(
        NAME, sources,
        include_dirs=[os.path.abspath(CSRC), gen_dir],
        extra_compile_args={"cxx": flags},
        extra_link_args=["-fopenmp"],
        depends=sorted(glob.glob(os.path.join(CSRC, "*.h"))),
    )
    return [ext], {"build_ext": TolerantBuild.with_options(use_ninja=True)}, None


ext_modules, cmdclass, why_not = _native()
if why_not is not None and any(a.startswith(("build", "develop", "editable", "install", "bdist"))
                               for a in sys.argv[1:]):
    _say(f"native kernels not built: {why_not}; granii will use its DGL/torch kernels")
if not ext_modules:
    cmdclass = {"build_ext": build_ext}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
