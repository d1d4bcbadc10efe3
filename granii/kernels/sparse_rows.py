"""GEMM whose left operand is mostly zeros: implementation ``"native"`` of ``gemm``.

Node features are often bag-of-words (Cora: 1.3% nonzero, CiteSeer 0.9%; fewer after dropout).
For ``X`` of shape ``(n, k)`` with ``nnz`` nonzeros and ``W`` ``(k, m)``::

    Y = X W + C:     one read of X, then nnz m multiply-adds   (a dense GEMM: n k m)
    dW = X^T dY:     nnz m multiply-adds from the nonzeros the forward kept
    dX = dY W^T:     dense (torch), only when X needs a gradient
    dC = dY          (summed over rows for a bias row)

(``csrc/sparse_rows.cpp``). Whether ``X`` is mostly zeros is a property of its values, which a cost
model of shapes cannot see, so the decision is made at each call: a few rows spread over ``X`` are
counted (microseconds), and the nonzero path runs when their density is below ``LIMIT`` (6%).
Read off this machine's timings (``results/kernels/sparse_rows.md``, by
``scripts/bench_sparse_rows.py``): at 5% density a training step's products (forward and weight
gradient) run at 1.07-3.2x torch's speed at widths 8 to 256, at 10% at 0.43-1.8x; skinny
products (8-16 columns) are where torch's GEMM is least efficient. Otherwise torch's GEMM runs.
Cost models price it as ``gemm/torch`` (``costmodel.PRICED_AS``) times ``time_ratio`` of the
density the dispatcher sampled from the layer's features when it decided, plus ``SAMPLE_SECONDS``
for the sample every call takes (``select.price``): on dense features torch's GEMM wins.
The results agree with the dense product up to the order of float additions; a zero of ``X`` is
skipped, so ``0 * inf`` in ``W`` gives 0 where the dense product gives NaN.
"""
import torch

from granii.kernels import native
from granii.kernels.dense import gemm_torch
from granii.kernels.registry import register

SAMPLE_ROWS = 32
MIN_ELEMENTS = 1 << 16          # below this the count and the call cost more than they save

LIMIT = 0.06

# The per-call sample and the checks around it: 2-4 us alone, 5-10 us in a layer's call (measured
# on a 2,500 x 64 operand, 2 threads: a GCN layer's call on kept aggregated features 134 us with
# it, 124 us with torch's GEMM alone)
SAMPLE_SECONDS = 5e-6

AVAILABLE = native.AVAILABLE and hasattr(torch.ops.granii, "sparse_rows_mm")


def mostly_zero(x):
    """True when ``X`` is large, plain (2-D, contiguous, float) and a sample of its rows is
    below ``LIMIT``."""
    return sampled_density(x) is not None


def sampled_density(x):
    """The density of ``x`` in a sample of its rows, to one significant digit, when it is below
    ``LIMIT``; ``None`` otherwise or where the nonzero path never runs. The count stops early on
    dense rows, so a dense ``x`` costs one row."""
    if (not AVAILABLE or not isinstance(x, torch.Tensor) or x.dim() != 2
            or x.numel() < MIN_ELEMENTS or x.layout != torch.strided
            or x.dtype not in (torch.float32, torch.float64) or not x.is_contiguous()):
        return None
    density = torch.ops.granii.row_density(x, SAMPLE_ROWS, LIMIT)
    return float(f"{density:.1g}") if density < LIMIT else None


def density_symbol(var):
    """The size-symbol name under which the dispatcher records the density of leaf ``var``."""
    return f"density:{var}"


def is_density_symbol(name):
    """A density prices the compositions of a call but does not tell its decisions apart: it
    varies from call to call (hidden features after ReLU and dropout hover around ``LIMIT``), and
    every plan is right at every density; the sparse-rows GEMM decides its path at each call."""
    return name.startswith("density:")


def time_ratio(density):
    """Predicted time of ``gemm/native`` over ``gemm/torch`` (forward and weight gradient) when
    ``X`` has this density: ``d / LIMIT``, 1 at and above the limit, at least 0.1. A rough line
    through this machine's timings (``results/kernels/sparse_rows.md``: about 0.8 at 5%, 0.2 at
    1%, 0.1 at 0.5%); it orders compositions, the kernel itself decides at each call."""
    if density is None or density >= LIMIT:
        return 1.0
    return max(density / LIMIT, 0.1)


class _SparseRowsMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, c):
        y, indptr, indices, values = torch.ops.granii.sparse_rows_mm(x, w, c)
        ctx.save_for_backward(indptr, indices, values, w)
        ctx.k, ctx.c_shape = x.shape[1], None if c is None else c.shape
        return y

    @staticmethod
    def backward(ctx, g):
        indptr, indices, values, w = ctx.saved_tensors
        g = g.contiguous()
        dx = g @ w.t() if ctx.needs_input_grad[0] else None
        dw = (torch.ops.granii.sparse_rows_mm_wgrad(indptr, indices, values, g, ctx.k)
              if ctx.needs_input_grad[1] else None)
        dc = None
        if ctx.needs_input_grad[2]:
            dc = g if len(ctx.c_shape) == 2 else g.sum(0)
        return dx, dw, dc


def gemm_native(x, w, c=None, into=False):
    """``Y = X W`` (``+ C``) as ``gemm_torch`` (``into`` as there); reads only the nonzeros of
    ``X`` when a sample of its rows says it is mostly zeros (see the module docstring)."""
    if w.dim() == 2 and w.dtype == x.dtype and mostly_zero(x):
        n, m = x.shape[0], w.shape[1]
        if c is None or (c.dtype == x.dtype and tuple(c.shape) in ((m,), (n, m))):
            return _SparseRowsMM.apply(x, w.contiguous(),
                                       None if c is None else c.contiguous())
    return gemm_torch(x, w, c, into)


if AVAILABLE:
    register("gemm", "native")(gemm_native)
