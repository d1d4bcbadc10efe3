"""The hashes of the native kernels' sources: which build a library is, and which timings it gives.

    sources_sha(root)   every file the extension is built from (``granii/kernels/csrc/*.cpp``,
                        ``*.h`` and ``setup.py``): a library built from other sources is stale
    kernels_sha(root)   those of them the cost models' timings depend on: every file but
                        ``UNTIMED``

Both are the first 16 hex digits of the SHA-256 of each file's name and bytes (the kernel files in
name order, then ``setup.py``).
The cost models record ``kernels_sha`` (``fingerprint.native_build``), so a change to a file no
profiled timing runs (an index builder, the cost models' own tree walk) leaves the models of a
machine valid, and a change to any other (a kernel the profiler times, the shared header, the
allocator every timing runs under, the build flags in ``setup.py``) makes them foreign.

Imports only the standard library: ``setup.py`` runs this file by its path, without importing
granii.
"""
import hashlib
from pathlib import Path

CSRC = Path("granii", "kernels", "csrc")

# Files whose operators no profiled timing runs. The profiler times each primitive after a warm-up
# call that built the graph's indices, so the index builders run outside the timings (csr.cpp);
# the others hold no primitive the profiler measures: dropout's mask, the per-edge messages of
# GINE and GATv2 (priced analytically), the readout, the segment and sparse-row products (priced
# as torch's GEMM), the cost models' tree walk, and the module's import.
UNTIMED = frozenset({"bernoulli.cpp", "csr.cpp", "edge_message.cpp", "forest.cpp", "module.cpp",
                     "readout.cpp", "segment_mm.cpp", "sparse_rows.cpp"})


def source_files(root):
    """The files the extension is built from, under the checkout ``root``: the kernel files in
    name order, then ``setup.py``; empty without them (an installed wheel)."""
    root = Path(root)
    csrc = root / CSRC
    files = [p for p in csrc.glob("*") if p.suffix in (".cpp", ".h")] if csrc.is_dir() else []
    setup = root / "setup.py"
    if not files or not setup.is_file():
        return []
    return sorted(files, key=lambda p: p.name) + [setup]


def _sha(files):
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def sources_sha(root):
    """Hash of every source of the extension under ``root``, or ``None`` without them."""
    return _sha(source_files(root))


def kernels_sha(root):
    """Hash of the sources the profiled timings depend on (all but ``UNTIMED``), or ``None``."""
    return _sha([p for p in source_files(root) if p.name not in UNTIMED])
