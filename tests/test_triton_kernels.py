"""granii's Triton kernels (``granii/kernels/triton/``) against torch references: SpMM (both
schedules, every epilogue, weighted, multi-head), SDDMM (dot, add), edge softmax and the fused GAT,
outputs and gradients (``gradcheck`` in float64, and float32 gradients against the references), on
small random graphs: directed with duplicate edges and edges in no particular order, rows without
in-edges, a skewed graph whose hub row is split into several work items (the SpMM's partial sums,
the GAT's partial softmaxes and their merge, and its backward's atomic sums), a bipartite block,
no edges at all.

Without a GPU the kernels run under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before the kernels are defined; so the checks run in child processes
(this file run as a script, ``--worker``), and the tests here read their results:

* ``static``: loop bounds as compile-time constants, with the interpreter made *strict*: a tensor
  of one or more dimensions used as a Python integer raises, as with older Triton on numpy >= 2.5
  ("only 0-dimensional arrays can be converted to Python scalars"). ``test_strict_catches_hazard``
  shows that the strict interpreter does refuse a loop bound loaded from memory;
* ``dynamic``: loop bounds read from the CSR (the form compiled for a GPU), on the installed
  interpreter, which accepts them.

Every launch of the ``static`` run is also compiled ahead of time for an sm_90 GPU with Triton's
compiler (``test_compiles_for_gpu``): a kernel the interpreter runs but the compiler refuses fails
here, without a GPU. With ``GRANII_TRITON_DEVICE=cuda`` (``scripts/gpu_check.sh``) the same checks
run compiled on the GPU, in both loop modes. Skipped where Triton is missing or older than 3.0 (the
DGL stack's torch 2.1 comes with Triton 2.1).
"""
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from granii.kernels.triton import available  # noqa: E402

DEVICE = os.environ.get("GRANII_TRITON_DEVICE", "cpu")
MODES = ("static", "dynamic")


# -- graphs and references ------------------------------------------------------------------------
def random_graph(n, e, zero_in=0, seed=0):
    """``e`` edges with uniform sources and destinations among the first ``n - zero_in`` nodes
    (the rest have no in-edges), duplicates allowed, in random order."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, max(n - zero_in, 1), (e,), generator=gen) if e else src
    return src, dst, n


def skewed_graph(n, e, seed=0):
    """Destinations ``floor(n u^3)``: node 0 gets about ``e n^(-1/3)`` in-edges (its row is split
    into several work items: the worker sets the schedule's ``SEG`` to 8), many nodes none."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = (n * torch.rand(e, generator=gen) ** 3).long().clamp(max=n - 1)
    return src, dst, n


GRAPHS = {
    "directed": lambda: random_graph(8, 20, zero_in=3, seed=1),
    "skewed": lambda: skewed_graph(16, 80, seed=2),
    "empty": lambda: random_graph(5, 0),
    "one_node_loop": lambda: (torch.tensor([0]), torch.tensor([0]), 1),
}


def build(name, dev, index_dtype=None):
    from granii.kernels.triton import CsrGraph
    src, dst, n = GRAPHS[name]()
    g = CsrGraph.from_coo(src.to(dev), dst.to(dev), n, n, index_dtype=index_dtype)
    return g, src.to(dev), dst.to(dev), n


def dense(src, dst, n, w=None, dtype=torch.float32):
    """``A_w`` dense ``(n, n)`` (duplicate edges add up); ``w`` ``(E,)``."""
    a = torch.zeros(n, n, dtype=dtype, device=src.device)
    vals = torch.ones(src.shape[0], dtype=dtype, device=src.device) if w is None else w
    return a.index_put((dst, src), vals, accumulate=True)


def ref_spmm(src, dst, n, x, w=None, r=None, c=None, bias=None, res=None, relu=False):
    """The SpMM family by edges: ``act(r * sum_e w_e c[u] X[u] + bias + res)``; ``x``
    ``(n, H, D)``, ``w`` ``(E, H)`` or None."""
    xs = x if c is None else x * c.reshape(-1, 1, 1)
    msg = xs[src] if w is None else xs[src] * w.unsqueeze(-1)
    y = torch.zeros(n, *x.shape[1:], dtype=x.dtype, device=x.device).index_add(0, dst, msg)
    y = y.reshape(n, -1)
    if r is not None:
        y = y * r.reshape(-1, 1)
    if bias is not None:
        y = y + bias
    if res is not None:
        y = y + res
    return torch.relu(y) if relu else y


def ref_softmax(dst, n, s):
    """Edge softmax by edges (``s`` ``(E, H)``)."""
    m = torch.full((n, s.shape[1]), -torch.inf, dtype=s.dtype, device=s.device)
    m = m.index_reduce(0, dst, s.detach(), "amax")
    ex = torch.exp(s - m[dst])
    den = torch.zeros(n, s.shape[1], dtype=s.dtype, device=s.device).index_add(0, dst, ex)
    return ex / den[dst]


def ref_gat(src, dst, n, el, er, feat, slope, w=None, bias=None):
    x = el[src] + er[dst]
    a = ref_softmax(dst, n, torch.nn.functional.leaky_relu(x, slope))
    if w is not None:
        a = a * w
    out = torch.zeros(n, *feat.shape[1:], dtype=feat.dtype, device=feat.device)
    out = out.index_add(0, dst, a.unsqueeze(-1) * feat[src])
    return out if bias is None else out + bias.reshape(feat.shape[1:])


def close(got, want, what, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def grads(fn, inputs):
    """Outputs of ``fn(*inputs)`` and the gradients of ``<out, G>`` for a fixed random ``G``."""
    inputs = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                    dtype=out.dtype).to(out.device)
    gs = torch.autograd.grad(out, [t for t in inputs if t is not None], g, allow_unused=True)
    return out.detach(), gs


def compare(name, ours, ref, inputs, atol=2e-4, rtol=2e-4):
    out, gs = grads(ours, inputs)
    out_r, gs_r = grads(ref, inputs)
    close(out, out_r, f"{name}: output", atol, rtol)
    for i, (a, b) in enumerate(zip(gs, gs_r)):
        if b is None:
            assert a is None or not a.abs().any(), f"{name}: gradient {i} should be zero"
            continue
        close(torch.zeros_like(b) if a is None else a, b, f"{name}: gradient {i}", atol, rtol)


def gradcheck(fn, inputs, what, nondet_tol=0.0):
    """``torch.autograd.gradcheck`` in float64, fast mode (a few random directions: the
    interpreter runs each evaluation in Python). ``nondet_tol``: how far two backward passes may
    differ (atomic sums add in any order on a GPU)."""
    inputs = [t.detach().double().requires_grad_(True) for t in inputs]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4,
                                    fast_mode=True, nondet_tol=nondet_tol), what


