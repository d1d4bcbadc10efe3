"""GAT's attention fused with its aggregation (primitive ``gat_aggregate``), and native SDDMM-add
and edge-softmax kernels (implementation ``"native"`` of ``sddmm_add`` and ``edge_softmax``).

``gat_aggregate(gi, el, er, feat, slope, edge_weight=None, bias=None)``, per destination ``v`` and
head ``h``::

    x_e = el[u, h] + er[v, h]                      for each in-edge e = (u -> v)
    a_e = exp(lrelu(x_e)) / sum_{e' -> v} exp(lrelu(x_e'))      (lrelu: leaky ReLU, ``slope``)
    out[v, h, :] = sum_{e -> v} a_e * w_e * feat[u, h, :]  [+ bias[h, :]]
                                                   (w_e = 1 without edge weights)

which is DGL's ``GATConv`` after its projections: ``u_add_v``, ``leaky_relu``, ``edge_softmax``,
the product with ``edge_weight`` and ``u_mul_e_sum`` [, GATConv's bias]. Rows without in-edges
give 0 (the bias, with one).
Shapes: ``el`` ``(num_src, H[, 1])``, ``er`` ``(num_dst, H[, 1])``, ``feat`` ``(num_src, H, F)``,
``edge_weight`` ``(E,)`` (or ``(E, 1[, 1])``) in DGL edge-id order, or ``(E, H)``: one weight per
edge and head (``w_eh`` in place of ``w_e``); out ``(num_dst, H, F)``.

The native kernel makes one pass over the in-edges of each destination row for all heads: the
scores stay in a per-row scratch buffer, never in an edge x head tensor. The backward keeps each
row's max and ``1 / sum`` (``num_dst x H``) and the output, recomputes ``a_e``, and walks the
transpose ``A^T`` (kept once per graph) so that the source-side gradients (``feat``, ``el``) are
summed per source row without races; ``D_v = <dout[v], out[v] - bias>`` gives the softmax's row term
without another pass over the edges. Because the output is saved for the backward, modifying it
in place before the backward makes autograd raise (as for ``torch.softmax``); DGL's
``u_mul_e_sum`` saves its inputs instead. Edge weights are read through the CSR's edge ids (one
scattered read per edge). The backwards are native too and not differentiable again: a second
derivative through them raises (``once_differentiable``).

Attention dropout (GATConv's ``attn_drop`` with ``p > 0`` in training) multiplies ``a`` by a mask
drawn between the softmax and the aggregation; the fused plans draw the same mask with the same
module on ones of the attention's size and pass it as per-head edge weights (``fuse.fuse_gat``).
"""
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from granii.kernels import native
from granii.kernels import softmax as _softmax
from granii.kernels import sddmm as _sddmm
from granii.kernels import spmm as _spmm
from granii.kernels.registry import register

_INT32_MAX = 2**31 - 1
_OPS = torch.ops.granii    # the operator library (csrc/gat.cpp) the kernels are called from


def available():
    """True when the compiled extension with the GAT kernels is loaded."""
    return native.available() and hasattr(_OPS, "gat_forward")


def _csr(gi, which):
    """``(indptr, indices, eids)`` of ``A`` (``"a"``, rows = destinations) or ``A^T`` (``"at"``,
    rows = sources), shared with the native SpMM kernels and built once per graph; ``eids`` is
    ``None`` when CSR entry ``j`` is edge ``j``."""
    idx = native.csr_index(gi, which)
    return idx.indptr, idx.indices, idx.eids


def _t2in(gi):
    """Position in the CSR of ``A`` of each entry of the CSR of ``A^T`` (the same edge); once per
    graph. The backward writes per-edge values in ``A``'s order through it, so their
    destination-side sums read contiguous rows."""
    return native.csr_index(gi, "at").pos


def _coo(gi):
    """``(src, dst)`` of each edge in edge-id order, int32 when every index fits; once per graph."""
    def make():
        small = max(gi.num_edges, gi.num_src, gi.num_dst) <= _INT32_MAX
        dtype = torch.int32 if small else torch.int64
        return tuple(t.to(dtype).contiguous() for t in gi.edges())
    return gi.memo("native_coo", make)


