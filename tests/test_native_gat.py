"""The fused GAT primitive ``gat_aggregate`` (native, dgl, torch) and the native ``sddmm_add`` and
``edge_softmax`` (``granii/kernels/native_gat.py``, ``csrc/gat.cpp``): outputs and gradients against
a dense float64 reference and DGL's GATConv on random graphs, a real graph, rows without in-edges,
one huge row, self-loops, duplicate edges and sampled blocks; float32 (the vectorised paths) and
float64; 1 and 8 heads and other widths; edge weights; gradcheck; 1 and 2 threads."""
import dgl
import pytest
import torch
import torch.nn.functional as F

from granii import kernels
from granii.datasets import load_graph
from granii.graph import graph_info
from granii.kernels import native, native_gat
from granii.kernels.registry import get

needs_native = pytest.mark.skipif(not native_gat.available(), reason="native kernels not built")


# -- graphs --------------------------------------------------------------------------------------
def _random():
    return dgl.rand_graph(40, 240)


def _empty_rows():
    gen = torch.Generator().manual_seed(1)
    u = torch.randint(0, 50, (160,), generator=gen)
    v = torch.randint(0, 20, (160,), generator=gen)        # 30 destinations without in-edges
    return dgl.graph((u, v), num_nodes=50)


def _huge_row():
    """Node 3 receives 600 of 700 edges; edges in random order."""
    gen = torch.Generator().manual_seed(2)
    u = torch.randint(0, 60, (700,), generator=gen)
    v = torch.cat([torch.full((600,), 3), torch.randint(0, 60, (100,), generator=gen)])
    perm = torch.randperm(700, generator=gen)
    return dgl.graph((u[perm], v[perm]), num_nodes=60)


def _loops_and_duplicates():
    gen = torch.Generator().manual_seed(3)
    u = torch.randint(0, 30, (120,), generator=gen)
    v = torch.randint(0, 30, (120,), generator=gen)
    loops = torch.arange(30)
    return dgl.graph((torch.cat([u, u[:40], loops]), torch.cat([v, v[:40], loops])), num_nodes=30)


def _dst_sorted():
    """Edge ids in the order of the CSR of A (so its edge-id array is the identity)."""
    gen = torch.Generator().manual_seed(4)
    u = torch.randint(0, 35, (200,), generator=gen)
    v = torch.randint(0, 35, (200,), generator=gen)
    order = torch.argsort(v * 35 + u)
    return dgl.graph((u[order], v[order]), num_nodes=35)


def _block():
    dgl.seed(5)
    g = dgl.rand_graph(80, 600)
    seeds = torch.arange(15)
    blk = dgl.to_block(dgl.sampling.sample_neighbors(g, seeds, 6), seeds)
    assert blk.num_src_nodes() > blk.num_dst_nodes()
    return blk


def _cora():
    """The subgraph of Cora on its first 300 nodes (the dense reference is destination x edge)."""
    return dgl.node_subgraph(load_graph("cora"), torch.arange(300), store_ids=False)


GRAPHS = {"random": _random, "empty_rows": _empty_rows, "huge_row": _huge_row,
          "loops_and_duplicates": _loops_and_duplicates, "dst_sorted": _dst_sorted,
          "block": _block, "cora": _cora}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def graph(request):
    torch.manual_seed(0)
    return GRAPHS[request.param]()


def test_graph_kinds():
    """The graphs hold what their names say."""
    assert (_empty_rows().in_degrees() == 0).sum() == 30
    assert _huge_row().in_degrees()[3] == 600
    g = _loops_and_duplicates()
    u, v = g.edges()
    assert (u == v).sum() >= 30 and len(set(zip(u.tolist(), v.tolist()))) < g.num_edges()
    sorted_g, random_g = _dst_sorted(), _random()
    assert native.csr_index(graph_info(sorted_g), "a").eids is None
    assert native.csr_index(graph_info(random_g), "a").eids is not None


# -- references --------------------------------------------------------------------------------------
def dense_reference(g, el, er, feat, slope, w=None):
    """``gat_aggregate`` from a dense (destination x edge) score matrix, softmax per row."""
    u, v = g.edges(order="eid")
    n_dst, n_e = g.num_dst_nodes(), g.num_edges()
    z = F.leaky_relu(el.reshape(el.shape[0], -1)[u] + er.reshape(er.shape[0], -1)[v], slope)   # (E, H)
    member = torch.zeros(n_dst, n_e, dtype=torch.bool)
    member[v, torch.arange(n_e)] = True
    scores = torch.where(member[None], z.t()[:, None, :], torch.tensor(-float("inf"), dtype=z.dtype))
    a = torch.softmax(scores, dim=-1).nan_to_num(0.0)             # (H, n_dst, E); empty rows -> 0
    if w is not None:      # one weight per edge (E,), or per edge and head (E, H)
        a = a * w.reshape(n_e, -1).t()[:, None, :]
    return torch.einsum("hve,ehf->vhf", a, feat[u])