# -- the checks (run in the worker) --------------------------------------------------------------
def check_spmm_plain(dev):
    """``A X`` with both schedules, every graph, int32 and int64 indices, widths that are not a
    power of two or span two column blocks."""
    from granii.kernels.triton import spmm
    for gname in GRAPHS:
        for index_dtype in ((torch.int32, torch.int64) if gname == "directed" else (None,)):
            g, src, dst, n = build(gname, dev, index_dtype)
            for width in ((1, 5, 130) if gname == "directed" else (5,)):
                x = torch.randn(n, width, device=dev)
                want = dense(src, dst, n) @ x
                for sched in ("rows", "segments", "auto"):
                    close(spmm(g, x, schedule=sched), want,
                          f"{gname}/{index_dtype}/{width}/{sched}")


def check_spmm_fused_grads(dev):
    """Every epilogue at once, per-head edge values, both schedules (ReLU's mask in each): output
    and the gradients of x, w, row and column scales, bias and residual against the reference
    (float32)."""
    from granii.kernels.triton import spmm
    for gname in ("directed", "skewed", "empty"):
        g, src, dst, n = build(gname, dev)
        e = src.shape[0]
        for heads, dim in ((2, 3),):
            gen = torch.Generator().manual_seed(3)
            x = torch.randn(n, heads, dim, generator=gen).to(dev)
            w = torch.rand(e, heads, generator=gen).to(dev)
            r = torch.rand(n, generator=gen).to(dev) + 0.5
            c = torch.rand(n, generator=gen).to(dev) + 0.5
            bias = torch.randn(heads * dim, generator=gen).to(dev)
            res = torch.randn(n, heads * dim, generator=gen).to(dev)
            for sched, relu in (("rows", False), ("rows", True), ("segments", True)):
                def ours(x, w, r, c, bias, res):
                    return spmm(g, x, w, r, c, bias, res, relu=relu,
                                schedule=sched).reshape(n, -1)

                def ref(x, w, r, c, bias, res):
                    return ref_spmm(src, dst, n, x, w, r, c, bias, res, relu)
                compare(f"{gname}/h{heads}/{sched}/relu={relu}", ours, ref,
                        [x, w, r, c, bias, res])
            # one weight per edge with a (n, F) x
            compare(f"{gname}/edge weights", lambda x, w: spmm(g, x, w),
                    lambda x, w: ref_spmm(src, dst, n, x.unsqueeze(1), w.unsqueeze(1)),
                    [x.reshape(n, -1), w[:, 0]])


