"""The kernels as differentiable functions: one ``torch.autograd.Function`` per operation and the
plain functions over them (edge values in the graph's edge order, results likewise).

Forward and backward formulas are in the kernel modules' docstrings (``spmm_kernels``,
``sddmm_kernels``, ``softmax_kernels``, ``gat_kernels``); every backward runs kernels again, those
of the transpose where a sum runs over the sources (``CsrGraph.at``, built once per graph).
"""
import torch

from granii.kernels.triton.gat_kernels import edge_row_sums, gat_backward_csr, gat_forward_csr
from granii.kernels.triton.sddmm_kernels import sddmm_add_csr, sddmm_dot_csr
from granii.kernels.triton.softmax_kernels import edge_softmax_backward_csr, edge_softmax_csr
from granii.kernels.triton.spmm_kernels import choose_schedule, spmm_csr


def _rows(t, n=None):
    """``t`` of shape ``(n, ...)`` as ``(n, K)``, ``K`` the product of the rest (also when
    ``n`` is 0, where ``reshape(n, -1)`` cannot tell ``K``)."""
    width = 1
    for size in t.shape[1:]:
        width *= size
    return t.reshape(t.shape[0] if n is None else n, width)


# -- SpMM ------------------------------------------------------------------------------------------
class SpmmFn(torch.autograd.Function):
    """``Y = act(diag(r) A_w diag(c) X + bias + R)`` and its gradients in ``x``, ``w`` (CSR order),
    ``r``, ``c``, ``bias`` and ``R`` (``spmm_kernels``). ``graph``: a ``CsrGraph``."""

    @staticmethod
    def forward(ctx, x, w, r, c, bias, res, graph, relu, schedule):
        y = spmm_csr(graph.a, x, w, r, c, bias, res, relu, schedule)
        ctx.graph, ctx.relu, ctx.schedule = graph, relu, schedule
        ctx.save_for_backward(x, w, r, c, y if relu else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, r, c, y = ctx.saved_tensors
        g = ctx.graph
        p = dy.contiguous()
        if ctx.relu:
            p = torch.where(y > 0, p, torch.zeros((), dtype=p.dtype, device=p.device))
        need_x, need_w, need_r, need_c, need_b, need_res = ctx.needs_input_grad[:6]
        dx = dw = dr = dc = dbias = dres = None
        w_t = None if w is None else w.index_select(0, g.pos.long())
        sched = choose_schedule(g.at)
        if need_x or need_c:
            # A_w^T diag(r) P, then diag(c) (and dc) from it
            t = spmm_csr(g.at, p, w_t, None, r, schedule=sched)
            if need_c:
                dc = (x * t).sum(dim=1)
            if need_x:
                dx = t if c is None else t * c.reshape(-1, 1)
        if need_r:
            s = spmm_csr(g.a, x, w, None, c, schedule=ctx.schedule)
            dr = (p * s).sum(dim=1)
        if need_w:
            heads = w.shape[1]
            pv = p if r is None else p * r.reshape(-1, 1)
            xu = x if c is None else x * c.reshape(-1, 1)
            dw = sddmm_dot_csr(g.a, pv, xu, heads)
        if need_b:
            dbias = p.sum(dim=0)
        if need_res:
            dres = p
        return dx, dw, dr, dc, dbias, dres, None, None, None


def spmm(graph, x, w=None, row_scale=None, col_scale=None, bias=None, residual=None, relu=False,
         schedule="auto"):
    """``Y = act(diag(row_scale) A_w diag(col_scale) X + bias + residual)`` on a ``CsrGraph``,
    differentiable in every tensor argument.

    ``x``: ``(num_src, F)`` or ``(num_src, H, D)``; ``w``: edge values in edge order, ``(E,)`` or
    ``(E, H)`` (per head: ``x``'s columns split into ``H`` heads), or None for ``A`` itself;
    ``row_scale`` ``(num_dst,)``, ``col_scale`` ``(num_src,)``, ``bias`` ``(F,)``, ``residual``
    ``(num_dst, F)``. Returns ``(num_dst, ...)`` in ``x``'s trailing shape. ``schedule``:
    ``"rows"``, ``"segments"`` or ``"auto"`` (``choose_schedule``)."""
    shape = x.shape
    x2 = _rows(x)
    w2 = None
    if w is not None:
        w2 = graph.to_csr_order(_rows(w, graph.num_edges))
    if residual is not None:
        residual = _rows(residual, graph.num_dst)
    if bias is not None:
        bias = bias.reshape(-1)
    if schedule == "auto":
        schedule = choose_schedule(graph.a)
    y = SpmmFn.apply(x2, w2, row_scale, col_scale, bias, residual, graph, relu, schedule)
    return y.reshape(graph.num_dst, *shape[1:])


# -- SDDMM -----------------------------------------------------------------------------------------
def row_sums(csr, vals, schedule="rows"):
    """``out[v, h] = sum_{j in row v} vals[j, h]`` (``vals`` ``(nnz, H)`` in ``csr``'s order): the
    weighted SpMM of a column of ones per head."""
    heads = vals.shape[1]
    ones = torch.ones(csr.cols, heads, dtype=vals.dtype, device=vals.device)
    return spmm_csr(csr, ones, vals.contiguous(), schedule=schedule)


class SddmmDotFn(torch.autograd.Function):
    """``out[j, h] = <P[v, h], Q[u, h]>`` in ``A``'s CSR order, differentiable in ``p``, ``q``."""

    @staticmethod
    def forward(ctx, p, q, graph, heads):
        ctx.graph, ctx.heads = graph, heads
        ctx.save_for_backward(p, q)
        return sddmm_dot_csr(graph.a, p, q, heads)

    @staticmethod
    def backward(ctx, g):
        p, q = ctx.saved_tensors
        graph = ctx.graph
        g = g.contiguous()
        dp = dq = None
        if ctx.needs_input_grad[0]:
            dp = spmm_csr(graph.a, q, g, schedule=choose_schedule(graph.a))
        if ctx.needs_input_grad[1]:
            dq = spmm_csr(graph.at, p, g.index_select(0, graph.pos.long()),
                          schedule=choose_schedule(graph.at))
        return dp, dq, None, None


class SddmmAddFn(torch.autograd.Function):
    """``out[j, h] = a[u, h] + b[v, h]`` in ``A``'s CSR order, differentiable in ``a``, ``b``."""

    @staticmethod
    def forward(ctx, a, b, graph):
        ctx.graph = graph
        return sddmm_add_csr(graph.a, a, b)

    @staticmethod
    def backward(ctx, g):
        graph = ctx.graph
        g = g.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            da = row_sums(graph.at, g.index_select(0, graph.pos.long()))
        if ctx.needs_input_grad[1]:
            db = row_sums(graph.a, g)
        return da, db, None


def sddmm_dot(graph, p, q, heads=1):
    """``out[e, h] = <P[v, h], Q[u, h]>`` for each edge ``e = u -> v`` (edge order), ``(E, heads)``.
    ``p`` ``(num_dst, F)`` or ``(num_dst, H, D)``, ``q`` the same for ``num_src``."""
    out = SddmmDotFn.apply(_rows(p), _rows(q), graph, heads)
    return graph.to_edge_order(out)


def sddmm_add(graph, a, b):
    """``out[e, h] = a[u, h] + b[v, h]`` for each edge ``e = u -> v`` (edge order), ``(E, H)``.
    ``a`` ``(num_src, H)`` or ``(num_src,)``, ``b`` likewise for ``num_dst``."""
    a2, b2 = _rows(a), _rows(b)
    out = SddmmAddFn.apply(a2, b2, graph)
    out = graph.to_edge_order(out)
    return out if a.dim() > 1 else out.reshape(-1)


# -- edge softmax ---------------------------------------------------------------------------------
class EdgeSoftmaxFn(torch.autograd.Function):
    """Edge softmax in ``A``'s CSR order; saves its output for the backward."""

    @staticmethod
    def forward(ctx, s, graph):
        a = edge_softmax_csr(graph.a, s)
        ctx.graph = graph
        ctx.save_for_backward(a)
        return a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return edge_softmax_backward_csr(ctx.graph.a, a, g), None


def edge_softmax(graph, s):
    """Softmax of the edge scores ``s`` (edge order, ``(E,)`` or ``(E, H)``) over each destination's
    in-edges; same shape and order back."""
    s2 = graph.to_csr_order(_rows(s, graph.num_edges))
    a = graph.to_edge_order(EdgeSoftmaxFn.apply(s2, graph))
    return a.reshape(s.shape)


# -- GAT -------------------------------------------------------------------------------------------
class GatFn(torch.autograd.Function):
    """The fused GAT aggregation (``gat_kernels``), differentiable in ``el``, ``er``, ``feat``,
    ``w`` (CSR order) and ``bias``."""

    @staticmethod
    def forward(ctx, el, er, feat, w, bias, graph, slope):
        el, er, feat = el.contiguous(), er.contiguous(), feat.contiguous()
        w = None if w is None else w.contiguous()
        b = None if bias is None else bias.reshape(-1).contiguous()
        out, lse = gat_forward_csr(graph, el, er, feat, w, b, slope)
        ctx.graph, ctx.slope = graph, slope
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.save_for_backward(el, er, feat, w, b, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        el, er, feat, w, b, out, lse = ctx.saved_tensors
        graph = ctx.graph
        dout = dout.contiguous()
        o = out if b is None else out - b.reshape(1, *out.shape[1:])
        dsum = (dout * o).sum(dim=2).contiguous()
        need_w = w is not None and ctx.needs_input_grad[3]
        dfeat, del_, dx_edge, dw_edge = gat_backward_csr(graph, el, er, feat, w, lse, dout, dsum,
                                                         ctx.slope, need_w)
        der = edge_row_sums(graph.a, dx_edge) if ctx.needs_input_grad[1] else None
        dbias = None
        if b is not None and ctx.needs_input_grad[4]:
            dbias = dout.sum(dim=0).reshape(ctx.bias_shape)
        return del_, der, dfeat, dw_edge, dbias, None, None


def gat(graph, el, er, feat, slope=0.2, edge_weight=None, bias=None):
    """GAT's attention and aggregation (``gat_kernels``) on a ``CsrGraph``: ``el``
    ``(num_src, H[, 1])``, ``er`` ``(num_dst, H[, 1])``, ``feat`` ``(num_src, H, D)``,
    ``edge_weight`` in edge order, ``(E,)`` (one weight an edge) or ``(E, H)``, ``bias``
    ``(H, D)`` or ``(H * D,)``. Returns ``(num_dst, H, D)``."""
    heads = feat.shape[1]
    el = el.reshape(graph.num_src, heads)
    er = er.reshape(graph.num_dst, heads)
    w = None
    if edge_weight is not None:
        per_head = edge_weight.numel() != graph.num_edges or (
            edge_weight.dim() > 1 and edge_weight.shape[1] == heads and heads > 1)
        w2 = edge_weight.reshape(graph.num_edges, heads if per_head else 1)
        if w2.shape[1] == 1 and heads > 1:
            w2 = w2.expand(graph.num_edges, heads)
        w = graph.to_csr_order(w2)
    return GatFn.apply(el, er, feat, w, bias, graph, float(slope))
