"""granii's native SpMM kernels (``granii/kernels/native.py``, ``csrc/spmm.cpp``): built where a
compiler exists; outputs and gradients against dense float64 references and DGL's ops on random
graphs, a real graph, empty rows, one huge row, self-loops, duplicate edges and sampled blocks; the
merge-path split of long rows; float32/float64, multi-head; gradcheck; 1 and 2 threads; forked
DataLoader workers; the fallback without the extension."""
import copy
import os
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

import dgl
import pytest
import torch

from granii import kernels
from granii.datasets import load_graph
from granii.graph import graph_info
from granii.kernels import native

ROOT = Path(__file__).resolve().parent.parent
COMPILER = shutil.which("c++") or shutil.which("g++")
needs_native = pytest.mark.skipif(not native.AVAILABLE, reason="native kernels not built")


def test_extension_built_where_a_compiler_exists():
    if not COMPILER:
        pytest.skip("no C++ compiler: the extension is optional")
    assert native.AVAILABLE, f"a compiler exists ({COMPILER}) but granii._native did not load: " \
                             f"{native.LOAD_ERROR}"
    import granii._native as mod
    assert mod.sources_sha[1:] == native.sources_sha(), \
        "granii._native is stale (built from other sources): run bash scripts/env.sh"
    for prim in ("spmm", "spmm_weighted", "spmm_mean", "spmm_norm"):
        assert "native" in kernels.implementations(prim)


# -- graphs --------------------------------------------------------------------------------------
def _random(seed=0):
    return dgl.rand_graph(40, 240)


def _empty_rows(seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 50, (160,), generator=gen)
    v = torch.randint(0, 20, (160,), generator=gen)        # 30 destinations without in-edges
    return dgl.graph((u, v), num_nodes=50)


def _huge_row(seed=0):
    """Node 3 receives 600 of 700 edges (a row longer than every part of the merge path)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 60, (700,), generator=gen)
    v = torch.cat([torch.full((600,), 3), torch.randint(0, 60, (100,), generator=gen)])
    perm = torch.randperm(700, generator=gen)
    return dgl.graph((u[perm], v[perm]), num_nodes=60)


def _loops_and_duplicates(seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 30, (120,), generator=gen)
    v = torch.randint(0, 30, (120,), generator=gen)
    loops = torch.arange(30)
    return dgl.graph((torch.cat([u, u[:40], loops]), torch.cat([v, v[:40], loops])), num_nodes=30)


def _block(seed=0):
    dgl.seed(seed)
    g = dgl.rand_graph(80, 600)
    seeds = torch.arange(15)
    blk = dgl.to_block(dgl.sampling.sample_neighbors(g, seeds, 6), seeds)
    assert blk.num_src_nodes() > blk.num_dst_nodes()
    return blk


def _cora(seed=0):
    return load_graph("cora")


GRAPHS = {"random": _random, "empty_rows": _empty_rows, "huge_row": _huge_row,
          "loops_dups": _loops_and_duplicates, "block": _block, "cora": _cora}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def graph(request):
    """Every graph, the real one included (tests against DGL and the spmm_norm reference)."""
    torch.manual_seed(0)
    return GRAPHS[request.param]()


@pytest.fixture(scope="module", params=sorted(set(GRAPHS) - {"cora"}))
def small(request):
    """The small graphs: dense references of every width, dtype and head count."""
    torch.manual_seed(0)
    return GRAPHS[request.param]()


def _dense(g, w=None):
    """``A_w`` as a dense float64 ``(num_dst, num_src[, H])`` tensor; duplicate edges add up."""
    u, v = g.edges(order="eid")
    w = torch.ones(g.num_edges(), dtype=torch.float64) if w is None else w.double()
    a = torch.zeros(g.num_dst_nodes(), g.num_src_nodes(), *w.shape[1:], dtype=torch.float64)
    return a.index_put((v, u), w, accumulate=True)


def _tol(dtype):
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-9, "rtol": 1e-9}


def _compare(fn, ref, inputs, dtype):
    """``fn`` on ``inputs`` in ``dtype`` against ``ref`` in float64: values and all gradients."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    y, y_ref = fn(*leaves), ref(*leaves64)
    assert y.dtype == dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y.double(), y_ref, **_tol(dtype))
    gy = torch.randn_like(y_ref)
    grads = torch.autograd.grad(y, leaves, gy.to(dtype))
    grads_ref = torch.autograd.grad(y_ref, leaves64, gy)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got.double(), want, **_tol(dtype))


DTYPES = [torch.float32, torch.float64]


# -- against dense references ----------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_spmm_and_mean(small, dtype):
    graph = small
    gi, a = graph_info(graph), _dense(graph)
    deg = a.sum(1).clamp(min=1)
    for k in (1, 7, 16, 37, 130):
        x = torch.randn(graph.num_src_nodes(), k)
        _compare(lambda x: native.spmm_native(gi, x), lambda x: a @ x, [x], dtype)
        _compare(lambda x: native.spmm_mean_native(gi, x), lambda x: (a @ x) / deg[:, None],
                 [x], dtype)
    x = torch.randn(graph.num_src_nodes(), 3, 5)           # trailing dims kept
    _compare(lambda x: native.spmm_native(gi, x), lambda x: torch.einsum("vu,u...->v...", a, x),
             [x], dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [0, 1, 4])