def check_spmm_gradcheck(dev):
    """``gradcheck`` (float64) of the SpMM in all six tensor inputs, per-head edge values: rows on
    the directed graph, segments on the skewed one (its hub row split into partial sums)."""
    from granii.kernels.triton import spmm
    for gname, sched in (("directed", "rows"), ("skewed", "segments")):
        g, src, dst, n = build(gname, dev)
        e = src.shape[0]
        gen = torch.Generator().manual_seed(4)
        inputs = [torch.randn(n, 2, generator=gen), torch.rand(e, 2, generator=gen),
                  torch.rand(n, generator=gen), torch.rand(n, generator=gen),
                  torch.randn(2, generator=gen), torch.randn(n, 2, generator=gen)]
        # the split row's pieces add up atomically, in any order on a GPU (nondet_tol)
        gradcheck(lambda x, w, r, c, b, res: spmm(g, x, w, r, c, b, res, schedule=sched),
                  [t.to(dev) for t in inputs], f"{gname}/{sched}", nondet_tol=1e-10)


def check_segments_split_rows(dev):
    """The skewed graph's hub row is longer than a work item: it is split, its pieces add up
    atomically, and the finishing pass applies bias, residual and ReLU to it once."""
    from granii.kernels.triton import spmm
    from granii.kernels.triton.spmm_kernels import SEG
    g, src, dst, n = build("skewed", dev)
    assert g.a.max_len > SEG, "the skewed graph must have a row longer than a work item"
    split = g.a.segments(SEG)[4]
    assert split.numel() >= 1 and int(split[0]) == 0
    x = torch.randn(n, 7, device=dev)
    bias = torch.randn(7, device=dev)
    res = torch.randn(n, 7, device=dev)
    want = ref_spmm(src, dst, n, x.unsqueeze(1), bias=bias, res=res, relu=True)
    close(spmm(g, x, bias=bias, residual=res, relu=True, schedule="segments"), want, "split rows")


def check_sddmm(dev):
    """Per-head dot products and ``a[u] + b[v]``: outputs in edge order and gradients."""
    from granii.kernels.triton import sddmm_add, sddmm_dot
    for gname in ("directed", "skewed", "empty"):
        g, src, dst, n = build(gname, dev)
        gen = torch.Generator().manual_seed(5)
        for heads, dim in ((1, 5), (2, 70)) if gname == "directed" else ((3, 4),):
            p = torch.randn(n, heads, dim, generator=gen).to(dev)
            q = torch.randn(n, heads, dim, generator=gen).to(dev)
            compare(f"{gname}/dot/h{heads}/d{dim}", lambda p, q: sddmm_dot(g, p, q, heads),
                    lambda p, q: (p[dst] * q[src]).sum(-1), [p, q])
            a = torch.randn(n, heads, generator=gen).to(dev)
            b = torch.randn(n, heads, generator=gen).to(dev)
            compare(f"{gname}/add/h{heads}", lambda a, b: sddmm_add(g, a, b),
                    lambda a, b: a[src] + b[dst], [a, b])
        a1 = torch.randn(n, device=dev)
        close(sddmm_add(g, a1, a1), a1[src] + a1[dst], f"{gname}/add 1-D")
    g, src, dst, n = build("directed", dev)
    gen = torch.Generator().manual_seed(6)
    gradcheck(lambda p, q: sddmm_dot(g, p, q, 2),
              [torch.randn(n, 2, 3, generator=gen).to(dev),
               torch.randn(n, 2, 3, generator=gen).to(dev)], "sddmm_dot")
    gradcheck(lambda a, b: sddmm_add(g, a, b),
              [torch.randn(n, 2, generator=gen).to(dev),
               torch.randn(n, 2, generator=gen).to(dev)], "sddmm_add")


def check_edge_softmax(dev):
    """Softmax over each destination's in-edges, several heads, a row longer than a block, rows
    without edges; gradients; ``gradcheck``."""
    from granii.kernels.triton import edge_softmax
    for gname in ("directed", "skewed", "empty", "one_node_loop"):
        g, src, dst, n = build(gname, dev)
        e = src.shape[0]
        gen = torch.Generator().manual_seed(8)
        for heads in (1, 3) if gname == "directed" else (3,):
            s = (4 * torch.randn(e, heads, generator=gen)).to(dev)
            compare(f"{gname}/h{heads}", lambda s: edge_softmax(g, s),
                    lambda s: ref_softmax(dst, n, s), [s])
        s1 = torch.randn(e, device=dev)
        close(edge_softmax(g, s1), ref_softmax(dst, n, s1.unsqueeze(1)).reshape(-1), "1-D")
    g, src, dst, n = build("directed", dev)
    gradcheck(lambda s: edge_softmax(g, s),
              [torch.randn(src.shape[0], 2, generator=torch.Generator().manual_seed(9)).to(dev)],
              "edge_softmax")