def _rows(t, n):
    """``t`` of shape ``(n, ...)`` as a contiguous ``(n, K)`` (``K``: the product of the rest; also
    when ``n`` is 0)."""
    return t.reshape(n, math.prod(t.shape[1:])).contiguous()


class _GatFused(torch.autograd.Function):
    """Fused ``gat_aggregate`` on ``(el2, er2, feat3, w)``; see the module docstring."""

    @staticmethod
    def forward(ctx, el, er, feat, w, bias, gi, slope):
        out, mx, inv = _OPS.gat_forward(*_csr(gi, "a"), el, er, feat, w, slope, bias)
        ctx.save_for_backward(el, er, feat, w, bias, mx, inv, out)
        ctx.gi, ctx.slope = gi, slope
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        el, er, feat, w, bias, mx, inv, out = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout = dout.contiguous()
        grads = _OPS.gat_backward(
            _csr(ctx.gi, "a")[0], _t2in(ctx.gi), *_csr(ctx.gi, "at"), el, er, feat, w, ctx.slope,
            mx, inv, out, dout, need[0], need[1], need[2], need[3] and w is not None, bias)
        dbias = dout.sum(0).reshape(bias.shape) if need[4] else None
        return tuple(g if n else None for g, n in zip(grads, need[:4])) + (dbias, None, None)


def _check_shapes(gi, el, er, feat, edge_weight, bias=None):
    if feat.dim() != 3 or feat.shape[0] != gi.num_src:
        raise ValueError(f"granii: feat must be (num_src={gi.num_src}, H, F), got {tuple(feat.shape)}")
    heads = feat.shape[1]
    if el.numel() != gi.num_src * heads or er.numel() != gi.num_dst * heads:
        raise ValueError(f"granii: el must hold (num_src, {heads}) and er (num_dst, {heads}) scores, "
                         f"got {tuple(el.shape)} and {tuple(er.shape)}")
    if edge_weight is not None and edge_weight.numel() not in (gi.num_edges, gi.num_edges * heads):
        raise ValueError(f"granii: edge_weight must hold one value per edge ({gi.num_edges}) or "
                         f"per edge and head, got {tuple(edge_weight.shape)}")
    if bias is not None and bias.numel() != feat.shape[1] * feat.shape[2]:
        raise ValueError(f"granii: bias must hold H * F = {feat.shape[1] * feat.shape[2]} values, "
                         f"got {tuple(bias.shape)}")


def gat_fused_native(gi, el, er, feat, slope, edge_weight=None, bias=None):
    """``gat_aggregate`` in one native pass per destination row (see the module docstring); a
    ``bias`` is added as each output row is written.

    Float32 and float64; other dtypes run the ``dgl`` composition.
    """
    _check_shapes(gi, el, er, feat, edge_weight, bias)
    if feat.dtype not in (torch.float32, torch.float64) or (bias is not None
                                                             and bias.dtype != feat.dtype):
        return gat_aggregate_dgl(gi, el, er, feat, slope, edge_weight, bias)
    dt = feat.dtype
    w = None if edge_weight is None else edge_weight.reshape(-1).to(dt).contiguous()
    b = None if bias is None else bias.reshape(-1)
    return _GatFused.apply(_rows(el, gi.num_src).to(dt), _rows(er, gi.num_dst).to(dt),
                           feat.contiguous(), w, b, gi, float(slope))


def _biased(out, bias):
    """``out`` ``(n, H, F)`` plus a bias of ``H F`` values, when there is one."""
    return out if bias is None else out + bias.reshape(out.shape[1:])


def _weighted(a, edge_weight):
    """``a`` ``(E, H, 1)`` times ``w_e`` (or ``w_eh``, one per edge and head: an attention
    dropout mask) as GATConv applies ``edge_weight`` after the softmax."""
    if edge_weight is None:
        return a
    heads = edge_weight.numel() // a.shape[0] if a.shape[0] else 1   # no edges: any count
    return a * edge_weight.reshape(a.shape[0], heads, 1).to(a.dtype)


