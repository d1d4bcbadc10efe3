"""Sparse-dense products ``Y = A X`` and their weighted, mean and max variants.

``torch_csr`` implementations multiply with torch CSR tensors inside custom autograd functions:
the backward ``dX = A^T dY`` uses a transpose built once per graph from ``gi.csr_out()`` and kept in
``gi.cache`` (torch's own CSR backward re-transposes ``A`` on every call), and the edge-value
gradient is the SDDMM ``dw_e = <dY[v], X[u]>`` by gathers in edge order.
"""
import sys
import warnings
import weakref

import torch

from granii.kernels.registry import register

# torch says once per process that its CSR tensors are in beta; granii builds them for its own
# kernels (the ``torch_csr`` implementations), not the user
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta",
                        category=UserWarning)

_INT32_MAX = 2**31 - 1


def _structure(gi):
    """Index arrays of ``A`` and ``A^T`` for torch CSR, once per graph.

    ``(crow, col, perm)`` per matrix: ``perm[i]`` is the DGL edge id of CSR entry ``i``, so the CSR
    values of ``A_w`` are ``w[perm]``. Indices are int32 when they fit: torch's CPU CSR product
    (MKL, 32-bit indices) was measured faster with them than with int64 indices.
    """
    def make():
        small = max(gi.num_edges, gi.num_src, gi.num_dst) <= _INT32_MAX
        native = sys.modules.get("granii.kernels.native")
        if small and native is not None and native.available() and not gi.gpu:
            return _from_native(gi, native)
        cast = (lambda t: t.int()) if small else (lambda t: t)
        crow, col, perm = gi.csr_in()
        crow_t, col_t, perm_t = gi.csr_out()
        return {
            "a": (cast(crow), cast(col), perm, (gi.num_dst, gi.num_src)),
            "at": (cast(crow_t), cast(col_t), perm_t, (gi.num_src, gi.num_dst)),
        }
    return gi.memo("torch_csr_index", make)


def _from_native(gi, native):
    """``_structure`` read from the native kernels' index of the graph (``native.csr_index``),
    which a new graph object builds in one counting sort over its edge list and the native plans
    share: DGL's out-edge index and the casts cost a new batch several times that."""
    out = {}
    for which, size in (("a", (gi.num_dst, gi.num_src)), ("at", (gi.num_src, gi.num_dst))):
        idx = native.csr_index(gi, which)
        perm = torch.arange(gi.num_edges) if idx.eids is None else idx.eids.long()
        out[which] = (idx.indptr.int(), idx.indices.int(), perm, size)
    return out


def _csr(index, values):
    crow, col, _, size = index
    return csr_tensor(crow, col, values, size)


def csr_tensor(crow, col, values, size):
    """``torch.sparse_csr_tensor`` of an index granii built (a valid CSR), its invariants not
    checked, and said so: torch (2.11 on) warns where that is left implicit."""
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        return torch.sparse_csr_tensor(crow, col, values, size=size)


def unit_csr(gi, dtype=torch.float32):
    """``(A, A^T)`` as torch CSR tensors with unit values, built once per graph and dtype."""
    def make():
        st = _structure(gi)
        ones = torch.ones(gi.num_edges, dtype=dtype, device=st["a"][0].device)
        return _csr(st["a"], ones), _csr(st["at"], ones)
    return gi.memo(("torch_csr_unit", dtype), make)


def _head_index(gi, which, heads):
    """CSR indices of ``M`` = ``A`` or ``A^T`` with ``heads`` values per edge, interleaved: row
    ``v H + h`` holds head ``h`` of row ``v``, column ``u H + h`` head ``h`` of column ``u``. Then
    ``X`` of shape ``(n, H, K)`` is the ``(n H, K)`` operand as it lies in memory, and every head
    is one CSR product, with no transposed copies. Once per graph and number of heads.

    Returns ``(crow, col, flat, size)``: ``flat[j]`` is the index into the ``(E, H)`` edge values
    (DGL edge order, flattened) of CSR entry ``j``.
    """
    def make():
        crow, col, perm, (rows, cols) = _structure(gi)[which]
        crow, col, e = crow.long(), col.long(), col.shape[0]
        deg = crow[1:] - crow[:-1]
        dev = crow.device
        row = torch.repeat_interleave(torch.arange(rows, device=dev), deg)
        h = torch.arange(heads, device=dev).reshape(-1, 1)
        pos = (crow[row] * (heads - 1) + torch.arange(e, device=dev)) + h * deg[row]
        col_h = torch.empty(e * heads, dtype=torch.long, device=dev)
        flat = torch.empty(e * heads, dtype=torch.long, device=dev)
        col_h[pos.reshape(-1)] = (col * heads + h).reshape(-1)
        flat[pos.reshape(-1)] = (perm * heads + h).reshape(-1)
        crow_h = torch.cat([(crow[:-1] * heads + h * deg).t().reshape(-1), crow[-1:] * heads])
        small = heads * max(e, rows, cols) <= _INT32_MAX
        cast = (lambda t: t.int()) if small else (lambda t: t)
        return cast(crow_h), cast(col_h), flat, (heads * rows, heads * cols)
    return gi.memo(("torch_csr_heads", which, heads), make)