def check_gat(dev):
    """The fused GAT against scores, leaky ReLU, softmax, weights and aggregation by edges: no
    weights, one weight an edge, one an edge and head, bias; gradients of all inputs."""
    from granii.kernels.triton import gat
    for gname in ("directed", "skewed", "empty", "one_node_loop"):
        g, src, dst, n = build(gname, dev)
        e = src.shape[0]
        gen = torch.Generator().manual_seed(10)
        for heads, dim in ((1, 4), (3, 5)) if gname == "directed" else ((2, 3),):
            el = torch.randn(n, heads, generator=gen).to(dev)
            er = torch.randn(n, heads, generator=gen).to(dev)
            feat = torch.randn(n, heads, dim, generator=gen).to(dev)
            bias = torch.randn(heads, dim, generator=gen).to(dev)
            for wshape in ((None, (e,), (e, heads)) if gname == "directed" else ((e, heads),)):
                w = None if wshape is None else torch.rand(wshape, generator=gen).to(dev)
                name = f"{gname}/h{heads}/w{wshape}"
                compare(name, lambda el, er, feat, w, bias: gat(g, el, er, feat, 0.2, w, bias),
                        lambda el, er, feat, w, bias: ref_gat(
                            src, dst, n, el, er, feat, 0.2,
                            w if w is None or w.dim() > 1 else w.unsqueeze(1), bias),
                        [el, er, feat, w, bias])


def check_gat_gradcheck(dev):
    """``gradcheck`` (float64) of the fused GAT in ``el``, ``er``, ``feat``, per-head edge weights
    and the bias."""
    from granii.kernels.triton import gat
    g, src, dst, n = build("directed", dev)
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randn(n, 2, generator=gen), torch.randn(n, 2, generator=gen),
              torch.randn(n, 2, 3, generator=gen), torch.rand(src.shape[0], 2, generator=gen),
              torch.randn(2, 3, generator=gen)]
    gradcheck(lambda el, er, f, w, b: gat(g, el, er, f, 0.2, w, b), [t.to(dev) for t in inputs],
              "gat")


def _gat_split_graphs(dev):
    """Graphs whose rows of ``A`` and of ``A^T`` span several GAT work items: the skewed graph
    (a hub row, many rows without in-edges) and a bipartite block (20 sources, 3 destinations:
    destination 0 with 15 in-edges, 1 with none; source 0 with 9 out-edges, some sources with
    none)."""
    g, src, dst, n = build("skewed", dev)
    yield "skewed", g, src, dst, n, n
    from granii.kernels.triton import CsrGraph
    bsrc = torch.tensor([0] * 9 + list(range(1, 12)) + [5, 7], device=dev)
    bdst = torch.tensor([0] * 6 + [2] * 3 + [0] * 9 + [2] * 4, device=dev)
    yield "bipartite", CsrGraph.from_coo(bsrc, bdst, 20, 3), bsrc, bdst, 20, 3


def check_gat_split_rows(dev):
    """The fused GAT where rows are split into pieces: the forward's partial softmaxes merged
    (``gat_merge_kernel``, also over more pieces than one merge step takes: a small
    ``MERGE_TILE``),
    the backward's atomic sums for split sources and ``der``'s for split rows; rows and sources
    without edges. Outputs and all gradients (weights per head and bias too) against the
    reference, float32."""
    from granii.kernels.triton import gat, gat_kernels
    seg, tile = gat_kernels.SEG, gat_kernels.MERGE_TILE
    try:
        for gat_kernels.SEG, gat_kernels.MERGE_TILE in ((8, 4096), (2, 64)):
            for gname, g, src, dst, ns, nd in _gat_split_graphs(dev):
                assert g.a.max_len > gat_kernels.SEG and g.at.max_len > gat_kernels.SEG
                gen = torch.Generator().manual_seed(15)
                heads, dim = 2, 4
                el = (3 * torch.randn(ns, heads, generator=gen)).to(dev)
                er = torch.randn(nd, heads, generator=gen).to(dev)
                feat = torch.randn(ns, heads, dim, generator=gen).to(dev)
                w = torch.rand(src.shape[0], heads, generator=gen).to(dev)
                bias = torch.randn(heads, dim, generator=gen).to(dev)
                compare(f"{gname}/seg {gat_kernels.SEG}/merge tile {gat_kernels.MERGE_TILE}",
                        lambda a, b, f, w, bb: gat(g, a, b, f, 0.2, w, bb),
                        lambda a, b, f, w, bb: ref_gat(src, dst, nd, a, b, f, 0.2, w, bb),
                        [el, er, feat, w, bias])
    finally:
        gat_kernels.SEG, gat_kernels.MERGE_TILE = seg, tile


