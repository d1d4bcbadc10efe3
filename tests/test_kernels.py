"""Every (primitive, implementation) of the kernel registry against dense or per-edge references,
in outputs and in gradients, on directed, undirected, zero-in-degree, weighted multi- and block graphs."""
import copy

import dgl
import pytest
import torch

from granii import kernels
from granii.graph import graph_info

ATOL = RTOL = 1e-4


def _directed():
    return dgl.rand_graph(30, 150)


def _undirected():
    return dgl.to_bidirected(dgl.rand_graph(25, 50))


def _zero_in():
    # destinations only among the first 12 of 30 nodes: 18 nodes have no in-edges
    u = torch.randint(0, 30, (90,))
    v = torch.randint(0, 12, (90,))
    return dgl.graph((u, v), num_nodes=30)


def _weighted():
    # a multigraph (repeated u -> v pairs) with positive edge weights
    u = torch.randint(0, 20, (60,))
    v = torch.randint(0, 20, (60,))
    g = dgl.graph((torch.cat([u, u[:15]]), torch.cat([v, v[:15]])), num_nodes=20)
    g.edata["w"] = torch.rand(g.num_edges()) + 0.1
    return g


def _block():
    g = dgl.rand_graph(60, 400)
    seeds = torch.arange(12)
    frontier = dgl.sampling.sample_neighbors(g, seeds, 5)
    return dgl.to_block(frontier, seeds)


GRAPHS = {"directed": _directed, "undirected": _undirected, "zero_in": _zero_in,
          "weighted": _weighted, "block": _block}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def graph(request):
    torch.manual_seed(0)
    dgl.seed(0)
    g = GRAPHS[request.param]()
    if g.is_block:
        assert g.num_src_nodes() != g.num_dst_nodes()
    return g


def _edge_values(g, *tail):
    if "w" in g.edata and not tail:
        return g.edata["w"].clone()
    return torch.rand(g.num_edges(), *tail) + 0.1


def _dense(g, w=None):
    """``A_w`` as a dense ``(num_dst, num_src, *w.shape[1:])`` tensor; duplicate edges add up."""
    u, v = g.edges(order="eid")
    w = torch.ones(g.num_edges(), dtype=torch.float64) if w is None else w
    a = torch.zeros(g.num_dst_nodes(), g.num_src_nodes(), *w.shape[1:], dtype=w.dtype)
    return a.index_put((v, u), w, accumulate=True)


def _check(fn, ref, inputs, graph_arg=None):
    """``fn(*inputs)`` against ``ref(*inputs_in_float64)`` in values and in all input gradients."""
    leaves = [t.detach().float().requires_grad_() if t is not None else None for t in inputs]
    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    args = (graph_arg,) if graph_arg is not None else ()
    y = fn(*args, *leaves)
    y_ref = ref(*leaves64)
    assert y.shape == y_ref.shape
    torch.testing.assert_close(y.double(), y_ref, atol=ATOL, rtol=RTOL)
    gy = torch.randn_like(y_ref)
    live = [t for t in leaves if t is not None]
    live64 = [t for t in leaves64 if t is not None]
    grads = torch.autograd.grad(y, live, gy.float(), allow_unused=True)
    grads_ref = torch.autograd.grad(y_ref, live64, gy, allow_unused=True)
    for got, want, t in zip(grads, grads_ref, live64):
        want = torch.zeros_like(t) if want is None else want
        got = torch.zeros_like(t) if got is None else got
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


def _impls(primitive):
    return [(primitive, i) for i in kernels.implementations(primitive)]


def test_registry():
    expected = {
        "gemm": {"torch"}, "row_scale": {"torch"},
        "spmm": {"dgl", "torch_csr"}, "spmm_weighted": {"dgl", "torch_csr"},
        "spmm_mean": {"dgl", "torch_csr"}, "spmm_max": {"dgl"},
        "sddmm_scale": {"dgl", "torch"}, "sddmm_add": {"dgl", "torch"},
        "edge_softmax": {"dgl", "torch"},
    }
    for primitive, impls in expected.items():
        assert impls <= set(kernels.implementations(primitive))
        for impl in impls:
            assert kernels.get(primitive, impl) is kernels.REGISTRY[primitive][impl]
            assert kernels.get(primitive, impl).__doc__
    with pytest.raises(KeyError):
        kernels.get("spmm", "nope")
    with pytest.raises(ValueError):
        kernels.register("spmm", "dgl")(lambda gi, x: x)