def _head_csr(gi, which, w2):
    """``A_w`` (``which="a"``) or ``A_w^T`` (``"at"``) with the ``(E, H)`` edge values ``w2``, as
    one interleaved CSR matrix (``_head_index``)."""
    index = _head_index(gi, which, w2.shape[1])
    return _csr(index, torch.index_select(w2.reshape(-1), 0, index[2]))


def _cached_weighted(gi, w, w2):
    """Per-graph cache entry ``{"a": [...], "at": [...] or None}`` of a constant weight tensor ``w``.

    Keyed by ``id(w)`` and valid while ``w`` is alive and its ``_version`` (bumped by in-place
    writes) is unchanged. Entries of tensors that no longer exist are dropped on insertion.
    """
    key = ("torch_csr_w", id(w))
    entry = gi.cache.get(key)
    if entry is not None and entry["ref"]() is w and entry["version"] == w._version \
            and entry["dtype"] == w.dtype:
        return entry
    for k in [k for k, e in gi.cache.items()
              if isinstance(k, tuple) and k[0] == "torch_csr_w" and e["ref"]() is None]:
        del gi.cache[k]
    entry = {"ref": weakref.ref(w), "version": w._version, "dtype": w.dtype,
             "a": _head_csr(gi, "a", w2), "at": None}
    gi.cache[key] = entry
    return entry


class _SpMM(torch.autograd.Function):
    """``Y = A X`` with ``dX = A^T dY``; ``A``, ``A^T`` are fixed CSR matrices."""

    @staticmethod
    def forward(ctx, x, a, at):
        ctx.at = at
        return a @ x

    @staticmethod
    def backward(ctx, dy):
        return ctx.at @ dy.contiguous(), None, None


class _SpMMWeighted(torch.autograd.Function):
    """Per head ``h``: ``Y_h = A_{w_h} X_h``, ``dX_h = A_{w_h}^T dY_h``, ``dw_{e,h} = <dY_h[v], X_h[u]>``.

    ``w2``: ``(E, H)``; ``x``: ``(n_src, H, K)``; returns ``(n_dst, H, K)``. ``entry`` is the cache
    entry of a constant ``w`` (then ``w2`` needs no grad) or ``None``. All heads run as one CSR
    product on interleaved rows (``_head_index``); ``dw`` is one SDDMM by gathers in edge
    order (any framework's graph, any device).
    """

    @staticmethod
    def forward(ctx, w2, x, gi, entry):
        a = entry["a"] if entry is not None else _head_csr(gi, "a", w2)
        ctx.save_for_backward(w2, x if ctx.needs_input_grad[0] else None)
        ctx.gi, ctx.entry = gi, entry
        n, heads, k = x.shape
        return (a @ x.reshape(n * heads, k)).reshape(-1, heads, k)

    @staticmethod
    def backward(ctx, dy):
        w2, x = ctx.saved_tensors
        gi, entry = ctx.gi, ctx.entry
        n_dst, heads, k = dy.shape
        dy = dy.reshape(n_dst * heads, k)
        dw = dx = None
        if ctx.needs_input_grad[1]:
            if entry is not None:
                if entry["at"] is None:
                    entry["at"] = _head_csr(gi, "at", w2)
                at = entry["at"]
            else:
                at = _head_csr(gi, "at", w2)
            dx = (at @ dy).reshape(-1, heads, k)
        if ctx.needs_input_grad[0]:
            src, dst = gi.edges()
            dy = dy.reshape(n_dst, heads, k)
            dw = (dy[dst] * x[src]).sum(-1).reshape(w2.shape)
        return dw, dx, None, None


@register("spmm", "dgl")
def spmm_dgl(gi, x):
    """``Y = A X``: ``Y[v] = sum_{u -> v} X[u]``, shape ``(num_dst, ...)``."""
    import dgl
    return dgl.ops.copy_u_sum(gi.g, x)