def check_gat_split_gradcheck(dev):
    """``gradcheck`` (float64) of the fused GAT with split rows and sources (the skewed graph,
    work items of 4 edges): merge and atomic paths, in all five inputs."""
    from granii.kernels.triton import gat, gat_kernels
    seg = gat_kernels.SEG
    gat_kernels.SEG = 4
    try:
        g, src, dst, n = build("skewed", dev)
        gen = torch.Generator().manual_seed(16)
        inputs = [torch.randn(n, 2, generator=gen), torch.randn(n, 2, generator=gen),
                  torch.randn(n, 2, 2, generator=gen), torch.rand(src.shape[0], 2, generator=gen),
                  torch.randn(2, 2, generator=gen)]
        gradcheck(lambda el, er, f, w, b: gat(g, el, er, f, 0.2, w, b),
                  [t.to(dev) for t in inputs], "gat split", nondet_tol=1e-10)
    finally:
        gat_kernels.SEG = seg


def check_bipartite_and_no_nodes(dev):
    """Sources and destinations of different counts (a sampled block's shape: 5 sources, 2
    destinations, a source without out-edges), and a graph without nodes: SpMM, SDDMM, softmax
    and GAT, outputs and gradients."""
    from granii.kernels.triton import CsrGraph, edge_softmax, gat, sddmm_dot, spmm
    src = torch.tensor([0, 1, 2, 3, 1], device=dev)
    dst = torch.tensor([1, 0, 1, 1, 1], device=dev)
    g = CsrGraph.from_coo(src, dst, 5, 2)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(5, 2, 3, generator=gen).to(dev)
    w = torch.rand(5, 2, generator=gen).to(dev)
    compare("block spmm", lambda x, w: spmm(g, x, w).reshape(2, -1),
            lambda x, w: ref_spmm(src, dst, 2, x, w), [x, w])
    p = torch.randn(2, 2, 3, generator=gen).to(dev)
    compare("block sddmm", lambda p, x: sddmm_dot(g, p, x, 2),
            lambda p, x: (p[dst] * x[src]).sum(-1), [p, x])
    compare("block softmax", lambda s: edge_softmax(g, s), lambda s: ref_softmax(dst, 2, s), [w])
    el = torch.randn(5, 2, generator=gen).to(dev)
    er = torch.randn(2, 2, generator=gen).to(dev)
    compare("block gat", lambda a, b, f: gat(g, a, b, f), lambda a, b, f: ref_gat(
        src, dst, 2, a, b, f, 0.2), [el, er, x])
    none = torch.zeros(0, dtype=torch.long, device=dev)
    g0 = CsrGraph.from_coo(none, none, 0, 0)
    x0 = torch.randn(0, 4, device=dev, requires_grad=True)
    for sched in ("rows", "segments"):
        y = spmm(g0, x0, bias=torch.zeros(4, device=dev), relu=True, schedule=sched)
        y.sum().backward()
        assert y.shape == (0, 4) and x0.grad.shape == (0, 4)
    assert gat(g0, torch.zeros(0, 2, device=dev), torch.zeros(0, 2, device=dev),
               torch.zeros(0, 2, 3, device=dev)).shape == (0, 2, 3)
    assert edge_softmax(g0, torch.zeros(0, 2, device=dev)).shape == (0, 2)


def check_graph_index(dev):
    """The CSR, its transpose and the permutations between edge order and CSR orders."""
    g, src, dst, n = build("directed", dev)
    a, at = g.a, g.at
    e = src.shape[0]
    assert (a.indptr[1:] >= a.indptr[:-1]).all() and int(a.indptr[-1]) == e
    rows = a.row_of.long()
    assert torch.equal(rows, dst[g.eids]) and torch.equal(a.indices.long(), src[g.eids])
    assert torch.equal(g.eids[g.where], torch.arange(e, device=dev))
    pos = g.pos.long()
    assert torch.equal(at.indices.long(), rows[pos]) and torch.equal(at.row_of.long(),
                                                                   a.indices.long()[pos])
    assert a.max_len == int(torch.bincount(dst, minlength=n).max())
    # edges already sorted by destination need no permutation
    order = torch.argsort(dst, stable=True)
    from granii.kernels.triton import CsrGraph
    g2 = CsrGraph.from_coo(src[order], dst[order], n, n)
    assert g2.eids is None and g2.where is None
    g3 = CsrGraph.from_csr(g.a.indptr, g.a.indices, n)
    x = torch.randn(n, 3, device=dev)
    from granii.kernels.triton import spmm
    close(spmm(g3, x), dense(src, dst, n) @ x, "from_csr")


