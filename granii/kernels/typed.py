"""Sparse moves between index spaces and typed (per-relation) GEMMs, for relational layers.

A *move* is a fixed sparse matrix ``M`` of shape ``(rows, cols)`` given by its entries
``(row_j, col_j)`` and, optionally, the index ``vid_j`` of the value each entry reads::

    Y[r, h] = sum_{j: row_j = r} val[vid_j, h] * X[col_j, h]        (val = 1 without values)

with ``X`` of shape ``(cols, H, K)`` and ``Y`` of shape ``(rows, H, K)``. Gathers (one entry per
row), scatter-adds (one entry per column) and relation-expanded SpMMs are all moves. Gradients:
``dX = M_val^T dY`` and ``dval[vid_j, h] = <dY[row_j, h], X[col_j, h]>``.

With the native extension a move is one ``granii::spmm_csr`` call on the CSR of ``M`` (the
transpose, for the backward, is built on the first backward); ``dval`` is one
``granii::sddmm_dot_csr``. Without it, an ``index_add`` on gathered rows (torch's autograd).

``segment_gemm(x, w, seglen)`` is ``Y[rows of segment r] = X[rows of segment r] W_r``: rows are
sorted by relation. With the native extension it is one ``granii::segment_mm`` call (one parallel
region for every relation, ``csrc/segment_mm.cpp``); without it one ``dgl.ops.segment_mm`` call
(a loop over relations inside the library, one GEMM each). Gradients: to ``X`` the same product
on ``W_r^T``, to ``W`` ``dW_r = X_r^T dY_r`` (``segment_weight_grad``).

Measured here (``results/kernels/segment_mm.md``, ``scripts/bench_segment_mm.py``): on the
(source, relation) pairs of the generated RGCN graphs (46 to 206 relations, k = 16 to 256) the
native product runs 1.1-15.6x faster than DGL's, and 1.0-1.2x on 8 long segments; the weight
gradient 1.2-8.3x faster than a GEMM per relation up to k = 64. On a few long segments of a wide
weight the library's GEMMs are as fast or faster (0.81-1.13x): there the loop stays.
"""
import torch

from granii.kernels import native

_INT32_MAX = 2**31 - 1


class Move:
    """The sparse matrix ``M`` of a move, with its CSR (rows sorted) built once and its
    transpose built on first use. ``vid`` is ``None`` for an unweighted move; otherwise a
    permutation of ``0..nnz-1`` (each value is read by exactly one entry)."""

    def __init__(self, row, col, rows, cols, vid=None):
        self.rows, self.cols, self.nnz = int(rows), int(cols), int(row.numel())
        self.row, self.col, self.vid = row.long(), col.long(), None if vid is None else vid.long()
        self._csr = {}

    def csr(self, transposed=False):
        """``(indptr, indices, vperm)`` of ``M`` (or ``M^T``): vperm[j] is the value index of CSR
        entry j (int64), None for an unweighted move."""
        hit = self._csr.get(transposed)
        if hit is None:
            r, c = (self.col, self.row) if transposed else (self.row, self.col)
            n = self.cols if transposed else self.rows
            order = torch.argsort(r * max(self.cols if not transposed else self.rows, 1) + c,
                                  stable=True)
            indptr = torch.zeros(n + 1, dtype=torch.long)
            indptr[1:] = torch.cumsum(torch.bincount(r, minlength=n), 0)
            small = max(self.nnz, self.rows, self.cols) <= _INT32_MAX
            cast = (lambda t: t.int().contiguous()) if small else (lambda t: t.contiguous())
            vperm = None if self.vid is None else self.vid[order].contiguous()
            hit = self._csr[transposed] = (cast(indptr), cast(c[order]), vperm,
                                           None if vperm is None else cast(vperm))
        return hit


class _MoveFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, val, m):
        indptr, indices, vperm, _ = m.csr()
        v = None if val is None else _values_in_csr_order(val, vperm)
        ctx.m = m
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, val)
        return torch.ops.granii.spmm_csr(indptr, indices, x, v)

    @staticmethod
    def backward(ctx, dy):
        x, val = ctx.saved_tensors
        m = ctx.m
        dy = dy.contiguous()
        dx = dval = None
        if ctx.needs_input_grad[0]:
            dx = _MoveFn.apply(dy, val, _Transposed.of(m))
        if ctx.needs_input_grad[1]:
            indptr, indices, _, vperm_i = m.csr()
            dval = torch.ops.granii.sddmm_dot_csr(indptr, indices, vperm_i, dy, x.contiguous())
        return dx, dval, None


def _values_in_csr_order(val, vperm):
    """``val[vperm]`` (``(nnz, H)``); with one value per entry as a flat gather (torch's
    two-dimensional ``index_select`` copies row by row: several times slower at H = 1)."""
    if val.shape[1] == 1:
        return val.reshape(-1).index_select(0, vperm).reshape(-1, 1)
    return val.index_select(0, vperm).contiguous()


