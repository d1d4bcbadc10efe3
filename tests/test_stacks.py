"""The framework-neutral core on either stack: granii imports without DGL, and its kernels, IR,
enumeration, pruning, plans and cost models run on a graph held as torch tensors alone.

``CsrGraph`` is such a graph: edges ``u -> v`` as two index tensors, with the few methods of a DGL
graph that ``granii.graph.GraphInfo`` reads (counts, edges in edge-id order, in/out CSR, degrees).
On the current stack (no DGL) these tests are what checks the core; on the DGL stack they run too.
"""
import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import granii.enumerate as en
from granii import ir
from granii.costmodel import AnalyticalCost
from granii.runtime.variants import leaf_vals_order
from granii.fingerprint import machine_fingerprint
from granii.graph import graph_info
from granii.kernels import extension, get, implementations, native
from granii.plan import compile_plan, lower, step_impls, tree_calls
from granii.prune import prune
from granii.select import rank

ROOT = Path(__file__).resolve().parent.parent
HAVE_DGL = importlib.util.find_spec("dgl") is not None

# a meta-path finder that makes ``import dgl`` fail as if DGL were not installed
NO_DGL = textwrap.dedent("""
    import sys

    class NoDGL:
        def find_spec(self, name, path=None, target=None):
            if name == "dgl" or name.startswith("dgl."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, NoDGL())
""")


def run_without_dgl(code, timeout=240):
    """``code`` in a fresh interpreter where DGL cannot be imported; its stdout."""
    proc = subprocess.run([sys.executable, "-c", NO_DGL + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin",
                               "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, f"failed without DGL:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_granii_imports_with_dgl_blocked():
    """``import granii`` and its kernels load nothing of DGL; the torch kernels are registered."""
    out = run_without_dgl("""
        import granii
        from granii import api, runtime, enumerate, explain, prune, plan, select, costmodel
        from granii import learned, fingerprint, featurize
        from granii.kernels import REGISTRY
        assert not any(m == "dgl" or m.startswith("dgl.") for m in sys.modules), "dgl loaded"
        print(sorted(p for p, impls in REGISTRY.items() if set(impls) - {"dgl"}))
    """)
    for prim in ("gemm", "spmm", "spmm_weighted", "spmm_mean", "sddmm_scale", "edge_softmax"):
        assert repr(prim) in out


def test_calibration_without_dgl_times_the_other_references_and_rescales():
    """Without DGL its reference calls cannot be timed, the others can (on index graphs of the
    same edges): the calibration holds the streaming, GEMM and sparse references of the
    implementations this stack runs, and transferred models are rescaled by it."""
    out = run_without_dgl("""
        import json, os, tempfile
        os.environ["GRANII_CACHE"] = tempfile.mkdtemp()
        from granii import calibration, kernels, reference
        from granii.fingerprint import machine_fingerprint
        cal = calibration.this_machine(machine_fingerprint(), refresh=True)
        t = calibration.Transfer({k: 2 * v for k, v in cal["times"].items()}, cal["times"])
        print("RESULT " + json.dumps({
            "times": sorted(cal["times"]), "native": "native" in kernels.implementations("spmm"),
            "graph": type(reference.uniform(50, 100, 1)).__name__,
            "scaled": [t.scale("spmm", 1.0, impl) for impl in ("dgl", "torch_csr")]}))
    """)
    got = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    want = {"stream", "gemm", "sparse_torch_csr", "small_torch_csr"}
    if got["native"]:
        want |= {"sparse_native", "small_native"}
    assert set(got["times"]) == want
    assert got["graph"] == "IndexGraph"
    assert got["scaled"] == [pytest.approx(0.5), pytest.approx(0.5)]


# -- a graph of torch tensors ------------------------------------------------------------------
class CsrGraph:
    """Edges ``src[e] -> dst[e]`` of a graph with ``n`` nodes, held as torch tensors."""
    is_block = False

    def __init__(self, src, dst, n):
        self.src, self.dst, self.n = src.long(), dst.long(), n
        self._graph = object()          # what GraphInfo watches for structural edits

    def num_src_nodes(self):
        return self.n

    def num_dst_nodes(self):
        return self.n

    def num_edges(self):
        return self.src.numel()

    def edges(self, order="eid"):
        return self.src, self.dst

    def in_degrees(self):
        return torch.bincount(self.dst, minlength=self.n)

    def out_degrees(self):
        return torch.bincount(self.src, minlength=self.n)

    def adj_tensors(self, fmt):
        """``(indptr, indices, eids)``: ``"csc"`` one row per destination, ``"csr"`` per source."""
        rows, cols = (self.dst, self.src) if fmt == "csc" else (self.src, self.dst)
        eids = torch.argsort(rows, stable=True)
        indptr = torch.zeros(self.n + 1, dtype=torch.long)
        indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=self.n), 0)
        return indptr, cols[eids], eids

    def dense(self, w=None):
        """``A_w`` as a float64 ``(n, n[, H])`` tensor, ``A[v, u] = sum of w_e over e = u -> v``."""
        w = torch.ones(self.num_edges(), dtype=torch.float64) if w is None else w.double()
        a = torch.zeros(self.n, self.n, *w.shape[1:], dtype=torch.float64)
        return a.index_put((self.dst, self.src), w, accumulate=True)