def test_spmm_weighted(small, dtype, heads):
    """``heads=0``: ``w`` of shape ``(E,)``; else ``(E, H)`` with ``x`` ``(n, H, K)``; grads to both."""
    graph = small
    gi, e, n = graph_info(graph), graph.num_edges(), graph.num_src_nodes()
    w = torch.rand(e) + 0.1 if heads == 0 else torch.rand(e, heads) + 0.1
    x = torch.randn(n, 12) if heads == 0 else torch.randn(n, heads, 9)
    if heads == 0:
        ref = lambda w, x: _dense(graph, w) @ x
    else:
        ref = lambda w, x: torch.einsum("vuh,uhk->vhk", _dense_grad(graph, w), x)
    _compare(lambda w, x: native.spmm_weighted_native(gi, w, x), ref, [w, x], dtype)
    if heads:     # DGL's shape (E, H, 1) too
        y = native.spmm_weighted_native(gi, w.to(dtype)[..., None], x.to(dtype))
        torch.testing.assert_close(y.double(), ref(w.double(), x.double()), **_tol(dtype))


@needs_native
def test_constant_values_gathered_once_per_tensor_not_per_view(small):
    """A plan passes its once-per-graph edge values (``D A D``) reshaped at each call: a new view
    object of the same tensor. Their CSR-ordered copy is kept across such views, made again when
    the tensor changes in place, and two different views of one tensor keep their own."""
    graph = small
    gi, e = graph_info(graph), graph.num_edges()
    base = torch.rand(e, 2) + 0.1
    x = torch.randn(graph.num_src_nodes(), 8)
    ref = lambda w: _dense(graph, w).float() @ x           # noqa: E731
    kept = []
    for _ in range(3):
        w = base[:, 0]                                     # a new view each time
        torch.testing.assert_close(native.spmm_weighted_native(gi, w, x), ref(w), **_tol(x.dtype))
        (entry,) = [e for e in gi.cache["native_values"].values() if e[0]() is base]
        kept.append(entry[2]["a"])
    assert kept[0] is kept[1] is kept[2]
    base.mul_(3.0)                                         # in place: gathered again
    w = base[:, 0]
    torch.testing.assert_close(native.spmm_weighted_native(gi, w, x), ref(w), **_tol(x.dtype))
    w1 = base[:, 1]                                        # another view of the same tensor
    torch.testing.assert_close(native.spmm_weighted_native(gi, w1, x), ref(w1), **_tol(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["native", "dgl"])
def test_spmm_heads(small, dtype, impl):
    """Per-head edge values over features shared by the heads: ``Y[v, h] = sum w[e, h] X[u]``,
    outputs and gradients to both against the dense reference, for each implementation."""
    if impl not in kernels.implementations("spmm_heads"):
        pytest.skip(f"spmm_heads/{impl} not registered")
    graph = small
    gi, e, n = graph_info(graph), graph.num_edges(), graph.num_src_nodes()
    fn = kernels.get("spmm_heads", impl)
    for heads, k in ((4, 9), (3, 70), (1, 5)):
        w, x = torch.rand(e, heads) + 0.1, torch.randn(n, k)
        ref = lambda w, x: torch.einsum("vuh,uk->vhk", _dense_grad(graph, w), x)
        _compare(lambda w, x: fn(gi, w, x), ref, [w, x], dtype)
        y = fn(gi, w.to(dtype)[..., None], x.to(dtype))          # DGL's (E, H, 1)
        torch.testing.assert_close(y.double(), ref(w.double(), x.double()), **_tol(dtype))


@needs_native
def test_spmm_heads_gradcheck_threads_and_empty_graph():
    g = _huge_row()
    gi = graph_info(g)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    small = _block()
    gs = graph_info(small)
    w, x = torch.rand(small.num_edges(), 3, **f64), torch.randn(small.num_src_nodes(), 4, **f64)
    assert torch.autograd.gradcheck(lambda w, x: native.spmm_heads_native(gs, w, x), (w, x))
    w, x = torch.rand(g.num_edges(), 8, requires_grad=True), torch.randn(60, 300, requires_grad=True)
    before, results = torch.get_num_threads(), {}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            y = native.spmm_heads_native(gi, w, x)
            results[t] = [y] + list(torch.autograd.grad(y.square().sum(), [w, x]))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(results[1], results[2]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    eg = dgl.graph((torch.tensor([], dtype=torch.long),) * 2, num_nodes=5)
    empty = graph_info(eg)
    x = torch.randn(5, 3, requires_grad=True)
    y = native.spmm_heads_native(empty, torch.rand(0, 4, requires_grad=True), x)
    assert y.shape == (5, 4, 3) and not y.abs().sum()


def _dense_grad(g, w):
    """``_dense`` differentiable in ``w``."""
    u, v = g.edges(order="eid")
    a = torch.zeros(g.num_dst_nodes(), g.num_src_nodes(), *w.shape[1:], dtype=w.dtype)
    return a.index_put((v, u), w, accumulate=True)


def test_dense_reference_is_differentiable():
    g = _random()
    w = torch.rand(g.num_edges(), dtype=torch.float64, requires_grad=True)
    _dense_grad(g, w).sum().backward()
    assert torch.allclose(w.grad, torch.ones_like(w))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "relu"])
def test_spmm_norm(graph, dtype, act):
    """``act(D_dst A D_src X + bias)``, gradients to x, both degree vectors and bias."""
    gi, a = graph_info(graph), _dense(graph)
    d_dst = graph.in_degrees().double().clamp(min=1).pow(-0.5)
    d_src = graph.out_degrees().double().clamp(min=1).pow(-0.5)
    x, bias = torch.randn(graph.num_src_nodes(), 20), torch.randn(20)

    def ref(x, dd, ds, b):
        y = dd[:, None] * (a @ (ds[:, None] * x)) + b
        return torch.relu(y) if act else y

    fn = lambda x, dd, ds, b: native.spmm_norm_native(gi, dd, ds, x, b, act)
    _compare(fn, ref, [x, d_dst, d_src, bias], dtype)
    for impl in kernels.implementations("spmm_norm"):           # native, torch, dgl agree
        _compare(lambda x, dd, ds, b, f=kernels.get("spmm_norm", impl): f(gi, dd, ds, x, b, act),
                 ref, [x, d_dst, d_src, bias], dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "relu"])