@pytest.mark.parametrize("primitive,impl", _impls("gemm"))
def test_gemm(primitive, impl):
    torch.manual_seed(1)
    _check(kernels.get(primitive, impl), lambda x, w: x @ w, [torch.randn(7, 5), torch.randn(5, 3)])


@pytest.mark.parametrize("primitive,impl", _impls("gemm"))
@pytest.mark.parametrize("cols", [1, 2, 3, 8, 9, 16])
def test_gemm_with_a_narrow_row_major_weight(primitive, impl, cols):
    """A (k, 2..8) row-major weight is multiplied from a column-major copy: the same product,
    with and without an addend, and the gradient reaches the weight itself."""
    from granii.kernels.dense import column_major_if_narrow
    torch.manual_seed(cols)
    x = torch.randn(300, 40, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, cols, dtype=torch.float64, requires_grad=True)
    c = torch.randn(300, cols, dtype=torch.float64, requires_grad=True)
    moved = column_major_if_narrow(w)
    assert torch.equal(moved, w)
    assert moved.stride() == ((1, 40) if 2 <= cols <= 8 else w.stride())
    assert column_major_if_narrow(moved) is moved           # already column-major: no copy
    f = kernels.get(primitive, impl)
    for args, ref in (((x, w), lambda: x @ w), ((x, w, c), lambda: c + x @ w)):
        out = f(*args)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, args, g)
        want = torch.autograd.grad(ref(), args, g)
        torch.testing.assert_close(out, ref())
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("heads,width", [(1, 5), (4, 3), (8, 1)])
def test_head_dot_is_the_product_with_the_block_diagonal(heads, width):
    """``X blockdiag(a_1 .. a_H)`` per head, with the gradients of ``X`` and of ``a`` (through
    the block diagonal, as GAT's plans build it), in float64 with gradcheck."""
    torch.manual_seed(2)
    x = torch.randn(6, heads * width, dtype=torch.float64, requires_grad=True)
    a = torch.randn(heads, width, dtype=torch.float64, requires_grad=True)
    head_dot = kernels.get("head_dot", "torch")

    def via(fn):
        return lambda x, a: fn(x, torch.block_diag(*a.reshape(heads, width, 1)))
    got, want = via(head_dot)(x, a), via(torch.mm)(x, a)
    assert got.shape == (6, heads)
    torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(via(head_dot), (x, a))


@pytest.mark.parametrize("primitive,impl", _impls("row_scale"))
@pytest.mark.parametrize("tail", [(6,), (3, 4)])
def test_row_scale(primitive, impl, tail):
    torch.manual_seed(1)
    ref = lambda d, x: torch.einsum("i,i...->i...", d, x)
    _check(kernels.get(primitive, impl), ref, [torch.randn(9), torch.randn(9, *tail)])


@pytest.mark.parametrize("primitive,impl", _impls("spmm"))
@pytest.mark.parametrize("tail", [(6,), (3, 4)])
def test_spmm(graph, primitive, impl, tail):
    a = _dense(graph)
    ref = lambda x: torch.einsum("vu,u...->v...", a, x)
    _check(kernels.get(primitive, impl), ref, [torch.randn(graph.num_src_nodes(), *tail)],
           graph_info(graph))


@pytest.mark.parametrize("primitive,impl", _impls("spmm_weighted"))
@pytest.mark.parametrize("only", ["both", "w", "x"])
def test_spmm_weighted(graph, primitive, impl, only):
    w = _edge_values(graph)
    x = torch.randn(graph.num_src_nodes(), 6)
    ref = lambda w, x: _dense(graph, w) @ x
    fn = kernels.get(primitive, impl)
    gi = graph_info(graph)
    if only == "both":
        _check(fn, ref, [w, x], gi)
    elif only == "w":
        _check(lambda gi, w: fn(gi, w, x), lambda w: ref(w, x.double()), [w], gi)
    else:
        _check(lambda gi, x: fn(gi, w, x), lambda x: ref(w.double(), x), [x], gi)


