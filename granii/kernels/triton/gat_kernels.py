"""GAT's attention and aggregation in one pass per destination row, forward and backward, in Triton.

Per destination ``v``, head ``h``, over the in-edges ``e = (u -> v)``::

    x_e = el[u, h] + er[v, h]                 s_e = leaky_relu(x_e, slope)
    a_e = exp(s_e) / sum_{e' -> v} exp(s_e')
    out[v, h, :] = sum_{e -> v} a_e w_e feat[u, h, :]  (+ bias[h, :])      (w_e = 1 without weights)

which is ``u_add_v``, ``leaky_relu``, ``edge_softmax``, the product with the edge weights (or an
attention-dropout mask as per-head weights) and ``u_mul_e_sum``.

Forward: one program per (row, head) walks the row's edges ``BLOCK_E`` at a time with an online
softmax: a running maximum ``m``, a running sum ``l`` and a running ``acc = sum p_e w_e feat[u]``,
``l`` and ``acc`` rescaled by ``exp(m_old - m_new)`` when the maximum grows; at the end
``out = acc / l`` (0 for a row without edges) and ``lse = m + log l`` is kept (``num_dst x H``).
Only ``D`` features per edge are ever in registers: no ``E x H x D`` tensor, nor ``E x H``
attention.

Backward, with ``G = dL/dout`` and ``Dv[v, h] = <G[v, h], out[v, h] - bias[h]>`` (the softmax's
row term: ``sum_e a_e w_e <G[v], feat[u]>``), ``a_e = exp(s_e - lse[v, h])`` recomputed and
``t_e = <G[v, h], feat[u, h]>``::

    dfeat[u, h] = sum_{e: u -> v} a_e w_e G[v, h]
    dx_e        = a_e (w_e t_e - Dv[v, h]) * (1 if x_e > 0 else slope)
    del[u, h]   = sum_{e: u -> v} dx_e            der[v, h] = sum_{e -> v} dx_e
    dw_e        = a_e t_e                         dbias = sum_v G[v]

One program per (source ``u``, head) walks ``u``'s out-edges through the transpose (``A^T``'s
CSR with ``pos``, each edge's place in ``A``), so ``dfeat`` and ``del`` are sums of one program
(no atomics); it writes ``dx_e`` (and ``dw_e``) per edge and head in ``A``'s order, and ``der`` is
their row sums. Per edge: ``H`` values, never ``H x D``.
"""
import torch
import triton
import triton.language as tl

from granii.kernels.triton.graph import next_pow2
from granii.kernels.triton.launch import launch