def check_model_widths(dev):
    """The widths of the GPU check's models and kernels (so that their launch constants are among
    those compiled ahead of time too): GCN-style SpMM at 16, 32 and 128 features with every
    epilogue, forward and backward, in both schedules; the fused GAT at 8 heads x 16."""
    from granii.kernels.triton import gat, spmm
    g, src, dst, n = build("directed", dev)
    gen = torch.Generator().manual_seed(13)
    d = (torch.rand(n, generator=gen) + 0.5).to(dev)
    for width in (16, 32, 128):
        x = torch.randn(n, width, generator=gen).to(dev)
        bias = torch.randn(width, generator=gen).to(dev)
        for sched in ("rows", "segments"):
            compare(f"k={width}/{sched}",
                    lambda x, b: spmm(g, x, row_scale=d, col_scale=d, bias=b, relu=True,
                                      schedule=sched),
                    lambda x, b: ref_spmm(src, dst, n, x.unsqueeze(1), r=d, c=d, bias=b,
                                          relu=True), [x, bias])
    el, er = torch.randn(n, 8, generator=gen).to(dev), torch.randn(n, 8, generator=gen).to(dev)
    feat = torch.randn(n, 8, 16, generator=gen).to(dev)
    bias = torch.randn(128, generator=gen).to(dev)
    compare("gat 8x16", lambda a, b, f, bb: gat(g, a, b, f, 0.2, bias=bb),
            lambda a, b, f, bb: ref_gat(src, dst, n, a, b, f, 0.2, bias=bb), [el, er, feat, bias])


def check_registry_calls(dev):
    """``impls``: the kernels behind the registry's calling convention (a ``GraphInfo``, edge
    values in edge order) give what the registry's torch implementations give, outputs and
    gradients, on a graph built from an edge list (PyG's ``IndexGraph``). CPU only: those torch
    implementations build their indices on the CPU."""
    if dev != "cpu":
        return
    from granii.graph import GraphInfo
    from granii.kernels import get
    from granii.kernels.triton import impls
    from granii.pyg.graph import IndexGraph
    src, dst, n = GRAPHS["directed"]()
    gi = GraphInfo(IndexGraph(src, dst, n))
    e = src.shape[0]
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(n, 2, 3, generator=gen)
    w = torch.rand(e, 2, generator=gen)
    d = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(6, generator=gen)
    res = torch.randn(n, 6, generator=gen)
    el, er = torch.randn(n, 2, 1, generator=gen), torch.randn(n, 2, 1, generator=gen)
    # the registry's torch spmm_weighted (and gat_aggregate, made with it) needs DGL for the
    # gradient of the edge values: those two are compared with this file's references
    compare("spmm_weighted", lambda w, x: impls.spmm_weighted_triton(gi, w, x).reshape(n, -1),
            lambda w, x: ref_spmm(src, dst, n, x, w), [w, x])
    compare("gat_aggregate", lambda a, b, x, w: impls.gat_aggregate_triton(gi, a, b, x, 0.2, w),
            lambda a, b, x, w: ref_gat(src, dst, n, a.reshape(n, 2), b.reshape(n, 2), x, 0.2, w),
            [el, er, x, w])
    cases = [
        ("spmm", "torch_csr", lambda f: (lambda x: f(gi, x)), [x]),
        ("spmm_mean", "torch_csr", lambda f: (lambda x: f(gi, x)), [x]),
        ("spmm_norm", "torch",
         lambda f: (lambda d, x, b, r: f(gi, d, d, x.reshape(n, 6), b, "relu", r)),
         [d, x, bias, res]),
        ("sddmm_add", "torch", lambda f: (lambda a, b: f(gi, a, b)), [el, er]),
        ("edge_softmax", "torch", lambda f: (lambda s: f(gi, s)), [w]),
    ]
    for primitive, ref_impl, call, inputs in cases:
        compare(primitive, call(impls.IMPLEMENTATIONS[primitive]), call(get(primitive, ref_impl)),
                inputs)
    impls.register("triton_check")
    assert get("spmm", "triton_check") is impls.spmm_triton