def _inputs(g, heads, width, dtype, weighted, seed=0):
    gen = torch.Generator().manual_seed(seed)
    el = torch.randn(g.num_src_nodes(), heads, 1, generator=gen, dtype=dtype)
    er = torch.randn(g.num_dst_nodes(), heads, 1, generator=gen, dtype=dtype)
    feat = torch.randn(g.num_src_nodes(), heads, width, generator=gen, dtype=dtype)
    shape = (g.num_edges(), heads) if weighted == "head" else (g.num_edges(),)
    w = (torch.rand(shape, generator=gen, dtype=dtype) + 0.1) if weighted else None
    return el, er, feat, w


def _compare(fn, g, heads, width, dtype, weighted, slope=0.2, tol=None, bias=False):
    """``fn`` against the dense float64 reference in the output and the gradients of every input
    (with ``bias``: a bias of ``heads * width`` values passed to ``fn``, added to the reference)."""
    el, er, feat, w = _inputs(g, heads, width, dtype, weighted)
    b = torch.randn(heads * width, generator=torch.Generator().manual_seed(7), dtype=dtype) if bias else None
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (el, er, feat, w, b)]
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in (el, er, feat, w, b)]
    y = fn(graph_info(g), *leaves[:3], slope, leaves[3], **({"bias": leaves[4]} if bias else {}))
    y_ref = dense_reference(g, *leaves64[:3], slope, leaves64[3])
    if bias:
        y_ref = y_ref + leaves64[4].reshape(heads, width)
    assert y.dtype == dtype and y.shape == (g.num_dst_nodes(), heads, width)
    atol = tol or (1e-5 if dtype == torch.float32 else 1e-10)
    torch.testing.assert_close(y.double(), y_ref, atol=atol, rtol=atol)
    gy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    live = [i for i, t in enumerate(leaves) if t is not None]
    got = torch.autograd.grad(y, [leaves[i] for i in live], gy.to(dtype))
    want = torch.autograd.grad(y_ref, [leaves64[i] for i in live], gy)
    for i, a, b in zip(live, got, want):
        torch.testing.assert_close(a.double(), b, atol=atol * 10, rtol=atol * 10,
                                   msg=lambda m: f"gradient of input {i}: {m}")


IMPLS = ["native", "dgl", "torch"]


def test_registry():
    assert set(IMPLS) <= set(kernels.implementations("gat_aggregate")) or not native_gat.available()
    assert {"dgl", "torch"} <= set(kernels.implementations("gat_aggregate"))
    for impl in kernels.implementations("gat_aggregate"):
        assert kernels.get("gat_aggregate", impl).__doc__
    if native_gat.available():
        assert kernels.get("gat_aggregate", "native") is native_gat.gat_fused_native
        assert "native" in kernels.implementations("sddmm_add")
        assert "native" in kernels.implementations("edge_softmax")


@pytest.mark.parametrize("edge_weight", [False, True])
def test_fused_plan_with_attention_dropout_draws_dgls_mask(edge_weight):
    """GATConv in training with feature and attention dropout: the fused plan (``gat_aggregate``
    with the dropout mask drawn on ones) gives DGL's output and gradients under the same seed,
    with every implementation of the fused step, on three seeds in a row."""
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.runtime.variants import run_plan
    from granii.plan import step_impls
    g = _random()
    torch.manual_seed(0)
    conv = dgl.nn.GATConv(12, 6, 4, feat_drop=0.3, attn_drop=0.5, allow_zero_in_degree=True)
    conv.train()
    x = torch.randn(g.num_nodes(), 12)
    w = torch.rand(g.num_edges()) + 0.1
    args = (g, x, w) if edge_weight else (g, x)
    call = prepare(new_state(conv), conv, args, {})
    assert not isinstance(call, str), call
    fused = [p for p in call.compiled.plans if "gat_aggregate" in p.composition()]
    assert fused, [p.composition() for p in call.compiled.plans]
    for plan in fused:
        prims = [s.prim for s in plan.steps]
        assert "edge_mask" in prims and "add" not in prims, prims   # the bias is the kernel's
        at = prims.index("gat_aggregate")
        assert plan.steps[at].args[-1] == "bias", plan.steps[at].args
        base = [step_impls(s)[0] for s in plan.steps]
        for impl in step_impls(plan.steps[at]):
            impls = tuple(base[:at] + [impl] + base[at + 1:])
            for seed in range(3):
                torch.manual_seed(seed)
                want = conv(*args)
                gw = torch.autograd.grad(want.square().sum(), list(conv.parameters()))
                torch.manual_seed(seed)
                got = run_plan(call, plan, impls)
                gg = torch.autograd.grad(got.square().sum(), list(conv.parameters()))
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
                for a, b in zip(gg, gw):
                    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _impl(name):
    if name == "native" and not native_gat.available():
        pytest.skip("native kernels not built")
    return kernels.get("gat_aggregate", name)