def test_spmm_norm_residual(graph, dtype, act):
    """``act(D_dst A D_src X + bias + R)`` with ``R`` a column block of a wider matrix (rows of
    another stride, as the self term split from a shared GEMM): the gradient reaches ``R``."""
    gi, a = graph_info(graph), _dense(graph)
    m = graph.num_dst_nodes()
    d_dst = graph.in_degrees().double().clamp(min=1).pow(-1)
    x, bias, wide = torch.randn(graph.num_src_nodes(), 20), torch.randn(20), torch.randn(m, 28)

    def ref(x, dd, b, wide):
        y = dd[:, None] * (a @ x) + b + wide[:, 8:]
        return torch.relu(y) if act else y

    for impl in kernels.implementations("spmm_norm"):
        f = kernels.get("spmm_norm", impl)
        _compare(lambda x, dd, b, wide: f(gi, dd, None, x, b, act, wide[:, 8:]), ref,
                 [x, d_dst, bias, wide], dtype)
        _compare(lambda x, wide: f(gi, None, None, x, None, None, wide[:, 8:]),
                 lambda x, wide: a @ x + wide[:, 8:], [x, wide], dtype)


@needs_native
@pytest.mark.parametrize("kind", ["norm", "weighted"])
def test_source_gradient_takes_another_in_place(kind):
    """The gradient an aggregation gives its ``(n, k)`` input is not a view (the kernel reads it
    as ``(n, 1, k)``), so autograd adds the gradient of another use of the input (a block's
    destination rows times a weight, as SAGE's self term) into it in place: no out-of-place
    ``n x k`` add. Its values, and a double backward through it, are the dense reference's."""
    from torch.profiler import profile
    g = _block()
    gi = graph_info(g)
    n, m, k = g.num_src_nodes(), g.num_dst_nodes(), 20
    w = torch.rand(g.num_edges(), dtype=torch.float64)
    scale = g.in_degrees().double().clamp(min=1).pow(-1)
    aw = _dense(g, w) if kind == "weighted" else scale[:, None] * _dense(g)
    gy = torch.randn(m, k, dtype=torch.float64)
    rot = torch.randn(k, k, dtype=torch.float64)

    def run(x):
        own = x[:m] @ rot              # made first: its gradient reaches x last
        y = (native.spmm_weighted_native(gi, w, x) if kind == "weighted"
             else native.spmm_norm_native(gi, scale, None, x))
        return ((own + y) * gy).sum()

    x = torch.randn(n, k, dtype=torch.float64, requires_grad=True)
    with profile(record_shapes=True) as prof:
        run(x).backward()
    adds = {e.key for e in prof.key_averages(group_by_input_shape=True)
            if e.input_shapes and e.input_shapes[0] == [n, k]}
    assert "aten::add_" in adds and "aten::add" not in adds
    want = aw.T @ gy
    want[:m] += gy @ rot.T
    torch.testing.assert_close(x.grad, want)
    assert torch.autograd.gradgradcheck(run, (x.detach().requires_grad_(),))


@needs_native
def test_spmm_norm_residual_of_another_shape_broadcasts_as_torch_adds():
    g = _random()
    gi, a = graph_info(g), _dense(g).float()
    x = torch.randn(g.num_src_nodes(), 6)
    for res in (torch.randn(1, 6), torch.randn(6), torch.randn(g.num_dst_nodes(), 6).double()):
        got = native.spmm_norm_native(gi, None, None, x, None, "relu", res)
        torch.testing.assert_close(got, torch.relu(a @ x + res).to(got.dtype), atol=1e-5, rtol=1e-5)


@needs_native
def test_spmm_norm_variants():
    g = _empty_rows()
    gi, a = graph_info(g), _dense(g)
    x = torch.randn(g.num_src_nodes(), 3, 4, dtype=torch.float64)
    for da, db in [(0, 0), (-1, 0), (0, -1), (-0.5, -0.5), (-1, -1)]:
        dd, ds = native.degree_scales(gi, da, db, torch.float64)
        assert native.degree_scales(gi, da, db, torch.float64)[0] is dd     # once per graph
        want = torch.einsum("vu,uhk->vhk", a, x * (ds[:, None, None] if ds is not None else 1))
        want = want * (dd[:, None, None] if dd is not None else 1)
        for b in (None, torch.randn(3, 4, dtype=torch.float64)):
            got = native.spmm_norm_native(gi, dd, ds, x, b, torch.relu)
            torch.testing.assert_close(got, torch.relu(want + (0 if b is None else b)))
    with pytest.raises(ValueError):
        native.spmm_norm_native(gi, None, None, x, act="gelu")
    with pytest.raises(ValueError):
        native.spmm_norm_native(gi, torch.ones(3), None, x)


