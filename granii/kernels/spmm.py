"""Sparse-dense products ``Y = A X`` and their weighted, mean and max variants.

``torch_csr`` implementations multiply with torch CSR tensors inside custom autograd functions:
the backward ``dX = A^T dY`` uses a transpose built once per graph from ``gi.csr_out()`` and kept in
``gi.cache`` (torch's own CSR backward re-transposes ``A`` on every call), and the edge-value
gradient is the SDDMM ``dw_e = <dY[v], X[u]>`` evaluated on the sparsity pattern of ``A``.
"""
import weakref

import dgl
import torch

from granii.kernels.registry import register

_INT32_MAX = 2**31 - 1


def _structure(gi):
    """Index arrays of ``A`` and ``A^T`` for torch CSR, once per graph.

    ``(crow, col, perm)`` per matrix: ``perm[i]`` is the DGL edge id of CSR entry ``i``, so the CSR
    values of ``A_w`` are ``w[perm]``. Indices are int32 when they fit: torch's CPU CSR product
    (MKL, 32-bit indices) was measured faster with them than with int64 indices.
    """
    def make():
        small = max(gi.num_edges, gi.num_src, gi.num_dst) <= _INT32_MAX
        cast = (lambda t: t.int()) if small else (lambda t: t)
        crow, col, perm = gi.csr_in()
        crow_t, col_t, perm_t = gi.csr_out()
        return {
            "a": (cast(crow), cast(col), perm, (gi.num_dst, gi.num_src)),
            "at": (cast(crow_t), cast(col_t), perm_t, (gi.num_src, gi.num_dst)),
        }
    return gi.memo("torch_csr_index", make)


def _csr(index, values):
    crow, col, _, size = index
    return torch.sparse_csr_tensor(crow, col, values, size=size)


def unit_csr(gi, dtype=torch.float32):
    """``(A, A^T)`` as torch CSR tensors with unit values, built once per graph and dtype."""
    def make():
        st = _structure(gi)
        ones = torch.ones(gi.num_edges, dtype=dtype)
        return _csr(st["a"], ones), _csr(st["at"], ones)
    return gi.memo(("torch_csr_unit", dtype), make)


def _head_csrs(gi, which, w2):
    """One CSR matrix per head: ``A_w`` (``which="a"``) or ``A_w^T`` (``"at"``) for ``w2`` of shape ``(E, H)``."""
    index = _structure(gi)[which]
    vals = w2[index[2]].t().contiguous()
    return [_csr(index, vals[h]) for h in range(vals.shape[0])]


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
             "a": _head_csrs(gi, "a", w2), "at": None}
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


def _per_head(mats, xh):
    """``stack_h(mats[h] @ xh[h])``, without a copy for one head."""
    if len(mats) == 1:
        return (mats[0] @ xh[0]).unsqueeze(0)
    return torch.stack([m @ x for m, x in zip(mats, xh)])


class _SpMMWeighted(torch.autograd.Function):
    """Per head ``h``: ``Y_h = A_{w_h} X_h``, ``dX_h = A_{w_h}^T dY_h``, ``dw_{e,h} = <dY_h[v], X_h[u]>``.

    ``w2``: ``(E, H)``; ``xh``: ``(H, n_src, K)``; returns ``(H, n_dst, K)``. ``entry`` is the cache
    entry of a constant ``w`` (then ``w2`` needs no grad) or ``None``.
    """

    @staticmethod
    def forward(ctx, w2, xh, gi, entry):
        a = entry["a"] if entry is not None else _head_csrs(gi, "a", w2)
        ctx.save_for_backward(w2, xh if ctx.needs_input_grad[0] else None)
        ctx.gi, ctx.entry = gi, entry
        return _per_head(a, xh)

    @staticmethod
    def backward(ctx, dy):
        w2, xh = ctx.saved_tensors
        gi, entry = ctx.gi, ctx.entry
        dy = dy.contiguous()
        dw = dx = None
        if ctx.needs_input_grad[1]:
            if entry is not None:
                if entry["at"] is None:
                    entry["at"] = _head_csrs(gi, "at", w2)
                at = entry["at"]
            else:
                at = _head_csrs(gi, "at", w2)
            dx = _per_head(at, dy)
        if ctx.needs_input_grad[0]:
            pattern = unit_csr(gi, xh.dtype)[0]
            vals = torch.stack([
                torch.sparse.sampled_addmm(pattern, dy[h], xh[h].t(), beta=0.0).values()
                for h in range(xh.shape[0])], 1)
            dw = torch.empty_like(w2)
            dw[_structure(gi)["a"][2]] = vals
        return dw, dx, None, None


@register("spmm", "dgl")
def spmm_dgl(gi, x):
    """``Y = A X``: ``Y[v] = sum_{u -> v} X[u]``, shape ``(num_dst, ...)``."""
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
    return dgl.ops.u_mul_e_sum(gi.g, x, _heads_dgl(w, x))


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
    if heads == 1:
        xh = x.reshape(1, n, -1)
    else:
        if x.dim() < 2 or x.shape[1] != heads:
            raise ValueError(f"granii: {heads}-head edge values need x of shape (n, {heads}[, k]), "
                             f"got {tuple(x.shape)}")
        xh = x.reshape(n, heads, -1).transpose(0, 1).contiguous()
    entry = None if w.requires_grad else _cached_weighted(gi, w, w2)
    y = _SpMMWeighted.apply(w2, xh, gi, entry)
    if heads == 1:
        return y.reshape(gi.num_dst, *x.shape[1:])
    return y.transpose(0, 1).reshape(gi.num_dst, *x.shape[1:])


@register("spmm_mean", "dgl")
def spmm_mean_dgl(gi, x):
    """``Y = D_in^{-1} A X``: mean of ``X[u]`` over the in-neighbours ``u -> v``; 0 if none."""
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
    y = dgl.ops.copy_u_max(gi.g, x)
    empty = (gi.in_degrees() == 0).reshape(-1, *([1] * (x.dim() - 1)))
    return y.masked_fill(empty, 0)