def directed_graph(seed=0, n=30, e=150):
    """Random directed edges, duplicates and self-loops included; nodes ``n - 5 ..`` receive
    none (zero in-degree) and some others send none."""
    gen = torch.Generator().manual_seed(seed)
    return CsrGraph(torch.randint(0, n - 3, (e,), generator=gen),
                    torch.randint(0, n - 5, (e,), generator=gen), n)


def undirected_graph(seed=1, n=25, e=60):
    gen = torch.Generator().manual_seed(seed)
    u, v = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    return CsrGraph(torch.cat([u, v]), torch.cat([v, u]), n)


GRAPHS = {"directed": directed_graph, "undirected": undirected_graph}


@pytest.fixture(params=sorted(GRAPHS))
def graph(request):
    return GRAPHS[request.param]()


def torch_impls(prim):
    """Implementations of ``prim`` that need no DGL graph."""
    return [i for i in implementations(prim) if i != "dgl"]


def compare(fn, ref, inputs, atol=1e-4):
    """``fn`` on float32 ``inputs`` against ``ref`` in float64: values and every gradient."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    y, y_ref = fn(*leaves), ref(*leaves64)
    torch.testing.assert_close(y.double(), y_ref, atol=atol, rtol=1e-4)
    gy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = torch.autograd.grad(y, leaves, gy.float())
    want = torch.autograd.grad(y_ref, leaves64, gy)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=1e-4,
                                   msg=lambda m: f"gradient {i}: {m}")


# -- kernels on torch CSR tensors --------------------------------------------------------------
def test_every_sparse_primitive_has_an_implementation_without_dgl():
    for prim in ("spmm", "spmm_weighted", "spmm_mean", "sddmm_scale", "sddmm_add", "edge_softmax",
                 "spmm_norm", "gat_aggregate", "gemm", "row_scale"):
        assert torch_impls(prim), prim


@pytest.mark.parametrize("impl", torch_impls("spmm"))
def test_spmm(graph, impl):
    gi, a = graph_info(graph), graph.dense()
    x = torch.randn(graph.n, 6)
    compare(lambda x: get("spmm", impl)(gi, x), lambda x: a @ x, [x])


@pytest.mark.parametrize("impl", torch_impls("spmm_mean"))
def test_spmm_mean(graph, impl):
    gi, a = graph_info(graph), graph.dense()
    deg = a.sum(1).clamp(min=1)[:, None]
    x = torch.randn(graph.n, 5)
    compare(lambda x: get("spmm_mean", impl)(gi, x), lambda x: (a @ x) / deg, [x])


@pytest.mark.parametrize("impl", torch_impls("spmm_weighted"))
def test_spmm_weighted_features_gradient(graph, impl):
    gi = graph_info(graph)
    w = torch.rand(graph.num_edges()) + 0.5
    a = graph.dense(w)
    x = torch.randn(graph.n, 4)
    compare(lambda x: get("spmm_weighted", impl)(gi, w, x), lambda x: a @ x, [x])


@pytest.mark.parametrize("impl", torch_impls("spmm_weighted"))
def test_spmm_weighted_edge_gradient(graph, impl):
    """``dw_e = <dY[v], X[u]>`` as well as ``dX = A_w^T dY``."""
    gi = graph_info(graph)
    w, x = torch.rand(graph.num_edges()) + 0.5, torch.randn(graph.n, 4)
    compare(lambda w, x: get("spmm_weighted", impl)(gi, w, x),
            lambda w, x: _weighted_ref(graph, w, x), [w, x])


def _weighted_ref(graph, w, x):
    """``Y[v] = sum_{e = u -> v} w_e X[u]`` by a scatter, differentiable in ``w`` and ``x``."""
    y = torch.zeros(graph.n, x.shape[1], dtype=x.dtype)
    return y.index_add(0, graph.dst, w[:, None] * x[graph.src])


@pytest.mark.parametrize("impl", torch_impls("sddmm_scale"))
def test_sddmm_scale(graph, impl):
    gi = graph_info(graph)
    d_dst, d_src = torch.rand(graph.n) + 0.5, torch.rand(graph.n) + 0.5
    w = torch.rand(graph.num_edges())
    compare(lambda a, w, b: get("sddmm_scale", impl)(gi, a, w, b),
            lambda a, w, b: a[graph.dst] * w * b[graph.src], [d_dst, w, d_src])


@pytest.mark.parametrize("impl", torch_impls("sddmm_add"))
def test_sddmm_add(graph, impl):
    gi = graph_info(graph)
    el, er = torch.randn(graph.n, 3, 1), torch.randn(graph.n, 3, 1)
    compare(lambda a, b: get("sddmm_add", impl)(gi, a, b),
            lambda a, b: a[graph.src] + b[graph.dst], [el, er])


def _edge_softmax_ref(graph, e):
    out = torch.zeros_like(e)
    for v in range(graph.n):
        mask = graph.dst == v
        if mask.any():
            out = out.index_put((mask.nonzero()[:, 0],), torch.softmax(e[mask], dim=0))
    return out


@pytest.mark.parametrize("impl", torch_impls("edge_softmax"))
def test_edge_softmax(graph, impl):
    gi = graph_info(graph)
    e = torch.randn(graph.num_edges(), 2, 1)
    compare(lambda e: get("edge_softmax", impl)(gi, e), lambda e: _edge_softmax_ref(graph, e), [e])


@pytest.mark.parametrize("impl", torch_impls("spmm_norm"))
def test_spmm_norm(graph, impl):
    """``relu(D_dst A D_src X + bias)``."""
    gi, a = graph_info(graph), graph.dense()
    d_dst, d_src = torch.rand(graph.n) + 0.5, torch.rand(graph.n) + 0.5
    x, bias = torch.randn(graph.n, 5), torch.randn(5)
    compare(lambda a_, b_, x, bias: get("spmm_norm", impl)(gi, a_, b_, x, bias, "relu"),
            lambda a_, b_, x, bias: torch.relu(a_[:, None] * (a @ (b_[:, None] * x)) + bias),
            [d_dst, d_src, x, bias])


@pytest.mark.parametrize("impl", torch_impls("gat_aggregate"))
def test_gat_aggregate(graph, impl):
    """``Y[v, h] = sum_{u -> v} softmax_v(leaky_relu(el[u, h] + er[v, h])) X[u, h]``."""
    gi, heads, f = graph_info(graph), 2, 3
    el, er = torch.randn(graph.n, heads), torch.randn(graph.n, heads)
    feat = torch.randn(graph.n, heads, f)

    def ref(el, er, feat):
        e = F.leaky_relu(el[graph.src] + er[graph.dst], 0.2)[..., None]
        att = _edge_softmax_ref(graph, e)
        y = torch.zeros(graph.n, heads, f, dtype=feat.dtype)
        return y.index_add(0, graph.dst, att * feat[graph.src])

    compare(lambda el, er, feat: get("gat_aggregate", impl)(gi, el, er, feat, 0.2),
            ref, [el, er, feat])


def test_native_build_is_the_running_torchs():
    """Where the extension is loaded, it is the build for this torch, from its own folder."""
    if not native.available():
        pytest.skip(f"native kernels not loaded here: {native.LOAD_ERROR}")
    mod = sys.modules["granii._native"]
    assert Path(mod.__file__).resolve() == extension.path().resolve()
    assert extension.path().parent.name == f"torch-{torch.__version__}"


def test_memory_pool_reuses_blocks_on_this_torch():
    """In a fresh process: the pool becomes torch's CPU allocator, a freed large block comes back
    for the next request inside granii's scope (same address), values written through it are
    intact, and requests outside the scope go to torch's allocator."""
    if not native.available():
        pytest.skip(f"native kernels not loaded here: {native.LOAD_ERROR}")
    out = run_without_dgl("""
        import torch
        from granii.kernels import pool
        assert pool.install()
        n = (8 << 20) // 4                       # 8 MiB of float32, above the pool's 4 MiB
        pool.enter()
        a = torch.empty(n); first = a.data_ptr(); del a
        b = torch.arange(n, dtype=torch.float32); again = b.data_ptr()
        c = b.clone()                            # a copy of a pooled tensor
        pool.leave()
        s = pool.stats()
        assert again == first and s["hits"] >= 1, (first, again, s)
        assert torch.equal(c, torch.arange(n, dtype=torch.float32))
        before = pool.stats()["hits"] + pool.stats()["misses"]
        d = torch.empty(n)                       # outside the scope: torch's allocator
        assert pool.stats()["hits"] + pool.stats()["misses"] == before
        print("ok", s["hits"], s["misses"])
    """)
    assert out.startswith("ok")