# -- against DGL -----------------------------------------------------------------------------------
@needs_native
def test_against_dgl(graph):
    gi = graph_info(graph)
    n, e = graph.num_src_nodes(), graph.num_edges()
    x = torch.randn(n, 32, requires_grad=True)
    w = (torch.rand(e) + 0.1).requires_grad_()
    wh = (torch.rand(e, 4, 1) + 0.1).requires_grad_()
    xh = torch.randn(n, 4, 8, requires_grad=True)
    pairs = [
        (lambda: native.spmm_native(gi, x), lambda: dgl.ops.copy_u_sum(graph, x), [x]),
        (lambda: native.spmm_mean_native(gi, x), lambda: dgl.ops.copy_u_mean(graph, x), [x]),
        (lambda: native.spmm_weighted_native(gi, w, x),
         lambda: dgl.ops.u_mul_e_sum(graph, x, w), [w, x]),
        (lambda: native.spmm_weighted_native(gi, wh, xh),
         lambda: dgl.ops.u_mul_e_sum(graph, xh, wh), [wh, xh]),
    ]
    for mine, theirs, inputs in pairs:
        y, y_dgl = mine(), theirs()
        torch.testing.assert_close(y, y_dgl, atol=1e-4, rtol=1e-4)
        gy = torch.randn_like(y)
        for g1, g2 in zip(torch.autograd.grad(y, inputs, gy), torch.autograd.grad(y_dgl, inputs, gy)):
            torch.testing.assert_close(g1, g2, atol=1e-4, rtol=1e-4)
    # the edge-value gradient is DGL's u_dot_v in edge order
    a, at = native.csr_index(gi, "a"), native.csr_index(gi, "at")
    dy = torch.randn(graph.num_dst_nodes(), 4, 8)
    dw = torch.ops.granii.sddmm_dot_csr(a.indptr, a.indices, a.eids, dy, xh.detach())
    torch.testing.assert_close(dw, dgl.ops.u_dot_v(graph, xh.detach(), dy).squeeze(-1))
    assert at.rows == graph.num_src_nodes() and at.cols == graph.num_dst_nodes()


# -- merge-path partition, index types, tile widths -----------------------------------------------------
@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_rows_every_part_count(dtype):
    """Forced part counts split the huge row between parts; the epilogue runs once on the sum."""
    g = _huge_row()
    gi, a = graph_info(g), _dense(g)
    idx = native.csr_index(gi)
    n = g.num_nodes()
    rs, cs = torch.rand(n, dtype=torch.float64), torch.rand(n, dtype=torch.float64)
    x, bias = torch.randn(n, 2, 19, dtype=torch.float64), torch.randn(38, dtype=torch.float64)
    w = torch.rand(g.num_edges(), 2, dtype=torch.float64)
    aw = _dense(g, w)
    want = torch.relu(rs[:, None, None] * torch.einsum("vuh,uhk->vhk", aw, cs[:, None, None] * x)
                      + bias.reshape(2, 19))
    want_plain = torch.einsum("vu,uhk->vhk", a, x)
    res = torch.randn(n, 38, dtype=torch.float64)
    want_res = torch.relu(want_plain.reshape(n, 38) + bias + res).reshape(n, 2, 19)
    for parts in (1, 2, 3, 5, 8, 33, 200, 2000):
        cast = lambda t: t.to(dtype)
        got = torch.ops.granii.spmm_csr(idx.indptr, idx.indices, cast(x), cast(w), idx.eids,
                                        cast(rs), cast(cs), cast(bias), 1, parts)
        torch.testing.assert_close(got.double(), want, **_tol(dtype))
        got = torch.ops.granii.spmm_csr(idx.indptr, idx.indices, cast(x), bias=cast(bias), act=1,
                                        parts=parts, res=cast(res))
        torch.testing.assert_close(got.double(), want_res, **_tol(dtype))
        got = torch.ops.granii.spmm_csr(idx.indptr, idx.indices, cast(x), parts=parts)
        torch.testing.assert_close(got.double(), want_plain, **_tol(dtype))
        dy = torch.randn(n, 2, 19, dtype=dtype)
        dw = torch.ops.granii.sddmm_dot_csr(idx.indptr, idx.indices, idx.eids, dy, cast(x), parts)
        torch.testing.assert_close(dw, dgl.ops.u_dot_v(g, cast(x), dy).squeeze(-1), **_tol(dtype))


@needs_native
def test_int64_indices_and_widths():
    g = _loops_and_duplicates()
    gi, a = graph_info(g), _dense(g)
    idx = native.csr_index(gi)
    assert idx.indptr.dtype == torch.int32
    ip64, ix64 = idx.indptr.long(), idx.indices.long()
    for k in (1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 200):
        x = torch.randn(g.num_nodes(), 1, k, dtype=torch.float64)
        want = torch.einsum("vu,uhk->vhk", a, x)
        torch.testing.assert_close(torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x), want)
        torch.testing.assert_close(torch.ops.granii.spmm_csr(ip64, ix64, x), want)
        torch.testing.assert_close(torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x.float()),
                                   want.float(), atol=1e-4, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("name", ["random", "block", "loops", "empty"])