@triton.jit
def gat_forward_kernel(indptr, indices, el, er, feat, w, bias, out, lse, slope, H,
                       DIM: tl.constexpr, BOUND: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    start = tl.load(indptr + row).to(tl.int64)
    end = tl.load(indptr + row + 1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DIM
    er_v = tl.load(er + row * H + h)
    m = tl.max(tl.full([BLOCK_E], -3.0e38, dtype=feat.dtype.element_ty), axis=0)
    l = tl.sum(tl.zeros([BLOCK_E], dtype=feat.dtype.element_ty), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=feat.dtype.element_ty)
    for k in range(0, (end - start) if BOUND == 0 else BOUND, BLOCK_E):
        offs = start + k + tl.arange(0, BLOCK_E)
        emask = offs < end
        u = tl.load(indices + offs, mask=emask, other=0).to(tl.int64)
        x = tl.load(el + u * H + h, mask=emask, other=0.0) + er_v
        s = tl.where(x > 0, x, x * slope)
        s = tl.where(emask, s, -3.0e38)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(emask, tl.exp(s - m_new), 0.0)
        l = l * alpha + tl.sum(p, axis=0)
        if HAS_W:
            p = p * tl.load(w + offs * H + h, mask=emask, other=0.0)
        fv = tl.load(feat + (u * H + h)[:, None] * DIM + d[None, :],
                     mask=emask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * fv, axis=0)
        m = m_new
    safe = tl.where(l > 0, l, 1.0)
    res = tl.where(l > 0, acc / safe, 0.0)
    if HAS_BIAS:
        res += tl.load(bias + h * DIM + d, mask=dmask, other=0.0)
    tl.store(out + (row * H + h) * DIM + d, res, mask=dmask)
    tl.store(lse + row * H + h, m + tl.log(safe))


@triton.jit
def gat_backward_kernel(t_indptr, t_indices, t_pos, el, er, feat, w, lse, dout, dsum, dfeat, del_,
                        dx_edge, dw_edge, slope, H, DIM: tl.constexpr, BOUND: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr,
                        NEED_W: tl.constexpr):
    src = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    start = tl.load(t_indptr + src).to(tl.int64)
    end = tl.load(t_indptr + src + 1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DIM
    el_u = tl.load(el + src * H + h)
    f_u = tl.load(feat + (src * H + h) * DIM + d, mask=dmask, other=0.0)
    acc = tl.zeros([BLOCK_D], dtype=feat.dtype.element_ty)
    dl = tl.zeros([BLOCK_E], dtype=feat.dtype.element_ty)
    for k in range(0, (end - start) if BOUND == 0 else BOUND, BLOCK_E):
        offs = start + k + tl.arange(0, BLOCK_E)
        emask = offs < end
        v = tl.load(t_indices + offs, mask=emask, other=0).to(tl.int64)
        j = tl.load(t_pos + offs, mask=emask, other=0).to(tl.int64)
        x = el_u + tl.load(er + v * H + h, mask=emask, other=0.0)
        s = tl.where(x > 0, x, x * slope)
        a = tl.where(emask, tl.exp(s - tl.load(lse + v * H + h, mask=emask, other=0.0)), 0.0)
        if HAS_W:
            wv = tl.load(w + j * H + h, mask=emask, other=0.0)
        else:
            wv = tl.where(emask, 1.0, 0.0)
        g = tl.load(dout + (v * H + h)[:, None] * DIM + d[None, :],
                    mask=emask[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum((a * wv)[:, None] * g, axis=0)
        t = tl.sum(g * f_u[None, :], axis=1)
        dv = tl.load(dsum + v * H + h, mask=emask, other=0.0)
        dx = a * (wv * t - dv) * tl.where(x > 0, 1.0, slope)
        dx = tl.where(emask, dx, 0.0)
        dl += dx
        tl.store(dx_edge + j * H + h, dx, mask=emask)
        if NEED_W:
            tl.store(dw_edge + j * H + h, a * t, mask=emask)
    tl.store(dfeat + (src * H + h) * DIM + d, acc, mask=dmask)
    tl.store(del_ + src * H + h, tl.sum(dl, axis=0))


def _blocks(dim):
    block_d = next_pow2(dim)
    if block_d > 1024:
        raise ValueError(f"granii: the fused GAT kernel takes at most 1024 features a head, "
                         f"got {dim}")
    return max(16, min(64, 4096 // block_d)), block_d


def gat_forward_csr(graph, el, er, feat, w, bias, slope):
    """``(out, lse)`` of the module docstring. ``el`` ``(num_src, H)``, ``er`` ``(num_dst, H)``,
    ``feat`` ``(num_src, H, D)``, ``w`` ``(nnz, H)`` in ``A``'s CSR order or None, ``bias``
    ``(H * D,)`` or None. No autograd."""
    a = graph.a
    heads, dim = feat.shape[1], feat.shape[2]
    out = torch.empty(a.rows, heads, dim, dtype=feat.dtype, device=feat.device)
    lse = torch.empty(a.rows, heads, dtype=feat.dtype, device=feat.device)
    block_e, block_d = _blocks(dim)
    dummy = feat
    launch(gat_forward_kernel, (a.rows, heads),
           [a.indptr, a.indices, el, er, feat, dummy if w is None else w,
            dummy if bias is None else bias, out, lse, float(slope), heads],
           dict(DIM=dim, BOUND=a.bound(block_e), BLOCK_E=block_e, BLOCK_D=block_d,
                HAS_W=w is not None, HAS_BIAS=bias is not None))
    return out, lse


def gat_backward_csr(graph, el, er, feat, w, lse, dout, dsum, slope, need_w):
    """``(dfeat, del, dx_edge, dw_edge)``: ``dx_edge``/``dw_edge`` ``(nnz, H)`` in ``A``'s order
    (``dw_edge`` None unless ``need_w``); ``der`` is their row sums (``ops.row_sums``)."""
    at = graph.at
    heads, dim = feat.shape[1], feat.shape[2]
    dfeat = torch.empty_like(feat)
    del_ = torch.empty_like(el)
    dx_edge = torch.zeros(graph.num_edges, heads, dtype=feat.dtype, device=feat.device)
    dw_edge = torch.zeros_like(dx_edge) if need_w else None
    block_e, block_d = _blocks(dim)
    dummy = feat
    launch(gat_backward_kernel, (at.rows, heads),
           [at.indptr, at.indices, graph.pos, el, er, feat, dummy if w is None else w, lse,
            dout, dsum, dfeat, del_, dx_edge, dummy if dw_edge is None else dw_edge,
            float(slope), heads],
           dict(DIM=dim, BOUND=at.bound(block_e), BLOCK_E=block_e, BLOCK_D=block_d,
                HAS_W=w is not None, NEED_W=need_w))
    return dfeat, del_, dx_edge, dw_edge