CHECKS = {name[len("check_"):]: fn for name, fn in list(globals().items())
          if name.startswith("check_")}
# under the interpreter (time) some checks run in one worker only; every kernel still runs in
# both: the static run (strict interpreter) has the float64 gradchecks of the SpMM and the GAT
# (forward and backward kernels) and the plain SpMM (int64 indices too); the dynamic run (the
# form compiled for a GPU) compares the float32 gradients of every epilogue and of the GAT, the
# calling conventions and the GPU check's widths. On a GPU every check runs in both.
SKIPPED = "skipped: runs in the other worker under the interpreter"
STATIC_ONLY = {"spmm_gradcheck", "gat_gradcheck", "spmm_plain", "gat_split_gradcheck"}
DYNAMIC_ONLY = {"spmm_fused_grads", "gat", "model_widths", "registry_calls"}


# -- the worker ------------------------------------------------------------------------------------
def _strict_interpreter():
    """Make the interpreter turn a tensor into a Python integer only from a 0-dimensional array,
    as numpy >= 2.5 does (older Triton's interpreter converted the loaded 1-element array)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def index(self):
        data = self.handle.data
        if getattr(data, "ndim", 0) != 0:
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
        return int(data)

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", index)

    interpreter._patch_lang_tensor = patched


def _hazard_kernel_fails():
    """Whether a row sum whose loop bound is loaded from memory fails (the hazard)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rowsum(indptr, vals, out):
        r = tl.program_id(0)
        acc = 0.0
        for j in range(tl.load(indptr + r), tl.load(indptr + r + 1)):
            acc += tl.load(vals + j)
        tl.store(out + r, acc)

    out = torch.zeros(2)
    try:
        rowsum[(2,)](torch.tensor([0, 2, 3]), torch.ones(3), out)
    except Exception as ex:       # the interpreter wraps the TypeError
        return "0-dimensional" in str(ex) or "0-dimensional" in repr(ex.__cause__)
    return False