def test_index_structures_match_dgl(name):
    """The per-graph index the kernels use: ``A``'s CSR in the index type with source
    out-degrees counted in the same pass, and ``A^T`` transposed from it, match DGL's in-edge
    and out-edge indices and degrees (entries of a row in any order), with each transposed
    entry's position in ``A``."""
    g = {"random": _random, "block": _block,
         "loops": _loops_and_duplicates,
         "empty": lambda: dgl.graph(([], []), num_nodes=4)}[name]()
    gi = graph_info(g)
    a, at = native.csr_index(gi, "a"), native.csr_index(gi, "at")
    assert a.indptr.dtype == at.indptr.dtype == torch.int32
    assert torch.equal(gi.out_degrees(), g.out_degrees().float())
    assert torch.equal(gi.in_degrees(), g.in_degrees().float())

    def entries(idx, which):
        ip, ix = idx.indptr.long(), idx.indices.long()
        e = torch.arange(ix.numel()) if idx.eids is None else idx.eids.long()
        rows = torch.repeat_interleave(torch.arange(ip.numel() - 1), ip.diff())
        src, dst = (ix, rows) if which == "a" else (rows, ix)
        return sorted(zip(src.tolist(), dst.tolist(), e.tolist()))
    u, v = g.edges(order="eid")
    want = sorted(zip(u.tolist(), v.tolist(), range(g.num_edges())))
    assert entries(a, "a") == want and entries(at, "at") == want
    assert torch.equal(at.indptr.long().diff(), g.out_degrees())
    pos = at.pos.long()
    a_eids = torch.arange(g.num_edges()) if a.eids is None else a.eids.long()
    assert torch.equal(a_eids[pos], at.eids.long())
    assert torch.equal(a.indices.long()[pos],
                       torch.repeat_interleave(torch.arange(gi.num_src), at.indptr.long().diff()))
    ip, ix = a.indptr.long(), a.indices.long()          # int64 in, int64 out
    t = torch.ops.granii.csr_transpose(ip, ix, None, gi.num_src)
    assert all(x.dtype == torch.int64 for x in t) and torch.equal(t[0], at.indptr.long())
    with pytest.raises(RuntimeError):                   # a column outside the matrix
        torch.ops.granii.csr_transpose(a.indptr, a.indices, None, 0 if g.num_edges() else -1)


@needs_native
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 65])
def test_spmm_csr_row_loops_of_every_width(width):
    """``spmm_csr`` has a row loop specialised per feature width (float32, one head, one block):
    every width, with and without values, column and row scales, bias, residual and ReLU, on
    whole rows and on rows split between parts, gives the dense product's result; with heads and
    no values the heads are read as one row of ``H K`` features."""
    gen = torch.Generator().manual_seed(width)
    g = _huge_row()
    idx = native.csr_index(graph_info(g))
    rows, n, e = g.num_dst_nodes(), g.num_src_nodes(), g.num_edges()
    ip, ix = idx.indptr.long(), idx.indices.long()
    r_of = torch.repeat_interleave(torch.arange(rows), ip.diff())
    for heads in (1, 2):
        x = torch.randn(n, heads, width, generator=gen)
        val = torch.rand(e, heads, generator=gen)
        cs, rs = torch.rand(n, generator=gen), torch.rand(rows, generator=gen)
        bias = torch.randn(heads * width, generator=gen)
        res = torch.randn(rows, heads * width, generator=gen)
        for use_val in ((False, True) if heads == 1 else (False,)):
            for parts in (1, 3):
                for act in (0, 1):
                    v = val[:, :1].expand(e, heads) if use_val else torch.ones(e, heads)
                    msg = v[:, :, None] * cs[ix][:, None, None] * x[ix]
                    want = torch.zeros(rows, heads, width).index_add_(0, r_of, msg)
                    want = want.reshape(rows, -1) * rs[:, None] + bias + res
                    want = want.clamp(min=0) if act else want
                    got = torch.ops.granii.spmm_csr(
                        idx.indptr, idx.indices, x, val[:, :1].contiguous() if use_val else None,
                        None, rs, cs, bias, act, parts, res)
                    torch.testing.assert_close(got.reshape(rows, -1), want, atol=1e-4, rtol=1e-4)
                    plain = torch.zeros(rows, heads, width).index_add_(0, r_of, x[ix])
                    torch.testing.assert_close(
                        torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x, parts=parts), plain,
                        atol=1e-4, rtol=1e-4)


@needs_native
def test_operator_checks():
    g = _random()
    idx = native.csr_index(graph_info(g))
    x = torch.randn(g.num_nodes(), 1, 4)
    with pytest.raises(RuntimeError):
        torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x.double(), torch.ones(g.num_edges(), 1))
    with pytest.raises(RuntimeError):
        torch.ops.granii.spmm_csr(idx.indptr, idx.indices.long(), x)
    with pytest.raises(RuntimeError):
        torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x, act=2)
    with pytest.raises(ValueError):
        native.spmm_weighted_native(graph_info(g), torch.rand(g.num_edges(), 3), torch.randn(40, 4))


@needs_native
def test_empty_graph_and_zero_width():
    g = dgl.graph((torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)),
                  num_nodes=5)
    gi = graph_info(g)
    x = torch.randn(5, 3, requires_grad=True)
    y = native.spmm_norm_native(gi, torch.ones(5), torch.ones(5), x, torch.ones(3), "relu")
    assert torch.equal(y, torch.ones(5, 3))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(5, 3))
    w = torch.rand(0, requires_grad=True)
    assert native.spmm_weighted_native(gi, w, x).abs().sum() == 0
    assert native.spmm_native(graph_info(_random()), torch.randn(40, 0)).shape == (40, 0)