# -- gat_aggregate against the dense reference ---------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads,width,weighted", [(1, 8, False), (1, 32, True), (8, 8, False),
                                                  (8, 8, True), (4, 16, True), (3, 5, True),
                                                  (8, 8, "head"), (3, 5, "head")])
def test_gat_aggregate_float32(graph, impl, heads, width, weighted):
    _compare(_impl(impl), graph, heads, width, torch.float32, weighted)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads,width", [(1, 8), (8, 8), (2, 3)])
def test_gat_aggregate_float64(graph, impl, heads, width):
    _compare(_impl(impl), graph, heads, width, torch.float64, True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads,width,dtype", [(1, 8, torch.float32), (8, 8, torch.float32),
                                               (3, 5, torch.float32), (4, 64, torch.float32),
                                               (2, 3, torch.float64)])
def test_gat_aggregate_with_bias(graph, impl, heads, width, dtype):
    """The bias epilogue: every row gets ``bias`` (rows without in-edges only it), and the
    attention gradients are those of the sum without it."""
    _compare(_impl(impl), graph, heads, width, dtype, True, bias=True)


@needs_native
@pytest.mark.parametrize("heads,width", [(4, 256), (16, 4), (8, 16), (2, 64), (5, 40), (1, 32),
                                         (1, 128)])
@pytest.mark.parametrize("weighted", [True, "head"])
def test_native_widths(heads, width, weighted):
    """Each inner-loop variant: wide tiles, narrow heads (H in {4, 8, 16}, F <= 16), one head,
    other widths; one weight per edge or per edge and head."""
    for g in (_huge_row(), _empty_rows()):
        _compare(native_gat.gat_fused_native, g, heads, width, torch.float32, weighted, slope=0.1,
                 tol=2e-5)


@needs_native
def test_native_slopes():
    g = _random()
    for slope in (0.0, 1.0, 3.0):
        _compare(native_gat.gat_fused_native, g, 8, 8, torch.float32, False, slope=slope)


@needs_native
def test_native_large_scores_do_not_overflow():
    g = _huge_row()
    el, er, feat, _ = _inputs(g, 8, 8, torch.float32, False)
    gi = graph_info(g)
    y = native_gat.gat_fused_native(gi, el * 200, er * 200, feat, 0.2)
    y_ref = dense_reference(g, el.double() * 200, er.double() * 200, feat.double(), 0.2)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)


@needs_native
def test_zero_in_degree_rows_are_zero_with_zero_gradient():
    g = _empty_rows()
    el, er, feat, w = _inputs(g, 4, 8, torch.float32, True)
    er.requires_grad_()
    y = native_gat.gat_fused_native(graph_info(g), el, er, feat, 0.2, w)
    empty = g.in_degrees() == 0
    assert (y[empty] == 0).all() and (y[~empty] != 0).any()
    (ger,) = torch.autograd.grad(y.sum(), er)
    assert (ger[empty] == 0).all()


@needs_native
@pytest.mark.parametrize("nodes", [5, 0])
def test_graph_without_edges(nodes):
    g = dgl.graph((torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)), num_nodes=nodes)
    gi = graph_info(g)
    el, er, feat, _ = (t.requires_grad_() if t is not None else t
                       for t in _inputs(g, 2, 4, torch.float32, False))
    y = native_gat.gat_fused_native(gi, el, er, feat, 0.2)
    assert y.shape == (nodes, 2, 4) and not y.any()
    grads = torch.autograd.grad(y.sum(), (el, er, feat))
    assert all(not t.any() for t in grads)
    assert native_gat.edge_softmax_native(gi, torch.randn(0, 2)).shape == (0, 2)
    assert native_gat.sddmm_add_native(gi, el, er).shape == (0, 2, 1)


