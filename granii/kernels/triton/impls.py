"""The Triton kernels behind the kernel registry's calling convention (``granii/kernels/__init__``):
functions of a ``GraphInfo`` ``gi`` with edge values in the graph's edge-id order, as the
``torch``, ``torch_csr``, ``dgl`` and ``native`` implementations are called.

Nothing here is registered on import: the registry holds implementations a plan may pick on any
input, and these run only on CUDA tensors (or CPU tensors under Triton's interpreter).
``register()`` adds them as implementation ``"triton"`` of each primitive, for a dispatcher that
picks implementations by the features' device.

The ``CsrGraph`` (CSR of ``A`` and ``A^T``) is made once per graph and device from ``gi.edges()``
and kept in the graph's cache (``gi.memo``), on the features' device; graph-derived operands a plan
passes (degree vectors, edge values) are moved there too.
"""
from granii.kernels.triton.graph import CsrGraph
from granii.kernels.triton.ops import edge_softmax, gat, sddmm_add, spmm


def csr_graph(gi, device):
    """The ``CsrGraph`` of ``gi`` on ``device``, once per graph and device."""
    device = str(device)

    def make():
        src, dst = gi.edges()
        return CsrGraph.from_coo(src.to(device), dst.to(device), gi.num_src, gi.num_dst)
    return gi.memo(("triton_csr", device), make)


def _width_of(x):
    width = 1
    for s in x.shape[1:]:
        width *= s
    return width


def spmm_triton(gi, x):
    """``Y = A X``: ``Y[v] = sum_{u -> v} X[u]``, shape ``(num_dst, ...)``."""
    return spmm(csr_graph(gi, x.device), x)


def spmm_weighted_triton(gi, w, x):
    """``Y = A_w X``: ``w`` ``(E,)`` with ``x`` ``(n, ...)``, or per head ``w`` ``(E, H)`` /
    ``(E, H, 1)`` with ``x`` ``(n, H, K)``."""
    e = gi.num_edges
    heads = w.numel() // e if e else (w.shape[1] if w.dim() > 1 else 1)
    if heads > 1 and (x.dim() < 2 or x.shape[1] != heads):
        raise ValueError(f"granii: {heads}-head edge values need x of shape (n, {heads}[, k]), "
                         f"got {tuple(x.shape)}")
    return spmm(csr_graph(gi, x.device), x, w.reshape(e, max(heads, 1)).to(x.device))


def spmm_mean_triton(gi, x):
    """``Y = D_in^{-1} A X`` with ``D_in`` clamped to 1 (rows without in-edges are 0)."""
    g = csr_graph(gi, x.device)
    inv = gi.memo(("triton_mean_scale", str(x.device), x.dtype), lambda: (
        (g.a.indptr[1:] - g.a.indptr[:-1]).to(x.dtype).clamp(min=1).reciprocal()))
    return spmm(g, x, row_scale=inv)


def spmm_norm_triton(gi, d_dst, d_src, x, bias=None, act=None, res=None):
    """``act(diag(d_dst) A diag(d_src) X + bias + res)`` in one kernel (``act``: None or
    ``"relu"``); a ``res`` that is not one row of the result's width per row is added as torch
    broadcasts it, after the kernel."""
    if act not in (None, "relu"):
        raise ValueError(f"granii: spmm_norm supports act None or 'relu', got {act!r}")
    g = csr_graph(gi, x.device)
    width = _width_of(x)
    by_row = res is not None and res.dim() >= 2 and res.shape[0] == gi.num_dst \
        and res[0:1].numel() == width and res.dtype == x.dtype
    # degree vectors are graph data: a plan may hold them where the graph's index lives
    d_dst = None if d_dst is None else d_dst.reshape(-1).to(device=x.device, dtype=x.dtype)
    d_src = None if d_src is None else d_src.reshape(-1).to(device=x.device, dtype=x.dtype)
    if res is not None and not by_row:
        y = spmm(g, x, row_scale=d_dst, col_scale=d_src, bias=bias) + res
        return y.relu() if act == "relu" else y
    return spmm(g, x, row_scale=d_dst, col_scale=d_src, bias=bias, residual=res,
                relu=act == "relu")


def sddmm_add_triton(gi, a_src, b_dst):
    """``e_uv = a_src[u] + b_dst[v]`` for each edge ``u -> v``, ``(E, H[, 1])`` as given."""
    g = csr_graph(gi, a_src.device)
    width = _width_of(a_src)
    out = sddmm_add(g, a_src.reshape(gi.num_src, width), b_dst.reshape(gi.num_dst, width))
    return out.reshape(gi.num_edges, *a_src.shape[1:])


def edge_softmax_triton(gi, e):
    """Softmax of the edge scores ``e`` (``(E, ...)``) over each destination's in-edges."""
    return edge_softmax(csr_graph(gi, e.device), e)


def gat_aggregate_triton(gi, el, er, feat, slope, edge_weight=None, bias=None):
    """GAT's attention and aggregation fused (``gat_kernels``, ``ops.gat``); arguments as
    ``gat_aggregate``'s other implementations (``granii/kernels/native_gat.py``)."""
    g = csr_graph(gi, feat.device)
    if edge_weight is not None:
        edge_weight = edge_weight.to(feat.device)
    return gat(g, el, er, feat, slope, edge_weight, bias)


IMPLEMENTATIONS = {
    "spmm": spmm_triton,
    "spmm_weighted": spmm_weighted_triton,
    "spmm_mean": spmm_mean_triton,
    "spmm_norm": spmm_norm_triton,
    "sddmm_add": sddmm_add_triton,
    "edge_softmax": edge_softmax_triton,
    "gat_aggregate": gat_aggregate_triton,
}


def register(impl="triton"):
    """Add every function of ``IMPLEMENTATIONS`` to the kernel registry as ``impl`` (once)."""
    from granii.kernels.registry import REGISTRY
    from granii.kernels.registry import register as add
    for primitive, fn in IMPLEMENTATIONS.items():
        if impl not in REGISTRY.get(primitive, {}):
            add(primitive, impl)(fn)
