"""The machine fingerprint that learned cost models are tied to.

Kernel times depend on the processor, on how many threads torch uses and on the kernel libraries,
so models trained under one setup are foreign under another: a model profiled with 2 threads says
nothing about 8, and a new torch or DGL release changes kernels. The fingerprint holds

    cpu_model   the ``model name`` line of /proc/cpuinfo (or the platform's processor string)
    isa         the widest vector extension the processor reports (``avx512f``, ``avx2``, ...):
                processors sold under one model name differ here (an "AMD EPYC" with AVX-512
                and one without), and so do the native kernels compiled for them
    cores       logical processors (``os.cpu_count()``)
    threads     torch's intra-op thread count
    torch, dgl, xgboost   library versions (major.minor.patch, local build tags dropped)

and its id is the first 12 hex digits of the SHA-256 of these fields as sorted JSON: the name of the
folder ``costmodels/<id>/`` holding this machine's models. Two more fields change what the models
measured, and are recorded beside them (``RECORDED``) without entering the id:

    wait_policy  ``OMP_WAIT_POLICY`` as the OpenMP runtime reads it (``passive``, ``active``, or
                 ``default`` when unset): with sleeping workers every parallel region pays a
                 wake-up of tens of microseconds, and granii's small products and kernels take
                 another path (``kernels/blas.py``, ``csrc/native.h``)
    native       the hash of the native kernels' sources that the timings depend on
                 (``kernels/sources.py``: every kernel file but those no profiled timing runs,
                 such as the index builders), or ``none`` without the kernels

Models whose fingerprint records these are foreign where they differ (``differences``); models
made before they were recorded are compared on ``FIELDS`` only.
"""
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys

FIELDS = ("cpu_model", "isa", "cores", "threads", "torch", "dgl", "xgboost")
RECORDED = ("wait_policy", "native")
ISA_ORDER = ("avx512f", "avx2", "avx", "sse4_2", "asimd", "neon")   # widest first


@functools.lru_cache(maxsize=None)   # read once a process: every granii(...) call asks
def cpu_model():
    """The processor's model string: first ``model name`` of /proc/cpuinfo, else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model"):
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=None)
def isa():
    """The first of ``ISA_ORDER`` in the processor's flags (/proc/cpuinfo ``flags`` or
    ``Features``), else the machine architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    have = set(value.split())
                    return next((x for x in ISA_ORDER if x in have), platform.machine())
    except OSError:
        pass
    return platform.machine() or "unknown"


# the distributions that install a module under another name: the locks take xgboost-cpu, the
# same library as xgboost without its CUDA build and NCCL (0.2 GB against 0.7 GB)
_DISTRIBUTIONS = {"xgboost": ("xgboost", "xgboost-cpu")}


# packages that keep their version in a file of their own, which their ``__version__`` reads
_VERSION_FILES = {"xgboost": "VERSION"}


@functools.lru_cache(maxsize=None)
def _version(package):
    """The installed version of ``package``: the imported module's ``__version__`` when it is
    imported (torch and DGL are, by the caller); else the version file the package reads its
    own from, found without importing it (importing xgboost would import scikit-learn and scipy,
    two seconds on the first call of a model); else its distribution's metadata (0.5 ms: every
    distribution on the path is scanned)."""
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None)
    if isinstance(version, str) and version:
        return version.split("+")[0]
    version = _version_file(package)
    if version:
        return version.split("+")[0]
    for distribution in _DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(distribution).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            pass
    return "missing"


def _version_file(package):
    """The first line of ``package``'s version file (``_VERSION_FILES``), or ``None``."""
    name = _VERSION_FILES.get(package)
    try:
        spec = importlib.util.find_spec(package) if name else None
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                return f.readline().strip() or None
        except OSError:
            continue
    return None


def wait_policy():
    """``OMP_WAIT_POLICY`` read as the OpenMP runtime reads it (case and surrounding spaces
    ignored); ``default`` when unset or empty."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() or "default"


def native_build():
    """The hash of the loaded native kernels' timed sources (``kernels.native.kernels_sha``), or
    ``none``."""
    from granii.kernels import native
    if not native.AVAILABLE:
        return "none"
    return native.kernels_sha(native._MODULE) or "unknown"


def machine_fingerprint(threads=None):
    """``{field: value}`` of this machine; ``threads`` defaults to torch's current thread count."""
    import torch
    return {
        "cpu_model": cpu_model(),
        "isa": isa(),
        "cores": os.cpu_count() or 1,
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        "torch": _version("torch"),
        "dgl": _version("dgl"),
        "xgboost": _version("xgboost"),
        "wait_policy": wait_policy(),
        "native": native_build(),
    }


def fingerprint_id(fp):
    """Short stable id of a fingerprint dict (only ``FIELDS`` count)."""
    canon = json.dumps({k: fp.get(k) for k in FIELDS}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:12]


def differences(have, want):
    """Readable list of the fields where fingerprint ``want`` (the models') differs from ``have``."""
    keys = FIELDS + tuple(k for k in RECORDED if k in want)
    return [f"{k}: {want.get(k)!r} in the models, {have.get(k)!r} here"
            for k in keys if have.get(k) != want.get(k)]