@pytest.mark.parametrize("impl", ["torch", "dgl"])
@pytest.mark.parametrize("mask", ["per edge", "per edge and head"])
def test_a_graph_without_edges_takes_an_edge_weight_or_dropout_mask(impl, mask):
    """The fused step's edge weight (an attention dropout mask: one value per edge and head) on a
    graph with no edge: a zero result, not a reshape error."""
    g = dgl.graph((torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)),
                  num_nodes=4)
    gi = graph_info(g)
    el, er, feat, _ = _inputs(g, 2, 3, torch.float32, False)
    w = torch.ones(0) if mask == "per edge" else torch.ones(0, 2)
    y = get("gat_aggregate", impl)(gi, el, er, feat, 0.2, w)
    assert y.shape == (4, 2, 3) and not y.any()


# -- against DGL's GATConv ------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", [1, 8])
def test_matches_dgl_gatconv(graph, impl, heads):
    """GATConv's output (no bias, residual or activation) and its gradients in the input features,
    the projection and attention parameters and the edge weights, from ``gat_aggregate``."""
    fn = _impl(impl)
    torch.manual_seed(0)
    conv = dgl.nn.GATConv(12, 8, heads, negative_slope=0.15, bias=False, allow_zero_in_degree=True)
    x = torch.randn(graph.num_src_nodes(), 12, requires_grad=True)
    w = (torch.rand(graph.num_edges()) + 0.1).requires_grad_()
    y_dgl = conv(graph, x, edge_weight=w)
    params = [x, w, conv.fc.weight, conv.attn_l, conv.attn_r]
    g_dgl = torch.autograd.grad(y_dgl.square().sum(), params)

    feat = conv.fc(x).view(-1, heads, 8)
    el = (feat * conv.attn_l).sum(-1)
    er = (feat[:graph.num_dst_nodes()] * conv.attn_r).sum(-1)
    y = fn(graph_info(graph), el, er, feat, 0.15, w)
    g_ours = torch.autograd.grad(y.square().sum(), params)
    torch.testing.assert_close(y, y_dgl, atol=1e-5, rtol=1e-4)
    for a, b in zip(g_ours, g_dgl):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_dgl_gatconv_on_cora(impl):
    """The whole of Cora (with its self-loops), 8 heads of 8 as in DGL's GAT example."""
    fn = _impl(impl)
    g = load_graph("cora")
    torch.manual_seed(0)
    conv = dgl.nn.GATConv(32, 8, 8, bias=False)
    x = torch.randn(g.num_nodes(), 32, requires_grad=True)
    y_dgl = conv(g, x)
    params = [x, conv.fc.weight, conv.attn_l, conv.attn_r]
    g_dgl = torch.autograd.grad(y_dgl.square().sum(), params)
    feat = conv.fc(x).view(-1, 8, 8)
    y = fn(graph_info(g), (feat * conv.attn_l).sum(-1), (feat * conv.attn_r).sum(-1), feat, 0.2)
    g_ours = torch.autograd.grad(y.square().sum(), params)
    torch.testing.assert_close(y, y_dgl, atol=1e-5, rtol=1e-4)
    for a, b in zip(g_ours, g_dgl):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# -- gradcheck ----------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("name", ["empty_rows", "loops_and_duplicates", "block"])
def test_gradcheck(name):
    g = GRAPHS[name]()
    gi = graph_info(g)
    el, er, feat, w = (t.requires_grad_() for t in _inputs(g, 2, 3, torch.float64, True))
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda el, er, feat, w: native_gat.gat_fused_native(gi, el, er, feat, 0.2, w),
        (el, er, feat, w))
    assert torch.autograd.gradcheck(
        lambda el, er, feat, w, b: native_gat.gat_fused_native(gi, el, er, feat, 0.2, w, b),
        (el, er, feat, w, bias))
    a = torch.randn(g.num_src_nodes(), 2, 1, dtype=torch.float64, requires_grad=True)
    b = torch.randn(g.num_dst_nodes(), 2, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: native_gat.sddmm_add_native(gi, a, b), (a, b))
    e = torch.randn(g.num_edges(), 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda e: native_gat.edge_softmax_native(gi, e), (e,))