@pytest.mark.parametrize("primitive,impl", _impls("spmm_weighted"))
@pytest.mark.parametrize("w_tail", [(3,), (3, 1)])
def test_spmm_weighted_heads(graph, primitive, impl, w_tail):
    w = _edge_values(graph, *w_tail)
    x = torch.randn(graph.num_src_nodes(), 3, 5)
    ref = lambda w, x: torch.einsum("vuh,uhk->vhk", _dense(graph, w.reshape(-1, 3)), x)
    _check(kernels.get(primitive, impl), ref, [w, x], graph_info(graph))


@pytest.mark.parametrize("primitive,impl", _impls("spmm_weighted"))
def test_spmm_weighted_heads_width_one(graph, primitive, impl):
    """``w`` ``(E, H)`` with ``x`` ``(n, H)``: one feature per head."""
    w = _edge_values(graph, 3)
    x = torch.randn(graph.num_src_nodes(), 3)
    ref = lambda w, x: torch.einsum("vuh,uh->vh", _dense(graph, w), x)
    _check(kernels.get(primitive, impl), ref, [w, x], graph_info(graph))


@pytest.mark.parametrize("primitive,impl", _impls("spmm_weighted"))
def test_spmm_weighted_shared_over_heads(graph, primitive, impl):
    """One value per edge, broadcast over the heads of ``x``."""
    w = _edge_values(graph)
    x = torch.randn(graph.num_src_nodes(), 3, 5)
    ref = lambda w, x: torch.einsum("vu,uhk->vhk", _dense(graph, w), x)
    _check(kernels.get(primitive, impl), ref, [w, x], graph_info(graph))


@pytest.mark.parametrize("primitive,impl", _impls("spmm_mean"))
def test_spmm_mean(graph, primitive, impl):
    a = _dense(graph)
    deg = a.sum(1).clamp(min=1)
    ref = lambda x: (a @ x) / deg[:, None]
    _check(kernels.get(primitive, impl), ref, [torch.randn(graph.num_src_nodes(), 6)],
           graph_info(graph))


def _max_reference(g):
    u, v = g.edges(order="eid")

    def ref(x):
        rows = []
        for node in range(g.num_dst_nodes()):
            src = u[v == node]
            rows.append(x[src].max(0).values if len(src) else torch.zeros_like(x[0]))
        return torch.stack(rows)
    return ref


@pytest.mark.parametrize("primitive,impl", _impls("spmm_max"))
def test_spmm_max(graph, primitive, impl):
    _check(kernels.get(primitive, impl), _max_reference(graph),
           [torch.randn(graph.num_src_nodes(), 6)], graph_info(graph))


@pytest.mark.parametrize("primitive,impl", _impls("sddmm_scale"))
@pytest.mark.parametrize("given,heads", [
    (given, heads) for given in ["dst,w,src", "w,src", "dst,w", "dst,src", "src", "dst", "w"]
    for heads in ([0, 2] if "w" in given else [0])])
def test_sddmm_scale(graph, primitive, impl, given, heads):
    u, v = graph.edges(order="eid")
    d_dst = torch.rand(graph.num_dst_nodes()) + 0.5 if "dst" in given else None
    d_src = torch.rand(graph.num_src_nodes()) + 0.5 if "src" in given else None
    w = _edge_values(graph, *((heads,) if heads else ())) if "w" in given else None
    names = [n for n, t in (("d_dst", d_dst), ("w", w), ("d_src", d_src)) if t is not None]

    def ref(*ts):
        t = dict(zip(names, ts))
        rows = []
        for e in range(graph.num_edges()):
            val = t["w"][e] if "w" in t else torch.ones((), dtype=torch.float64)
            if "d_src" in t:
                val = val * t["d_src"][u[e]]
            if "d_dst" in t:
                val = t["d_dst"][v[e]] * val
            rows.append(val)
        return torch.stack(rows)

    fn = kernels.get(primitive, impl)

    def call(gi, *ts):
        t = dict(zip(names, ts))
        return fn(gi, t.get("d_dst"), t.get("w"), t.get("d_src"))

    _check(call, ref, [t for t in (d_dst, w, d_src) if t is not None], graph_info(graph))