# -- IR, enumeration, pruning, plans -----------------------------------------------------------
def gcn_ir():
    """GraphConv(norm="both") as the frontend lowers it: ``D_in^-1/2 A D_out^-1/2 H W + b``."""
    leaf = ir.Leaf
    return ir.Add(ir.MatMul((
        leaf("D_in^-0.5", "N", "N", ir.SPARSE, ir.DIAGONAL, ("degree", "in", -0.5, 1.0, 0.0)),
        leaf("A", "N", "N", ir.SPARSE, ir.UNWEIGHTED, ("graph",)),
        leaf("D_out^-0.5", "N", "N", ir.SPARSE, ir.DIAGONAL, ("degree", "out", -0.5, 1.0, 0.0)),
        leaf("H", "N", "k_in", ir.DENSE, ir.DATA, ("arg", "feat")),
        leaf("weight", "k_in", "k_out", ir.DENSE, ir.WEIGHT, ("param", "weight")))),
        leaf("bias", "1", "k_out", ir.DENSE, ir.WEIGHT, ("param", "bias")))


def gcn_plans():
    forest, n_trees = en.layer_forest(gcn_ir())
    kept = prune([tree_calls(root, choice) for root, choice in forest])
    return [lower(i, *forest[i], scenarios) for i, scenarios in kept.items()], n_trees


