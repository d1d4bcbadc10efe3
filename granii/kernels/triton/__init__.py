"""granii's GPU kernels, written in Triton (the compiler that ships with torch: no CUDA toolkit on
the user's machine).

On a ``CsrGraph`` (``graph.py``: CSR of ``A`` and of ``A^T`` with the edge permutations, built
once per graph):

* ``spmm``: ``act(diag(r) A_w diag(c) X + bias + R)``, per-head edge values, two schedules
  (``rows``: a program per row; ``segments``: work items of at most 64 edges, long rows split,
  for skewed degrees), backward through the transpose (``spmm_kernels.py``);
* ``sddmm_dot``, ``sddmm_add``: per-edge dot products and ``a[u] + b[v]``, multi-head
  (``sddmm_kernels.py``);
* ``edge_softmax``: over each destination's in-edges, multi-head (``softmax_kernels.py``);
* ``gat``: GAT's scores, softmax, edge weights and aggregation fused, forward and backward, with an
  online softmax (``gat_kernels.py``).

Each is a plain function over a ``torch.autograd.Function`` (``ops.py``; the kernels and their
launch wrappers in ``*_kernels.py``, the registry's calling convention in ``impls.py``). The kernels
also run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this package is imported, CPU
tensors), which is how they are tested without a GPU; see ``graph.py`` for the loop-bound rule that
keeps them within what every interpreter version runs.

``available()`` says whether Triton can be imported; the kernels are imported on first use.
"""


def available():
    """Whether Triton (3.0 or newer) can be imported here."""
    try:
        import triton
    except Exception:       # not installed, or broken by a mismatched torch
        return False
    try:
        major = int(triton.__version__.split(".")[0])
    except ValueError:
        return False
    return major >= 3


_EXPORTS = {"Csr": "graph", "CsrGraph": "graph", "spmm": "ops", "sddmm_dot": "ops",
            "sddmm_add": "ops", "edge_softmax": "ops", "gat": "ops"}


def __getattr__(name):
    # the kernels are imported on first use, so that ``available()`` works without Triton
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["available", *_EXPORTS]