# -- gradcheck ------------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("name", ["random", "block", "huge_row"])
def test_gradcheck(name):
    g = GRAPHS[name]()
    if name == "huge_row":      # keep gradcheck small: a hub of 40 in-edges among 60 edges
        v = torch.cat([torch.full((40,), 2), torch.randint(0, 12, (20,))])
        g = dgl.graph((torch.randint(0, 12, (60,)), v), num_nodes=12)
    gi = graph_info(g)
    n, m, e = g.num_src_nodes(), g.num_dst_nodes(), g.num_edges()
    f64 = dict(dtype=torch.float64, requires_grad=True)
    x, w = torch.randn(n, 3, **f64), torch.rand(e, **f64)
    xh, wh = torch.randn(n, 2, 3, **f64), torch.rand(e, 2, **f64)
    dd, ds, b = torch.rand(m, **f64), torch.rand(n, **f64), torch.randn(3, **f64)
    assert torch.autograd.gradcheck(lambda x: native.spmm_native(gi, x), (x,))
    assert torch.autograd.gradcheck(lambda x: native.spmm_mean_native(gi, x), (x,))
    assert torch.autograd.gradcheck(lambda w, x: native.spmm_weighted_native(gi, w, x), (w, x))
    assert torch.autograd.gradcheck(lambda w, x: native.spmm_weighted_native(gi, w, x), (wh, xh))
    assert torch.autograd.gradcheck(
        lambda x, dd, ds, b: native.spmm_norm_native(gi, dd, ds, x, b, "relu"), (x, dd, ds, b))
    r = torch.randn(m, 3, **f64)
    assert torch.autograd.gradcheck(
        lambda x, dd, b, r: native.spmm_norm_native(gi, dd, None, x, b, "relu", r), (x, dd, b, r))
    assert torch.autograd.gradgradcheck(
        lambda x, dd, r: native.spmm_norm_native(gi, dd, None, x, None, None, r), (x, dd, r))
    assert torch.autograd.gradgradcheck(lambda x: native.spmm_native(gi, x), (x,))
    assert torch.autograd.gradgradcheck(lambda w, x: native.spmm_weighted_native(gi, w, x), (wh, xh))
    assert torch.autograd.gradgradcheck(
        lambda x, dd, ds, b: native.spmm_norm_native(gi, dd, ds, x, b), (x, dd, ds, b))


# -- threads and processes ----------------------------------------------------------------------------
@needs_native
def test_thread_counts():
    g = _huge_row()
    gi = graph_info(g)
    x = torch.randn(g.num_nodes(), 300, requires_grad=True)     # large enough to go parallel
    w = torch.rand(g.num_edges(), requires_grad=True)
    dd, ds = native.degree_scales(gi, -0.5, -0.5)
    before = torch.get_num_threads()
    results = {}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.ops.granii.parallel_threads() == t
            ys = [native.spmm_weighted_native(gi, w, x), native.spmm_norm_native(gi, dd, ds, x)]
            grads = torch.autograd.grad(sum(y.square().sum() for y in ys), [x, w])
            results[t] = ys + list(grads)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(results[1], results[2]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)


class _Aggregate(torch.utils.data.Dataset):
    def __init__(self, g):
        self.g = g

    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = torch.randn(self.g.num_nodes(), 64)
        return native.spmm_native(graph_info(self.g), x).sum()