@pytest.mark.dgl
def test_hand_built_ir_is_what_the_frontend_lowers():
    from dgl.nn import GraphConv
    from granii.frontend import lower_layer
    assert lower_layer(GraphConv(4, 3)).root == gcn_ir()


def test_enumeration_and_pruning_keep_both_orders_of_the_product():
    """Every association of the five-factor product is enumerated; the promoted plans include
    the product first (``(H W)`` aggregated) and the aggregation first (``A (D H)`` then ``W``),
    and every promoted plan survives in some size scenario."""
    plans, n_trees = gcn_plans()
    assert n_trees > len(plans) >= 2
    assert any(p.composition().startswith("gemm") for p in plans)
    assert any(p.composition().endswith("gemm") for p in plans)
    assert all(p.scenarios for p in plans)


def gcn_reference(graph, h, w, b):
    a = graph.dense()
    d_in = a.sum(1).clamp(min=1) ** -0.5
    d_out = a.sum(0).clamp(min=1) ** -0.5
    return d_in[:, None] * (a @ (d_out[:, None] * (h @ w))) + b


def test_every_plan_with_every_torch_kernel_matches_the_reference(graph):
    """Each promoted plan, run with each implementation of each step that needs no DGL graph,
    gives ``D_in^-1/2 A D_out^-1/2 H W + b`` and its gradients in ``H``, ``W`` and ``b`` (zero
    in-degree and zero out-degree nodes included: degrees clamped to 1)."""
    plans, _ = gcn_plans()
    gen = torch.Generator().manual_seed(3)
    h, w, b = torch.randn(graph.n, 6, generator=gen), torch.randn(6, 4, generator=gen), \
        torch.randn(4, generator=gen)
    ran = 0
    for plan in plans:
        per_step = [[i for i in step_impls(s) if i != "dgl"] for s in plan.steps]
        assert all(per_step), f"a step of {plan.composition()} has only a DGL kernel"
        for k in range(max(len(o) for o in per_step)):
            impls = tuple(o[min(k, len(o) - 1)] for o in per_step)
            fn, _ = compile_plan(plan, impls)
            assert set(leaf_vals_order(plan)) == {"feat", "weight", "bias"}

            fresh = CsrGraph(graph.src, graph.dst, graph.n)     # no values cached from before

            def run(h, w, b):
                vals = {"feat": h, "weight": w, "bias": b}
                return fn(graph_info(fresh), None, *(vals[v] for v in leaf_vals_order(plan)))
            compare(run, lambda h, w, b: gcn_reference(graph, h, w, b), [h, w, b])
            ran += 1
    assert ran >= len(plans)