@needs_native
def test_second_derivative_raises():
    g = _random()
    el, er, feat, _ = (t.requires_grad_() if t is not None else t for t in _inputs(g, 2, 3, torch.float64, False))
    y = native_gat.gat_fused_native(graph_info(g), el, er, feat, 0.2)
    (gf,) = torch.autograd.grad(y.square().sum(), feat, create_graph=True)
    with pytest.raises(RuntimeError):
        gf.sum().backward()


# -- index types, threads --------------------------------------------------------------------------------
@needs_native
def test_int64_indices_give_the_int32_results():
    g = _huge_row()
    gi = graph_info(g)
    el, er, feat, w = _inputs(g, 8, 16, torch.float32, True)
    el, er = el.reshape(-1, 8), er.reshape(-1, 8)
    a = native_gat._csr(gi, "a")
    at = native_gat._csr(gi, "at")
    assert a[0].dtype == torch.int32
    wide = lambda t: None if t is None else t.long()
    ops = native_gat._OPS
    out32 = ops.gat_forward(*a, el, er, feat, w, 0.2)
    out64 = ops.gat_forward(*map(wide, a), el, er, feat, w, 0.2)
    for x, y in zip(out32, out64):
        torch.testing.assert_close(x, y)
    dout = torch.randn_like(out32[0])
    args = (el, er, feat, w, 0.2, *out32[1:], out32[0], dout, True, True, True, True)
    g32 = ops.gat_backward(a[0], native_gat._t2in(gi), *at, *args)
    g64 = ops.gat_backward(a[0].long(), native_gat._t2in(gi).long(), *map(wide, at), *args)
    for x, y in zip(g32, g64):
        torch.testing.assert_close(x, y)


@needs_native
@pytest.mark.parametrize("heads,width", [(8, 8), (4, 64), (3, 20)])
def test_thread_counts(heads, width):
    """One and two threads give the same results (the graphs are large enough to go parallel)."""
    g = dgl.add_self_loop(dgl.rand_graph(400, 6000))
    before = torch.get_num_threads()
    results = {}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.ops.granii.parallel_threads() == t
            for name, graph in (("random", g), ("huge_row", _huge_row())):
                el, er, feat, w = (x.requires_grad_() for x in _inputs(graph, heads, width, torch.float32, True))
                gi = graph_info(graph)
                y = native_gat.gat_fused_native(gi, el, er, feat, 0.2, w)
                e = native_gat.edge_softmax_native(gi, native_gat.sddmm_add_native(gi, el, er))
                grads = torch.autograd.grad(y.square().sum() + e.square().sum(), [el, er, feat, w])
                results[t, name] = [y, e, *grads]
    finally:
        torch.set_num_threads(before)
    for name in ("random", "huge_row"):
        for a, b in zip(results[1, name], results[2, name]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- sddmm_add and edge_softmax ------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("shapes", [((3, 1), (3, 1)), ((4,), (4,)), ((2, 3), (1, 3)), ((), ())])
def test_sddmm_add_native(graph, shapes):
    gi = graph_info(graph)
    a = torch.randn(graph.num_src_nodes(), *shapes[0], requires_grad=True)
    b = torch.randn(graph.num_dst_nodes(), *shapes[1], requires_grad=True)
    y = native_gat.sddmm_add_native(gi, a, b)
    y_ref = kernels.get("sddmm_add", "dgl")(gi, a, b)
    torch.testing.assert_close(y, y_ref)
    gy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, (a, b), gy), torch.autograd.grad(y_ref, (a, b), gy)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("tail", [(), (4,), (3, 1)])
def test_edge_softmax_native(graph, tail):
    gi = graph_info(graph)
    e = (torch.randn(graph.num_edges(), *tail) * 3).requires_grad_()
    y = native_gat.edge_softmax_native(gi, e)
    y_ref = kernels.get("edge_softmax", "dgl")(gi, e)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    gy = torch.randn_like(y)
    (got,), (want,) = torch.autograd.grad(y, e, gy), torch.autograd.grad(y_ref, e, gy)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_shape_errors():
    g = _random()
    gi = graph_info(g)
    el, er, feat, _ = _inputs(g, 4, 8, torch.float32, False)
    for impl in kernels.implementations("gat_aggregate"):
        fn = kernels.get("gat_aggregate", impl)
        with pytest.raises(ValueError):
            fn(gi, el, er, feat[:, :, 0], 0.2)
        with pytest.raises(ValueError):
            fn(gi, el[:, :2], er, feat, 0.2)
        with pytest.raises(ValueError):
            fn(gi, el, er, feat, 0.2, torch.ones(3))