@register("spmm", "torch_csr")
def spmm_torch_csr(gi, x):
    """``Y = A X``: ``Y[v] = sum_{u -> v} X[u]``; backward ``dX = A^T dY`` with ``A^T`` cached per graph."""
    a, at = unit_csr(gi, x.dtype)
    y = _SpMM.apply(x.reshape(x.shape[0], -1), a, at)
    return y.reshape(gi.num_dst, *x.shape[1:])


def _heads_dgl(w, x):
    """``w`` of shape ``(E, H)`` padded to ``(E, H, 1, ...)`` so it broadcasts against ``x[0]``."""
    if 2 <= w.dim() < x.dim():
        return w.reshape(*w.shape, *([1] * (x.dim() - w.dim())))
    return w


@register("spmm_weighted", "dgl")
def spmm_weighted_dgl(gi, w, x):
    """``Y = A_w X``: ``Y[v] = sum_{e = (u -> v)} w_e X[u]``.

    ``w`` of shape ``(E,)`` with ``x`` of shape ``(n, ...)``, or per head: ``w`` ``(E, H)`` or
    ``(E, H, 1)`` with ``x`` ``(n, H, K)`` giving ``(num_dst, H, K)``.
    """
    import dgl
    return dgl.ops.u_mul_e_sum(gi.g, x, _heads_dgl(w, x))


@register("spmm_heads", "dgl")
def spmm_heads_dgl(gi, w, x):
    """``Y[v, h] = sum_{e = (u -> v)} w[e, h] X[u]``: ``w`` ``(E, H)`` or ``(E, H, 1)``, ``x``
    ``(n_src, K)`` shared by the heads, ``Y`` ``(num_dst, H, K)``: DGL's broadcasting
    ``u_mul_e_sum`` of ``X`` as ``(n, 1, K)`` with ``w`` as ``(E, H, 1)``."""
    import dgl
    heads = w.shape[1] if w.dim() > 1 else 1
    return dgl.ops.u_mul_e_sum(gi.g, x.reshape(x.shape[0], 1, -1),
                               w.reshape(gi.num_edges, heads, 1))


@register("spmm_weighted", "torch_csr")
def spmm_weighted_torch_csr(gi, w, x):
    """``Y = A_w X``: ``Y[v] = sum_{e = (u -> v)} w_e X[u]``, shapes as in ``spmm_weighted_dgl``.

    Backward: ``dX = A_w^T dY`` and ``dw_e = <dY[v], X[u]>`` (an SDDMM on the pattern of ``A``),
    one CSR product per head. A ``w`` that does not require grad is taken as constant: its CSR
    matrices are cached per graph and reused while the same tensor object is passed unchanged.
    """
    n, e = x.shape[0], gi.num_edges
    heads = w.numel() // e if e else 1
    w2 = w.reshape(e, heads)
    if heads > 1 and (x.dim() < 2 or x.shape[1] != heads):
        raise ValueError(f"granii: {heads}-head edge values need x of shape (n, {heads}[, k]), "
                         f"got {tuple(x.shape)}")
    constant = not w.requires_grad and not w.is_inference()    # inference tensors: no version
    entry = _cached_weighted(gi, w, w2) if constant else None
    y = _SpMMWeighted.apply(w2, x.reshape(n, heads, -1).contiguous(), gi, entry)
    return y.reshape(gi.num_dst, *x.shape[1:])


@register("spmm_mean", "dgl")
def spmm_mean_dgl(gi, x):
    """``Y = D_in^{-1} A X``: mean of ``X[u]`` over the in-neighbours ``u -> v``; 0 if none."""
    import dgl
    return dgl.ops.copy_u_mean(gi.g, x)


@register("spmm_mean", "torch_csr")
def spmm_mean_torch_csr(gi, x):
    """``Y = D_in^{-1} A X`` with ``D_in`` clamped to 1, so zero-in-degree rows are 0."""
    deg = gi.in_degrees().to(x.dtype).clamp(min=1)
    y = spmm_torch_csr(gi, x)
    return y / deg.reshape(-1, *([1] * (x.dim() - 1)))


@register("spmm_max", "dgl")
def spmm_max_dgl(gi, x):
    """``Y[v] = max_{u -> v} X[u]`` elementwise; 0 if ``v`` has no in-edges. Gradient to the argmax.

    ``dgl.ops.copy_u_max`` leaves ``-inf`` in rows without in-edges (and routes their gradient to
    node 0); masking those rows gives the zeros of ``update_all(copy_u, max)`` and a zero gradient.
    """
    import dgl
    y = dgl.ops.copy_u_max(gi.g, x)
    empty = (gi.in_degrees() == 0).reshape(-1, *([1] * (x.dim() - 1)))
    return y.masked_fill(empty, 0)