# -- cost models -------------------------------------------------------------------------------
def _models():
    out = [AnalyticalCost()]
    from granii import learned
    folders = sorted(p for p in (ROOT / "costmodels").glob("*") if (p / "manifest.json").is_file())
    if folders:      # maybe another machine's or stack's: read as a transfer (no fingerprint check)
        out.append(learned.load(folders[0], check=False))
    return out


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_cost_models_rank_the_plans_on_a_torch_graph(graph, model):
    """Every promoted plan gets a finite positive predicted time at both size scenarios, in
    inference and training, with the graph's features read from torch tensors."""
    plans, _ = gcn_plans()
    gi = graph_info(graph)
    for k_in, k_out in ((64, 8), (8, 64)):
        symbols = {"N": graph.n, "E": graph.num_edges(), "k_in": k_in, "k_out": k_out}
        for training in (False, True):
            ranking = rank(plans, gi, symbols, model, training=training)
            assert ranking and all(math.isfinite(c.cost) and c.cost > 0 for c in ranking)
            assert ranking == sorted(ranking, key=lambda c: c.cost)


def test_fingerprint_records_the_stack():
    """Models profiled on one stack are foreign on the other: the fingerprint holds the torch
    version and DGL's (``"missing"`` where it is not installed)."""
    fp = machine_fingerprint()
    assert fp["torch"] == torch.__version__.split("+")[0]
    assert (fp["dgl"] == "missing") == (not HAVE_DGL)


def test_granii_torch_csr_tensors_raise_no_warning_of_torch():
    """A plan's torch CSR product builds its sparse tensor from granii's own (valid) index: a
    user's process sees no warning of torch about it, on either stack (torch 2.11 on warns once
    where the invariant check is left implicit). A fresh process: torch warns once per process."""
    code = """
        import warnings
        warnings.resetwarnings()          # the default filters (this helper ignores warnings)
        import torch
        from granii.graph import graph_info
        from granii.index_graph import IndexGraph
        from granii.kernels import get
        g = IndexGraph(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0]), 3)
        x = torch.randn(3, 4)
        with warnings.catch_warnings(record=True) as caught:    # the filters a user has
            y = get("spmm", "torch_csr")(graph_info(g), x)
        assert torch.allclose(y, x[[2, 0, 1]]), y
        print("WARNINGS", [str(w.message)[:60] for w in caught])
    """
    out = run_without_dgl(code)
    assert "WARNINGS []" in out, out