def test_sddmm_scale_all_none(graph):
    for impl in kernels.implementations("sddmm_scale"):
        out = kernels.get("sddmm_scale", impl)(graph_info(graph), None, None, None)
        torch.testing.assert_close(out, torch.ones(graph.num_edges()))


@pytest.mark.parametrize("primitive,impl", _impls("sddmm_add"))
@pytest.mark.parametrize("tail", [(2,), (2, 1)])
def test_sddmm_add(graph, primitive, impl, tail):
    u, v = graph.edges(order="eid")
    ref = lambda a, b: torch.stack([a[u[e]] + b[v[e]] for e in range(graph.num_edges())])
    _check(kernels.get(primitive, impl), ref,
           [torch.randn(graph.num_src_nodes(), *tail), torch.randn(graph.num_dst_nodes(), *tail)],
           graph_info(graph))


@pytest.mark.parametrize("primitive,impl", _impls("edge_softmax"))
@pytest.mark.parametrize("tail", [(), (2,), (2, 1)])
def test_edge_softmax(graph, primitive, impl, tail):
    _, v = graph.edges(order="eid")

    def ref(e):
        out = torch.zeros_like(e)
        for node in v.unique():
            idx = (v == node).nonzero().flatten()
            out = out.index_put((idx,), torch.softmax(e[idx], 0))
        return out

    scores = 3 * torch.randn(graph.num_edges(), *tail)
    _check(kernels.get(primitive, impl), ref, [scores], graph_info(graph))
    dgl_out = dgl.ops.edge_softmax(graph, scores)
    torch.testing.assert_close(kernels.get(primitive, impl)(graph_info(graph), scores), dgl_out,
                               atol=1e-6, rtol=1e-5)


def test_spmm_transpose_built_once(graph):
    gi = graph_info(graph)
    spmm = kernels.get("spmm", "torch_csr")
    seen = []
    for _ in range(2):
        x = torch.randn(graph.num_src_nodes(), 4, requires_grad=True)
        spmm(gi, x).sum().backward()
        seen.append(gi.cache[("torch_csr_unit", torch.float32)])
    assert seen[0] is seen[1]
    assert seen[0][1] is seen[1][1]  # A^T


def test_spmm_transpose_not_rebuilt(graph, monkeypatch):
    """After the first call, neither forward nor backward builds a CSR matrix."""
    gi = graph_info(graph)
    spmm = kernels.get("spmm", "torch_csr")
    x = torch.randn(graph.num_src_nodes(), 4, requires_grad=True)
    spmm(gi, x).sum().backward()
    built = []
    real = torch.sparse_csr_tensor
    monkeypatch.setattr(torch, "sparse_csr_tensor", lambda *a, **k: built.append(1) or real(*a, **k))
    spmm(gi, x).sum().backward()
    assert not built


def test_spmm_weighted_constant_cache(graph):
    gi = graph_info(graph)
    spmm_w = kernels.get("spmm_weighted", "torch_csr")
    w = _edge_values(graph)
    a = _dense(graph, w.double())
    entries = []
    for _ in range(2):
        x = torch.randn(graph.num_src_nodes(), 4, dtype=torch.float32, requires_grad=True)
        y = spmm_w(gi, w, x)
        y.sum().backward()
        torch.testing.assert_close(y.double(), a @ x.double(), atol=ATOL, rtol=RTOL)
        entries.append(gi.cache[("torch_csr_w", id(w))])
    assert entries[0] is entries[1]
    assert entries[0]["a"] is entries[1]["a"]
    assert entries[0]["at"] is not None and entries[0]["at"] is entries[1]["at"]

    w.mul_(2)  # in place: a new version, the cached matrices are stale
    x = torch.randn(graph.num_src_nodes(), 4)
    y = spmm_w(gi, w, x)
    torch.testing.assert_close(y.double(), 2 * a @ x.double(), atol=ATOL, rtol=RTOL)
    assert gi.cache[("torch_csr_w", id(w))] is not entries[0]

    w2 = w.clone()
    spmm_w(gi, w2, x)
    assert gi.cache[("torch_csr_w", id(w2))]["ref"]() is w2


def test_spmm_weighted_grad_not_cached(graph):
    gi = graph_info(graph)
    w = _edge_values(graph).requires_grad_()
    x = torch.randn(graph.num_src_nodes(), 4)
    kernels.get("spmm_weighted", "torch_csr")(gi, w, x).sum().backward()
    assert not any(isinstance(k, tuple) and k[0] == "torch_csr_w" and e["ref"]() is w
                   for k, e in gi.cache.items())
    assert w.grad is not None