class _Transposed:
    """``M^T`` as a move (its CSR is ``M``'s transposed one; value indices carried over)."""

    @staticmethod
    def of(m):
        t = getattr(m, "_t", None)
        if t is None:
            t = m._t = Move(m.col, m.row, m.cols, m.rows, m.vid)
            t._t = m
        return t


def move(m, x, val=None):
    """``Y = M_val X`` for ``x`` of shape ``(cols, H, K)`` (or ``(cols, K)``, then ``H = 1``) and
    ``val`` of shape ``(nnz, H)`` in value order; returns ``(rows, H, K)`` (or ``(rows, K)``)."""
    two = x.dim() == 2
    x3 = x.unsqueeze(1) if two else x
    if val is not None:
        val = val.reshape(m.nnz, x3.shape[1])
    if native.available() and x3.dtype in (torch.float32, torch.float64):
        y = _MoveFn.apply(x3.contiguous(), None if val is None else val.contiguous(), m)
    else:
        y = move_reference(m, x3, val)
    return y.squeeze(1) if two else y


def move_reference(m, x3, val=None):
    """The same product with torch ops (``index_add`` of gathered rows): the fallback and the
    tests' reference."""
    g = x3.index_select(0, m.col)
    if val is not None:
        g = g * val.index_select(0, m.vid).unsqueeze(-1)
    return torch.zeros(m.rows, *x3.shape[1:], dtype=x3.dtype).index_add(0, m.row, g)


def segment_gemm(x, w, seglen):
    """``Y = X W_r`` per segment of rows (rows sorted by relation ``r``; ``seglen`` ``(R,)`` int64
    on the CPU); ``x`` ``(rows, k_in)``, ``w`` ``(R, k_in, k_out)``."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[2]) + 0 * w.sum()
    return _SegmentGemm.apply(x, w, seglen)


NATIVE = native.AVAILABLE and hasattr(torch.ops.granii, "segment_mm")
NATIVE_WGRAD_WIDTH = 64 * 64      # k_in k_out up to which the native weight gradient is faster
NATIVE_WGRAD_ROWS = 2048          # mean rows per segment below which it is faster at any width
_native_wgrad = torch.ops.granii.segment_mm_wgrad if NATIVE else None


def native_wgrad_routed(rows, k_in, k_out, segments):
    """Whether ``segment_weight_grad`` runs the native kernel for float inputs of these shapes:
    narrow weights, or many short segments."""
    return NATIVE and (k_in * k_out <= NATIVE_WGRAD_WIDTH
                       or rows < NATIVE_WGRAD_ROWS * max(segments, 1))


def _segment_mm(x, w, seglen):
    if NATIVE and x.dtype in (torch.float32, torch.float64):
        return torch.ops.granii.segment_mm(x, w, seglen)
    import dgl
    return dgl.ops.segment_mm(x, w, seglen)


class _SegmentGemm(torch.autograd.Function):
    """Forward and ``dX = dY W_r^T`` by ``_segment_mm``; ``dW_r = X_r^T dY_r`` by
    ``segment_weight_grad``: DGL's own weight gradient loops over rows (measured 20x slower than
    its forward), and has no CPU kernel in some builds."""

    @staticmethod
    def forward(ctx, x, w, seglen):
        ctx.save_for_backward(x, w, seglen)
        return _segment_mm(x, w, seglen)

    @staticmethod
    def backward(ctx, dy):
        x, w, seglen = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = segment_gemm(dy, w.transpose(1, 2).contiguous(), seglen)
        if ctx.needs_input_grad[1]:
            dw = segment_weight_grad(x, dy, seglen)
        return dx, dw, None


def segment_weight_grad(x, dy, seglen):
    """``dW_r = X_r^T dY_r`` for every segment ``r`` of rows, ``(R, k_in, k_out)``: one GEMM per
    relation on views of ``X`` and ``dY`` (inside one call, as DGL's forward loops over
    relations). It keeps no index: stacking the products as one sparse move needed
    ``rows x k_in`` index entries (several GB on AM-sized graphs), and was slower. With the
    native extension, one ``granii::segment_mm_wgrad`` call where it is faster: narrow weights
    (``native_wgrad_routed``)."""
    if (x.dtype in (torch.float32, torch.float64) and x.dtype == dy.dtype
            and native_wgrad_routed(x.shape[0], x.shape[1], dy.shape[1], seglen.numel())):
        return _native_wgrad(x, dy, seglen)
    sizes = seglen.tolist()
    return torch.stack([a.t() @ b for a, b in zip(x.split(sizes), dy.split(sizes))])


def rowwise_bdd(x, w, rel, blocks):
    """Block-diagonal typed product: ``Y[i] = X[i] blockdiag(W_{rel_i})`` with ``w`` of shape
    ``(R, blocks * s_in * s_out)`` (TypedLinear's ``bdd``); one batched GEMM over rows."""
    n, k_in = x.shape
    s_in = k_in // blocks
    s_out = w.shape[1] // (blocks * s_in)
    wr = w.index_select(0, rel).view(-1, s_in, s_out)
    return torch.bmm(x.reshape(-1, 1, s_in), wr).view(n, blocks * s_out)