def worker(mode, dev):
    import time

    from granii.kernels.triton import gat_kernels, spmm_kernels
    from granii.kernels.triton.launch import recording
    spmm_kernels.SEG = 8        # the small skewed graph's hub row then spans several work items
    gat_kernels.SEG = 8         # likewise for the fused GAT (its rows of A and of A^T)
    results = {}
    if mode == "static" and dev == "cpu":
        _strict_interpreter()
        results["strict_catches_hazard"] = None if _hazard_kernel_fails() else \
            "the strict interpreter ran a loop bound loaded from memory"
    with recording() as launched:
        for name, fn in CHECKS.items():
            if dev == "cpu" and mode == "dynamic" and name in STATIC_ONLY or \
                    dev == "cpu" and mode == "static" and name in DYNAMIC_ONLY:
                results[name] = SKIPPED     # run in the other worker (interpreter time)
                continue
            t0 = time.perf_counter()
            try:
                fn(dev)
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc(limit=6)
            print(f"{mode} {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return {"results": results, "signatures": sorted(launched)}


def _start_worker(mode):
    env = dict(os.environ, GRANII_TRITON_LOOPS=mode, PYTHONPATH=ROOT,
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", mode, DEVICE],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(mode, proc):
    out, err = proc.communicate(timeout=600)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker ({mode}) failed, rc {proc.returncode}:\n{err[-4000:]}")
    return json.loads(lines[-1])


def _flags(sig):
    return sum(1 for name, value in sig[3] if value is True)


def representative(signatures):
    """Per kernel and loop form (``BOUND`` 0 or not), the float32 launches with the most and the
    fewest optional parts (bias, residual, weights, ...): what ``test_compiles_for_gpu`` compiles
    (every signature would take a minute of CPU)."""
    groups = {}
    for sig in signatures:
        if any(t == "*fp64" for _, t in sig[2]):
            continue
        consts = dict(sig[3])
        bound = consts.get("BOUND")
        key = (sig[1], None if bound is None else bound == 0, consts.get("SEGMENTED"))
        groups.setdefault(key, []).append(sig)
    chosen = []
    for sigs in groups.values():
        sigs = sorted(sigs, key=lambda s: (_flags(s), json.dumps(s)))
        chosen.append(sigs[-1])
        if _flags(sigs[0]) != _flags(sigs[-1]):
            chosen.append(sigs[0])
    # and the launches at the GPU check's widths (128 features; 8 heads x 16), once each
    wide = {}
    for sig in signatures:
        consts = dict(sig[3])
        if any(t == "*fp64" for _, t in sig[2]) or consts.get("BOUND", 0) != 0 and \
                not consts.get("SEGMENTED"):
            continue
        if consts.get("BLOCK_F") == 128 or consts.get("DIM") == 16 or consts.get("BLOCK_H") == 8:
            wide.setdefault((sig[1], consts.get("SEGMENTED")), sig)
    return chosen + [s for s in wide.values() if s not in chosen]


def _skip_reason():
    if not available():
        try:
            import triton
            return f"Triton {triton.__version__} is older than 3.0 (its interpreter is not usable)"
        except Exception as ex:
            return f"Triton cannot be imported: {ex}"
    if DEVICE != "cpu" and not torch.cuda.is_available():
        return f"GRANII_TRITON_DEVICE={DEVICE} but no CUDA device"
    return None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _start_small(out):
    """``bench/gpu_check.py --small`` (the GPU check's own CPU form) into ``out``."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT,
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("GRANII_TRITON_LOOPS", None)
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"),
                             "--small", "--skip-checks", "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both workers' results, and on the CPU the GPU check's ``--small`` run (side by side)."""
    procs = {mode: _start_worker(mode) for mode in MODES}
    small = None
    if DEVICE == "cpu":
        out = tmp_path_factory.mktemp("gpu_check")
        small = (out, _start_small(out))
    results = {mode: _result(mode, proc) for mode, proc in procs.items()}
    if small is not None:
        out, proc = small
        log = proc.communicate(timeout=600)[0]
        results["small"] = (proc.returncode, log, out)
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_kernels(runs, mode, check):
    error = runs[mode]["results"][check]
    if error == SKIPPED:
        pytest.skip(f"{check}: {SKIPPED}")
    assert error is None, f"{check} ({mode} loop bounds, {DEVICE}):\n{error}"


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's hazard is a CPU matter")
def test_strict_catches_hazard(runs):
    """The strict interpreter of the ``static`` run refuses what older Triton on numpy >= 2.5
    refused, so the ``static`` run passing means the kernels avoid it."""
    error = runs["static"]["results"]["strict_catches_hazard"]
    assert error is None, error


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the kernels were compiled by running them")
def test_compiles_for_gpu(runs):
    """The interpreted checks' launches (``representative``) compile for sm_90 (PTX and cubin):
    every kernel in both loop forms."""
    sigs = representative(runs["static"]["signatures"] + runs["dynamic"]["signatures"])
    kernels = {s[1] for s in sigs}
    assert len(kernels) == 10, kernels
    assert {dict(s[3]).get("BOUND") == 0 for s in sigs if "BOUND" in dict(s[3])} == {True, False}
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile"],
                          input=json.dumps(sigs), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"compiled {len({json.dumps(s) for s in sigs})}" in proc.stdout


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU check itself runs on the GPU")
def test_gpu_check_small(runs):
    """``bench/gpu_check.py --small`` (interpreter, a 16-node power-law graph) writes its report
    and CSV; every Triton cell agrees with cuSPARSE, PyG's scatter or PyG's eager models (outputs,
    the first training step's loss and every parameter's gradient), and nothing fails."""
    import csv
    rc, log, out = runs["small"]
    assert rc == 0, log[-4000:]
    report = (out / "report.md").read_text()
    for title in ("## Kernels", "## 2-layer models"):
        assert title in report
    with open(out / "gpu_check.csv") as f:
        rows = list(csv.DictReader(f))
    assert not [r for r in rows if r["ok"] == "NO" or r["note"].startswith("error")], rows
    plan = {(r["name"], r["mode"]): r for r in rows if r["variant"] == "triton-plan"}
    assert set(plan) == {(m, mode) for m in ("gcn", "sage", "gat")
                         for mode in ("inference", "training")}
    assert all(r["ok"] == "yes" and r["note"] == "vs eager" for r in plan.values()), plan
    kernels = {(r["name"], r["variant"], r["mode"]): r["ok"] for r in rows
               if r["section"] == "kernels"}
    for key in (("spmm k=4", "triton-rows", "forward"), ("spmm k=4", "triton-segments", "forward"),
                ("spmm k=4", "triton", "fwd+bwd"), ("gat h=2 d=4", "torch-edges", "fwd+bwd")):
        assert kernels.get(key) == "yes", (key, kernels)


def _compile_main():
    from granii.kernels.triton.launch import compile_signatures

    def tup(x):
        return tuple(tup(i) for i in x) if isinstance(x, list) else x
    sigs = {tup(s) for s in json.loads(sys.stdin.read())}
    print(f"compiled {compile_signatures(sorted(sigs, key=repr))}")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3])))
    elif sys.argv[1] == "--compile":
        _compile_main()