@needs_native
def test_forked_dataloader_workers_do_not_hang():
    g = _huge_row()
    native.spmm_native(graph_info(g), torch.randn(g.num_nodes(), 512))   # parent uses the pool
    code = (
        "import torch, sys; sys.path.insert(0, %r)\n"
        "from test_native import _Aggregate, _huge_row, native, graph_info\n"
        "g = _huge_row(); torch.set_num_threads(2)\n"
        "native.spmm_native(graph_info(g), torch.randn(g.num_nodes(), 512))\n"
        "dl = torch.utils.data.DataLoader(_Aggregate(g), batch_size=2, num_workers=2,\n"
        "                                 multiprocessing_context='fork')\n"
        "print(len(list(dl)))\n" % str(ROOT / "tests"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("2")


# -- without the extension ------------------------------------------------------------------------------
def test_without_extension_says_so_once_and_registers_nothing():
    code = (
        "import sys, warnings\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'granii._native': raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import granii.kernels as k\n"
        "    import granii.kernels.native as n\n"
        "    import granii.api\n"
        "msgs = [str(w.message) for w in caught if 'native kernels unavailable' in str(w.message)]\n"
        "print(len(msgs), n.AVAILABLE, k.implementations('spmm'), k.implementations('spmm_norm'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1 False ['dgl', 'torch_csr'] ['dgl', 'torch']", out.stdout


def test_setup_without_compiler_succeeds():
    env = dict(os.environ, CXX="/nonexistent/c++")
    out = subprocess.run([sys.executable, "setup.py", "--dry-run", "build_ext"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "native kernels not built: no C++ compiler" in out.stderr


@needs_native
def test_small_products_stay_on_one_thread_when_workers_sleep():
    """Under OMP_WAIT_POLICY=PASSIVE (workers sleep after each region, so waking them costs more
    than a small product) the kernels' serial threshold is 2^20 instead of 2^15, and a Cora-sized
    SpMM and GAT aggregation then give what they give split between threads."""
    code = (
        "import sys, torch; sys.path.insert(0, %r)\n"
        "from test_native import native, graph_info\n"
        "from granii.kernels.native_gat import gat_fused_native\n"
        "import dgl\n"
        "torch.manual_seed(0); torch.set_num_threads(2)\n"
        "g = dgl.graph(tuple(torch.randint(0, 2700, (2, 13000))), num_nodes=2700)\n"
        "gi = graph_info(g)\n"
        "x = torch.randn(2700, 32, requires_grad=True)\n"
        "el, er = torch.randn(2700, 1, requires_grad=True), torch.randn(2700, 1)\n"
        "dd, ds = native.degree_scales(gi, -0.5, -0.5)\n"
        "y = native.spmm_norm_native(gi, dd, ds, x) + gat_fused_native(gi, el, er, x.view(2700, 1, 32), 0.2).view(2700, 32)\n"
        "grads = torch.autograd.grad(y.square().sum(), [x, el])\n"
        "torch.save([torch.ops.granii.serial_work(), y.detach()] + list(grads), sys.argv[1])\n"
        % str(ROOT / "tests"))
    results = {}
    for policy in ("PASSIVE", " passive ", None):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy:
            env["OMP_WAIT_POLICY"] = policy
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "out.pt")
            out = subprocess.run([sys.executable, "-c", code, path], capture_output=True,
                                 text=True, timeout=120, cwd=ROOT, env=env)
            assert out.returncode == 0, out.stderr[-2000:]
            results[policy] = torch.load(path)
    assert results["PASSIVE"][0] == results[" passive "][0] == 2 ** 20
    assert results[None][0] == 2 ** 15
    for a, b in zip(results["PASSIVE"][1:], results[None][1:]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("order", ["destination", "shuffled"])
def test_coo_to_csr_counts_the_edge_list_and_rejects_edges_outside_the_graph(order):
    """The CSR of ``A`` (a row per destination, ascending edge ids in a row), edge ids only where
    the list was not in destination order, both degree vectors and the degree statistics; an
    edge outside the graph raises with its position, whichever edge it is."""
    gen = torch.Generator().manual_seed(3)
    n_src, n_dst, e = 40, 30, 300
    src = torch.randint(0, n_src, (e,), generator=gen)
    dst = torch.randint(0, n_dst, (e,), generator=gen)
    if order == "destination":
        dst, perm = dst.sort(stable=True)
        src = src[perm]
    indptr, indices, eids, out_deg, in_deg, stats = torch.ops.granii.coo_to_csr(
        src, dst, n_src, n_dst, True)
    keys = dst * e + torch.arange(e)                # by destination, then edge id
    ref_eids = keys.argsort()
    assert indptr.dtype == torch.int32
    assert torch.equal(indptr.long(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                 torch.bincount(dst, minlength=n_dst).cumsum(0)]))
    assert torch.equal(indices.long(), src[ref_eids])
    if order == "destination":
        assert eids is None
    else:
        assert torch.equal(eids.long(), ref_eids)
    assert torch.equal(out_deg, torch.bincount(src, minlength=n_src).float())
    assert torch.equal(in_deg, torch.bincount(dst, minlength=n_dst).float())
    d = in_deg.double()
    assert stats.tolist() == pytest.approx([d.max().item(), out_deg.max().item(),
                                            d.std(unbiased=False).item()])
    for bad, where in ((-1, 0), (n_src, e // 2), (n_src + 5, e - 1)):
        s = src.clone()
        s[where] = bad
        with pytest.raises(RuntimeError, match=f"edge {where} "):
            torch.ops.granii.coo_to_csr(s, dst, n_src, n_dst, True)
    d2 = dst.clone()
    d2[7] = n_dst
    with pytest.raises(RuntimeError, match="edge 7 .*outside the graph's 40 x 30 nodes"):
        torch.ops.granii.coo_to_csr(src, d2, n_src, n_dst, False)


@needs_native
@pytest.mark.parametrize("k", [3, 5, 6, 7, 12])
@pytest.mark.parametrize("parts", [1, 3])
def test_fused_epilogue_at_widths_of_one_hot_labels(k, parts):
    """Float32 widths that are no power of two (node labels one-hot: MUTAG's 7) run one walk
    of a row's nonzeros with all their accumulators: edge values, both scalings, bias, residual
    and ReLU against the dense computation, rows whole and split between parts."""
    g = _loops_and_duplicates()
    gi, a = graph_info(g), _dense(g)
    idx = native.csr_index(gi)
    n, e = g.num_nodes(), g.num_edges()
    x = torch.randn(n, 1, k)
    w = torch.rand(e)
    rs, cs, bias, res = torch.rand(n), torch.rand(n), torch.randn(k), torch.randn(n, k)
    src, dst = g.edges(order="eid")
    aw = torch.zeros(n, n).index_put_((dst, src), w, accumulate=True)
    want = torch.relu(rs[:, None] * (aw @ (cs[:, None] * x[:, 0])) + bias + res)
    vals = w[idx.eids.long()] if idx.eids is not None else w
    got = torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x, vals.reshape(-1, 1).contiguous(),
                                    None, rs, cs, bias, 1, parts, res)
    torch.testing.assert_close(got.reshape(n, k), want, atol=1e-5, rtol=1e-5)
    plain = torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x, None, None, None, None, None, 0,
                                      parts, None)
    torch.testing.assert_close(plain.reshape(n, k), (a @ x[:, 0].double()).float(), atol=1e-5,
                               rtol=1e-5)


@needs_native
@pytest.mark.parametrize("order", ["destination", "shuffled"])
@pytest.mark.parametrize("small", [True, False])
def test_coo_to_csr_both_adds_the_transpose_csr_transpose_makes(order, small):
    """``coo_to_csr_both``: ``coo_to_csr``'s outputs, and ``A^T`` as ``csr_transpose`` makes it
    from them (rows by source, ascending destinations, the edge id and the position in ``A`` of
    each entry), nodes without edges included."""
    gen = torch.Generator().manual_seed(4)
    n_src, n_dst, e = 50, 35, 260
    src = torch.randint(0, n_src - 5, (e,), generator=gen)
    dst = torch.randint(0, n_dst, (e,), generator=gen)
    if order == "destination":
        dst, perm = dst.sort(stable=True)
        src = src[perm]
    both = torch.ops.granii.coo_to_csr_both(src, dst, n_src, n_dst, small)
    one = torch.ops.granii.coo_to_csr(src, dst, n_src, n_dst, small)
    for a, b in zip(both[:6], one):
        assert (a is None and b is None) or torch.equal(a, b)
    want = torch.ops.granii.csr_transpose(one[0], one[1], one[2], n_src)
    for a, b in zip(both[6:], want):
        assert a.dtype == (torch.int32 if small else torch.int64) and torch.equal(a, b)


@needs_native
def test_a_new_graph_in_training_counts_both_indices_in_one_pass(monkeypatch):
    """A GINConv training on a new batch every step: the class path's first call on a graph
    makes ``A`` and ``A^T`` in one call (the backward reads ``A^T``), and no transpose of
    ``A`` runs; in eval mode only ``A`` is made."""
    from dgl.nn import GINConv
    from granii import granii
    calls = []
    for name in ("coo_to_csr", "coo_to_csr_both", "csr_transpose"):
        real = getattr(torch.ops.granii, name)
        monkeypatch.setattr(torch.ops.granii, name,
                            lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))

    def batch(seed):
        dgl.seed(seed)
        return dgl.batch([dgl.rand_graph(12, 40) for _ in range(6)])
    layer = GINConv(torch.nn.Linear(5, 5), "sum")
    ref = copy.deepcopy(layer)
    granii(layer, batch(0), torch.randn(72, 5))
    for i in range(30):
        g, x = batch(i + 1), torch.randn(72, 5, requires_grad=True)
        calls.clear()
        layer(g, x).sum().backward()
    assert calls == ["coo_to_csr_both"], calls
    xr = x.detach().requires_grad_()
    ref(g, xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    layer.eval()
    for i in range(30):
        g = batch(100 + i)
        calls.clear()
        layer(g, torch.randn(72, 5))
    assert calls == ["coo_to_csr"], calls


# -- which sources the cost models depend on ----------------------------------------------------
def _copy_sources(tmp_path):
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "granii" / "kernels" / "csrc", root / "granii" / "kernels" / "csrc")
    shutil.copy2(ROOT / "setup.py", root / "setup.py")
    return root


def test_a_change_to_an_untimed_file_keeps_the_timed_hash(tmp_path):
    """The cost models record ``kernels_sha``: an index builder's change leaves it (the models
    stay valid), a change to a profiled kernel, the shared header or the build file does not."""
    from granii.kernels import sources
    root = _copy_sources(tmp_path)
    full, timed = sources.sources_sha(root), sources.kernels_sha(root)
    assert (full, timed) == (native.sources_sha(), sources.kernels_sha(ROOT))
    csrc = root / "granii" / "kernels" / "csrc"
    with open(csrc / "csr.cpp", "a") as f:
        f.write("\n// an index builder changed\n")
    assert sources.sources_sha(root) != full and sources.kernels_sha(root) == timed
    for name in ("granii/kernels/csrc/spmm.cpp", "granii/kernels/csrc/native.h", "setup.py"):
        before = sources.kernels_sha(root)
        with open(root / name, "a") as f:
            f.write("\n// changed\n")
        assert sources.kernels_sha(root) != before, name
    assert sources.kernels_sha(tmp_path / "nothing") is None


@needs_native
def test_the_loaded_library_says_its_timed_hash_and_the_fingerprint_records_it():
    from granii import fingerprint
    from granii.kernels import sources
    assert native.kernels_sha(native._MODULE) == sources.kernels_sha(ROOT)
    assert fingerprint.machine_fingerprint()["native"] == sources.kernels_sha(ROOT)


# -- the plain product's gradient in C++ ---------------------------------------------------------
def _granii_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        fn()
    return {e.name for e in p.events() if e.name.startswith("granii::")}


@needs_native
@pytest.mark.parametrize("act", [None, "relu"])
def test_a_plain_product_runs_its_gradient_in_cpp_once_the_transpose_is_made(act):
    """``act(diag(r) A diag(c) X + R)`` with constant scales: the first backward on a graph
    makes ``A^T``'s index (``_SpmmFn``), later calls run ``granii::spmm_autograd`` (forward and
    backward in C++) with ``_SpmmFn``'s outputs and gradients, double backward included; scales
    that need gradients keep ``_SpmmFn``; without gradients, the kernel alone."""
    g = dgl.add_self_loop(dgl.rand_graph(50, 300))
    gi = graph_info(g)
    torch.manual_seed(0)
    x = torch.randn(50, 2, 3, dtype=torch.float64, requires_grad=True)
    res = torch.randn(50, 6, dtype=torch.float64, requires_grad=True)
    d = torch.rand(50, dtype=torch.float64) + 0.5

    def run(**kw):
        return native.spmm_norm_native(gi, d, d.flip(0), x, act=act, res=res, **kw)

    first = _granii_ops(lambda: run().sum().backward())
    assert "granii::spmm_autograd" not in first and ("native_csr", "at") in gi.cache
    gx, gres = x.grad.clone(), res.grad.clone()
    x.grad = res.grad = None
    later = _granii_ops(lambda: run().sum().backward())
    assert "granii::spmm_autograd" in later
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(res.grad, gres)
    assert torch.autograd.gradcheck(lambda a, b: native.spmm_norm_native(
        gi, d, d.flip(0), a, act=act, res=b), (x, res))
    assert torch.autograd.gradgradcheck(lambda a, b: native.spmm_norm_native(
        gi, d, d.flip(0), a, act=act, res=b), (x, res))
    learned = d.clone().requires_grad_()
    assert "granii::spmm_autograd" not in _granii_ops(
        lambda: native.spmm_norm_native(gi, learned, None, x, act=act).sum().backward())
    assert learned.grad is not None
    with torch.no_grad():
        assert _granii_ops(run) == {"granii::spmm_csr"}