def test_spmm_weighted_heads_mismatch(graph):
    w = _edge_values(graph, 3)
    x = torch.randn(graph.num_src_nodes(), 4, 2)
    with pytest.raises(ValueError):
        kernels.get("spmm_weighted", "torch_csr")(graph_info(graph), w, x)


def test_a_scaling_by_exactly_one_without_gradient_is_skipped():
    """GIN's ``(1 + eps) H`` with ``eps = 0`` fixed: the generated code passes ``H`` on, and
    scales whenever eps is not zero or is learned (its gradient needs the product)."""
    from dgl.nn import GINConv

    from granii import granii
    from granii.plan import is_one
    assert is_one(torch.ones(1)) and not is_one(torch.full((1,), 1.5))
    assert not is_one(torch.ones(1, requires_grad=True))
    g = dgl.add_self_loop(dgl.rand_graph(50, 200))
    x = torch.randn(50, 6)
    for learn in (False, True):
        layer = GINConv(torch.nn.Linear(6, 3), "sum", learn_eps=learn)
        want = layer(g, x)
        granii(layer, g, x)
        torch.testing.assert_close(layer(g, x), want)
        code = granii.explain(layer, file=open("/dev/null", "w"))
        assert "if is_one(scalar_eps) else row_scale" in code



def test_a_kept_scalar_follows_its_buffer():
    """``1 + eps`` of a fixed eps buffer is kept between calls (``plan.scalar``), and computed
    again when the buffer changes in place or is replaced: the layer's output follows DGL's."""
    from dgl.nn import GINConv

    from granii import granii
    from granii.plan import is_one, scalar
    layer = GINConv(torch.nn.Linear(6, 3), "sum", learn_eps=False)
    first = scalar(layer, "eps", 1.0, 1.0)
    assert scalar(layer, "eps", 1.0, 1.0) is first and is_one(first)
    g = dgl.rand_graph(50, 200)
    x = torch.randn(50, 6)
    ref = copy.deepcopy(layer)
    granii(layer, g, x)
    for change in (lambda m: m.eps.fill_(0.25),
                   lambda m: setattr(m, "eps", torch.full((1,), -0.5)),
                   lambda m: m.eps.zero_()):
        for m in (layer, ref):
            change(m)
        torch.testing.assert_close(layer(g, x), ref(g, x))
    with torch.no_grad():
        layer.eps.add_(2.0)
    assert not is_one(scalar(layer, "eps", 1.0, 1.0))

@pytest.mark.parametrize("shuffled", [False, True])
def test_torch_csr_index_read_from_the_native_index_is_dgls(shuffled):
    """torch's CSR products read their index from the native one of the graph (a new batch
    counts it from its edge list): the same entries, with the same DGL edge ids, as DGL's own
    in- and out-edge indices, for edges stored in destination order and for shuffled ones."""
    from granii.kernels import native, spmm
    if not native.available():
        pytest.skip("the native extension is not built")
    dgl.seed(3)
    g = dgl.rand_graph(300, 2500)
    if not shuffled:
        src, dst = g.edges()
        order = torch.argsort(dst * 300 + src)
        g = dgl.graph((src[order], dst[order]), num_nodes=300)
    gi = graph_info(g)
    made = spmm._from_native(gi, native)

    def entries(crow, col, perm):
        rows = torch.repeat_interleave(torch.arange(len(crow) - 1), (crow[1:] - crow[:-1]).long())
        return sorted(zip(rows.tolist(), col.long().tolist(), perm.long().tolist()))

    assert entries(*made["a"][:3]) == entries(*g.adj_tensors("csc"))
    assert entries(*made["at"][:3]) == entries(*g.adj_tensors("csr"))
    assert made["a"][3] == (300, 300) and made["a"][0].dtype == torch.int32
    x = torch.randn(300, 8)
    want = torch.zeros(300, 8).index_add_(0, g.edges()[1], x[g.edges()[0]])
    a, _ = spmm.unit_csr(graph_info(g))
    torch.testing.assert_close(a @ x, want)