@register("gat_aggregate", "dgl")
def gat_aggregate_dgl(gi, el, er, feat, slope, edge_weight=None, bias=None):
    """``gat_aggregate`` with DGL's ops, as GATConv runs it: ``u_add_v``, ``leaky_relu``,
    ``edge_softmax``, the edge weight, ``u_mul_e_sum`` [, + bias]."""
    import dgl
    _check_shapes(gi, el, er, feat, edge_weight, bias)
    g, heads = gi.g, feat.shape[1]
    e = dgl.ops.u_add_v(g, el.reshape(gi.num_src, heads, 1), er.reshape(gi.num_dst, heads, 1))
    a = dgl.ops.edge_softmax(g, F.leaky_relu(e, slope))
    return _biased(dgl.ops.u_mul_e_sum(g, feat, _weighted(a, edge_weight)), bias)


@register("gat_aggregate", "torch")
def gat_aggregate_torch(gi, el, er, feat, slope, edge_weight=None, bias=None):
    """``gat_aggregate`` with granii's torch kernels: index-gather ``sddmm_add``, ``edge_softmax``
    by scatter reductions, all heads as one interleaved CSR product (``spmm_weighted`` torch_csr)
    [, + bias]."""
    _check_shapes(gi, el, er, feat, edge_weight, bias)
    heads = feat.shape[1]
    e = _sddmm.sddmm_add_torch(gi, el.reshape(gi.num_src, heads, 1), er.reshape(gi.num_dst, heads, 1))
    a = _softmax.edge_softmax_torch(gi, F.leaky_relu(e, slope))
    return _biased(_spmm.spmm_weighted_torch_csr(gi, _weighted(a, edge_weight), feat), bias)


# ---- SDDMM add and edge softmax ------------------------------------------------------------------

class _SddmmAdd(torch.autograd.Function):
    """``e[j] = a[src_j] + b[dst_j]`` on ``(n, K)`` operands; ``da``/``db``: sums of ``de`` over
    each node's out-/in-edges (row sums over ``A^T`` / ``A`` gathered by edge id)."""

    @staticmethod
    def forward(ctx, a, b, gi):
        ctx.gi = gi
        return _OPS.sddmm_add_coo(*_coo(gi), a, b)

    @staticmethod
    @once_differentiable
    def backward(ctx, de):
        de = de.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            indptr, _, eids = _csr(ctx.gi, "at")
            da = _OPS.edge_row_sum(indptr, eids, de)
        if ctx.needs_input_grad[1]:
            indptr, _, eids = _csr(ctx.gi, "a")
            db = _OPS.edge_row_sum(indptr, eids, de)
        return da, db, None


def sddmm_add_native(gi, a_src, b_dst):
    """``e_uv = a_src[u] + b_dst[v]`` for each edge ``u -> v`` in edge-id order; trailing shapes
    broadcast as in ``sddmm_add_dgl``."""
    tail = torch.broadcast_shapes(a_src.shape[1:], b_dst.shape[1:])
    dt = torch.promote_types(a_src.dtype, b_dst.dtype)
    if dt not in (torch.float32, torch.float64):
        return _sddmm.sddmm_add_torch(gi, a_src, b_dst)
    a = _rows(a_src.to(dt).expand(gi.num_src, *tail), gi.num_src)
    b = _rows(b_dst.to(dt).expand(gi.num_dst, *tail), gi.num_dst)
    return _SddmmAdd.apply(a, b, gi).reshape(gi.num_edges, *tail)


class _EdgeSoftmax(torch.autograd.Function):
    """Softmax over each destination's in-edges of ``(E, K)`` scores; ``dx = a (g - sum_row a g)``."""

    @staticmethod
    def forward(ctx, x, gi):
        indptr, _, eids = _csr(gi, "a")
        a = _OPS.edge_softmax_csr(indptr, eids, x)
        ctx.save_for_backward(a)
        ctx.gi = gi
        return a

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        indptr, _, eids = _csr(ctx.gi, "a")
        return _OPS.edge_softmax_csr_backward(indptr, eids, a, g.contiguous()), None


def edge_softmax_native(gi, e):
    """``a_e = exp(e_e - m_v) / sum_{e' -> v} exp(e_e' - m_v)`` per destination, ``e`` of shape ``(E, ...)``."""
    if e.dtype not in (torch.float32, torch.float64):
        return _softmax.edge_softmax_torch(gi, e)
    return _EdgeSoftmax.apply(_rows(e, gi.num_edges), gi).reshape(e.shape)


if available():
    register("gat_aggregate", "native")(gat_fused_native)
    register("sddmm_add", "native")(sddmm_add_native)
    register("edge_softmax", "native")(edge_softmax_native)
