"""The PyTorch Geometric frontend: graph inputs, lowering of PyG layers, every plan against PyG."""
import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
import torch_geometric.utils as pyg_utils  # noqa: E402
from torch_geometric.nn import MessagePassing  # noqa: E402
from torch_geometric.utils import add_self_loops, degree  # noqa: E402

from granii import pyg  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.pyg_models import TutorialGCNConv  # noqa: E402
from granii.pyg import FrontendError  # noqa: E402

warnings.filterwarnings("ignore", message=".*native kernels.*")


# -- graphs ---------------------------------------------------------------------------------------
def _graph(kind, n=14, e=40, seed=0):
    """``edge_index`` of a small graph: ``directed`` (random edges, the last 3 nodes isolated,
    parallel edges possible), ``undirected`` (both directions of each edge), ``loops`` (directed
    with self loops, one node with two), ``sources`` (directed, some nodes with out-edges and no
    in-edges)."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n - 3, (e,), generator=gen)
    dst = torch.randint(0, n - 3, (e,), generator=gen)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if kind == "undirected":
        src, dst = torch.cat([src, dst]), torch.cat([dst, src])
    elif kind == "loops":
        loops = torch.tensor([0, 2, 2, 5])
        src, dst = torch.cat([src, loops]), torch.cat([dst, loops])
    elif kind == "sources":
        dst = torch.where(dst < 3, dst + 3, dst)       # nodes 0-2 receive nothing
    return torch.stack([src, dst])


GRAPHS = ("directed", "loops", "sources")     # "undirected" in the eval and dispatcher tests


def _grads(out, inputs, seed=0):
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * r).sum(), inputs, allow_unused=True)


def check_every_plan(layer, x, graph, *rest, atol=1e-4, seed=None, **kwargs):
    """Every promoted plan with every kernel that runs on an index graph equals PyG's forward in
    output and in the gradients of ``x``, the parameters and tensor arguments that require them.
    With ``seed``, PyG's forward and each plan run under that seed, and each plan leaves the
    random number generator as PyG's forward leaves it (the same draws, in the same number).
    Returns the number of (plan, kernels) run."""
    tensors = [x] + [t for t in list(rest) + list(kwargs.values())
                     if isinstance(t, torch.Tensor) and t.requires_grad]
    grad = torch.is_grad_enabled()
    original = copy.deepcopy(layer)        # PyG's forward fills the caches of cached layers
    inputs = tensors + [p for p in original.parameters() if p.requires_grad]
    if seed is not None:
        torch.manual_seed(seed)
    ref = original(x, graph, *rest, **kwargs)
    after = torch.get_rng_state()
    ref_grads = _grads(ref, inputs) if grad else None
    prepared = pyg.prepare(layer, x, graph, *rest, **kwargs)
    inputs = tensors + [p for p in layer.parameters() if p.requires_grad]
    choices = pyg.plan_choices(prepared)
    assert choices, "no plan runs on an index graph"
    for plan, impls in choices:
        if seed is not None:
            torch.manual_seed(seed)
        out = pyg.run(prepared, plan, impls)
        what = f"plan {plan.index} ({plan.composition()}) with {impls}"
        if seed is not None:
            assert torch.equal(torch.get_rng_state(), after), f"{what}: other random draws"
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")
        if not grad:
            continue
        for g, rg in zip(_grads(out, inputs), ref_grads):
            if rg is None or g is None:
                assert (g is None or not g.abs().sum()) and (rg is None or not rg.abs().sum())
                continue
            torch.testing.assert_close(g, rg, atol=atol, rtol=1e-4,
                                       msg=lambda m: f"{what}, gradient: {m}")
    return len(choices)


# -- the adapter ---------------------------------------------------------------------------------
def _as_inputs(ei, n):
    """The graph ``ei`` as PyG's three inputs: edge_index, EdgeIndex, adj_t (CSR, rows = targets)
    with the edge order of each (adj_t's is its row-major order)."""
    from torch_geometric import EdgeIndex
    adj_t = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), torch.arange(ei.shape[1]) + 1.0,
                                    (n, n)).coalesce().to_sparse_csr()
    return {"edge_index": ei, "EdgeIndex": EdgeIndex(ei.contiguous(), sparse_size=(n, n)),
            "adj_t": adj_t}


@pytest.mark.parametrize("kind", ["edge_index", "EdgeIndex", "adj_t"])
def test_adapter_reads_each_graph_input(kind):
    n = 14
    ei = torch.unique(_graph("directed", n), dim=1)        # adj_t would merge parallel edges
    ei = ei[:, torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(1))]
    graph_input = _as_inputs(ei.contiguous(), n)[kind]
    g = pyg.index_graph(graph_input, n)
    assert pyg.input_kind(graph_input) == kind and g.num_nodes() == n
    gi = pyg.graph_info(g)
    if kind == "adj_t":
        # edge e is the e-th stored entry: its value, its row the target, its column the source
        rows = torch.repeat_interleave(torch.arange(n), graph_input.crow_indices().diff())
        assert torch.equal(g.dst, rows) and torch.equal(g.src, graph_input.col_indices())
        assert torch.equal(g.values, graph_input.values())
    else:
        plain = graph_input.as_tensor() if kind == "EdgeIndex" else graph_input
        assert torch.equal(g.src, plain[0]) and torch.equal(g.dst, plain[1])
    a = torch.zeros(n, n)
    a.index_put_((g.dst, g.src), torch.ones(g.num_edges()), accumulate=True)
    indptr, src, eids = gi.csr_in()
    assert torch.equal(g.src[eids], src) and torch.equal(indptr.diff(), a.sum(1).long())
    indptr, dst, eids = gi.csr_out()
    assert torch.equal(g.dst[eids], dst) and torch.equal(indptr.diff(), a.sum(0).long())
    assert torch.equal(gi.in_degrees(), a.sum(1)) and torch.equal(gi.out_degrees(), a.sum(0))
    # a sum over in-edges with per-edge values in PyG's edge order
    x, w = torch.randn(n, 5), torch.rand(g.num_edges())
    from granii.kernels import get
    want = torch.zeros(n, 5).index_add_(0, g.dst, w[:, None] * x[g.src])
    torch.testing.assert_close(get("spmm_weighted", "torch_csr")(gi, w, x), want)


def test_adapter_reuses_a_graph_until_it_is_edited():
    ei = _graph("directed")
    g = pyg.index_graph(ei, 14)
    assert pyg.index_graph(ei, 14) is g
    assert pyg.graph_info(g) is pyg.graph_info(pyg.index_graph(ei, 14))
    assert pyg.index_graph(ei.clone(), 14) is not g
    ei[0, 0] = 13                          # an in-place edit is another graph
    g2 = pyg.index_graph(ei, 14)
    assert g2 is not g and g2.src[0] == 13


@pytest.mark.parametrize("how", ["add", "remaining"])
def test_derived_graphs_are_pygs_self_loops(how):
    ei, n = _graph("loops"), 14
    w = torch.rand(ei.shape[1])
    fn = pyg_utils.add_self_loops if how == "add" else pyg_utils.add_remaining_self_loops
    want, want_w = fn(ei, w, 2.0, n)
    d = pyg.derived(pyg.index_graph(ei, n), how)
    assert torch.equal(d.edge_index, want)
    from granii.pyg.bind import _weight
    from granii.pyg.values import EdgeW
    torch.testing.assert_close(_weight(EdgeW("w", how, 2.0), pyg.index_graph(ei, n), {"w": w}),
                               want_w)


# -- layers against PyG --------------------------------------------------------------------------
class TutorialGCN(TutorialGCNConv):
    """GCN as PyG's "Creating Message Passing Networks" tutorial writes it (the benchmark's
    layer), with a bias that is not zero."""

    def reset_parameters(self):
        super().reset_parameters()
        torch.nn.init.uniform_(self.bias)


class NoLoopsGCN(TutorialGCN):
    """The tutorial's normalisation without self loops: sources with no in-edge get 0."""

    def forward(self, x, edge_index):
        row, col = edge_index
        deg = degree(col, x.size(0), dtype=x.dtype)
        deg_inv_sqrt = deg.pow(-0.5)
        deg_inv_sqrt.masked_fill_(deg_inv_sqrt == float('inf'), 0)
        norm = deg_inv_sqrt[row] * deg_inv_sqrt[col]
        return self.propagate(edge_index, x=self.lin(x), norm=norm) + self.bias


def _mlp(k_in, k_out):
    return torch.nn.Sequential(torch.nn.Linear(k_in, 8), torch.nn.ReLU(), torch.nn.Linear(8, k_out))


LAYERS = {
    "gcn": lambda: pyg_nn.GCNConv(6, 5),
    "gcn_improved": lambda: pyg_nn.GCNConv(6, 5, improved=True),
    "gcn_noloops": lambda: pyg_nn.GCNConv(6, 5, add_self_loops=False),
    "gcn_nonorm_nobias": lambda: pyg_nn.GCNConv(6, 5, normalize=False, bias=False),
    "gcn_cached": lambda: pyg_nn.GCNConv(6, 5, cached=True),
    "sage_mean": lambda: pyg_nn.SAGEConv(6, 5),
    "sage_sum": lambda: pyg_nn.SAGEConv(6, 5, aggr="sum"),
    "sage_max": lambda: pyg_nn.SAGEConv(6, 5, aggr="max"),
    "sage_noroot": lambda: pyg_nn.SAGEConv(6, 5, root_weight=False),
    "sage_normalize": lambda: pyg_nn.SAGEConv(6, 5, normalize=True),
    "sage_project": lambda: pyg_nn.SAGEConv(6, 5, project=True),
    "sage_project_max_normalize": lambda: pyg_nn.SAGEConv(6, 5, aggr="max", project=True,
                                                          normalize=True),
    "tagconv": lambda: pyg_nn.TAGConv(6, 5, K=3),
    "gin": lambda: pyg_nn.GINConv(_mlp(6, 5)),
    "gin_eps": lambda: pyg_nn.GINConv(_mlp(6, 5), eps=0.3, train_eps=True),
    "sgconv": lambda: pyg_nn.SGConv(6, 5, K=2),
    "appnp": lambda: pyg_nn.APPNP(K=3, alpha=0.2),
    "graphconv": lambda: pyg_nn.GraphConv(6, 5),
    "graphconv_mean": lambda: pyg_nn.GraphConv(6, 5, aggr="mean"),
    "tutorial": lambda: TutorialGCN(6, 5),
    "tutorial_noloops": lambda: NoLoopsGCN(6, 5),
}
WEIGHTED = ("gcn", "gcn_improved", "gcn_noloops", "gcn_nonorm_nobias", "sgconv", "appnp",
            "graphconv", "graphconv_mean")


def _layer(name, seed=0):
    torch.manual_seed(seed)
    layer = LAYERS[name]()
    for p in layer.parameters():            # biases and eps not all zero
        with torch.no_grad():
            p.add_(torch.rand(p.shape) * 0.1)
    return layer


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_every_plan_matches_pyg(name, graph):
    layer = _layer(name)
    ei = _graph(graph)
    x = torch.randn(14, 6, requires_grad=True)
    assert check_every_plan(layer, x, ei) >= 1


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("name", WEIGHTED)
def test_every_plan_matches_pyg_with_edge_weight(name, graph):
    layer = _layer(name)
    ei = _graph(graph)
    x = torch.randn(14, 6, requires_grad=True)
    w = (torch.rand(ei.shape[1]) + 0.5).requires_grad_()
    assert check_every_plan(layer, x, ei, w) >= 1


@pytest.mark.parametrize("name", ["gcn", "sage_mean", "gin", "appnp", "tutorial"])
def test_every_plan_matches_pyg_in_eval_without_grad(name):
    layer = _layer(name).eval()
    with torch.no_grad():
        assert check_every_plan(layer, torch.randn(14, 6), _graph("undirected")) >= 1


def test_edge_index_object_lowers_as_edge_index():
    from torch_geometric import EdgeIndex
    ei = _graph("directed")
    x = torch.randn(14, 6, requires_grad=True)
    for name in ("gcn", "sage_mean"):
        assert check_every_plan(_layer(name), x, EdgeIndex(ei, sparse_size=(14, 14))) >= 1


def test_lowered_forms():
    """What the rules make of the layers: degree leaves where they are exact, per-edge values
    computed at the call where not."""
    x, ei = torch.randn(14, 6), _graph("directed")
    raw = {n: str(pyg.prepare(_layer(n), x, ei).pir.layer_ir.raw)
           for n in ("gcn", "tutorial", "gcn_noloops", "sage_mean", "gin")}
    assert raw["gcn"] == "((D_in^-0.5 . A . D_in^-0.5 . H . lin.weight^T) + bias)"
    assert raw["tutorial"] == "((D_in^-0.5 . A . D_in^-0.5 . H . lin.weight^T) + bias)"
    # without self loops a source may have no in-edge: PyG's 0, not a clamped 1
    assert raw["gcn_noloops"] == "((A[pyg_values0] . H . lin.weight^T) + bias)"
    assert raw["sage_mean"] == ("(((D_in^-1 . A . H . lin_l.weight^T) + lin_l.bias) + "
                                "(H . lin_r.weight^T))")
    assert "((A . H) + ((1+eps)I . H))" in raw["gin"]
    p = pyg.prepare(_layer("gcn"), x, ei)
    assert p.pir.how == "remaining" and p.call.gi.num_edges == 14 + (ei[0] != ei[1]).sum()
    assert any("spmm_norm" in plan.composition() for plan in p.plans)


def test_sgconv_cache_is_stored_and_then_read():
    layer = pyg_nn.SGConv(6, 5, K=2, cached=True)
    x, ei = torch.randn(14, 6), _graph("undirected")
    ref = pyg_nn.SGConv(6, 5, K=2, cached=True)
    ref.load_state_dict(layer.state_dict())
    want = ref(x, ei)
    out = pyg.run(pyg.prepare(layer, x, ei))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(layer._cached_x, ref._cached_x)
    p = pyg.prepare(layer, torch.randn(14, 6), ei)        # the cache, not the new features
    assert "_cached_x" in str(p.pir.layer_ir.raw)
    torch.testing.assert_close(pyg.run(p), ref(torch.randn(14, 6), ei))


# -- refusals -------------------------------------------------------------------------------------
class EdgeMLP(MessagePassing):
    def __init__(self):
        super().__init__(aggr="max")
        self.mlp = _mlp(12, 5)

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=x)

    def message(self, x_i, x_j):
        return self.mlp(torch.cat([x_i, x_j - x_i], dim=-1))


REFUSED = {
    "lstm": (lambda: pyg_nn.SAGEConv(6, 5, aggr="lstm"), "aggregation LSTMAggregation"),
    "multi": (lambda: pyg_nn.SAGEConv(6, 5, aggr=["mean", "max"]),
              "aggregation MultiAggregation"),
    "edgeconv": (lambda: pyg_nn.EdgeConv(_mlp(12, 5)), "'x_j - x_i'"),
    "edge_mlp": (EdgeMLP, "'x_j - x_i'"),
    "appnp_dropout": (lambda: pyg_nn.APPNP(K=2, alpha=0.1, dropout=0.5), "dropout"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_constructs_are_named(name):
    make, construct = REFUSED[name]
    torch.manual_seed(0)
    layer = make()
    with pytest.raises(FrontendError) as e:
        pyg.prepare(layer, torch.randn(14, 6), _graph("directed"))
    assert construct in str(e.value), str(e.value)


def _adj_t(graph):
    """``graph`` as a weighted ``torch.sparse`` CSR adjacency (rows = targets)."""
    ei = torch.unique(_graph(graph), dim=1)
    w = torch.rand(ei.shape[1], generator=torch.Generator().manual_seed(2)) + 0.5
    return torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), w, (14, 14)).coalesce() \
        .to_sparse_csr()


@pytest.mark.parametrize("graph", ["directed", "loops"])
@pytest.mark.parametrize("name", ["gcn_nonorm_nobias", "sage_mean", "sage_sum", "gin",
                                  "graphconv", "graphconv_mean"])
def test_every_plan_matches_pyg_on_a_sparse_adjacency(name, graph):
    """PyG runs ``message_and_aggregate`` (``spmm(adj_t, x, reduce)``) on it: its values weigh
    the messages."""
    x = torch.randn(14, 6, requires_grad=True)
    assert check_every_plan(_layer(name), x, _adj_t(graph)) >= 1


def test_sparse_adjacency_refusals_are_named():
    adj_t = _adj_t("directed")
    with pytest.raises(FrontendError, match="add_self_loops of a sparse adjacency"):
        pyg.prepare(_layer("gcn"), torch.randn(14, 6), adj_t)
    with pytest.raises(FrontendError, match="reduce='max'"):
        pyg.prepare(_layer("sage_max"), torch.randn(14, 6), adj_t)


# -- granii(model, x, edge_index) -----------------------------------------------------------------
# the analytical cost model: no calibration run (the tests are about binding and dispatch)
from granii.costmodel import AnalyticalCost  # noqa: E402


class TwoLayers(torch.nn.Module):
    """A PyG model as users write one: layers called with (x, edge_index[, edge_weight])."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x, edge_index, edge_weight=None):
        args = (edge_index,) if edge_weight is None else (edge_index, edge_weight)
        return self.second(torch.relu(self.first(x, *args)), edge_index)


def _model(first="gcn", second="sage_mean"):
    torch.manual_seed(0)
    a = _layer(first)
    b = _layer(second)
    b = type(b)(5, 3) if isinstance(b, (pyg_nn.SAGEConv, pyg_nn.GCNConv)) else b
    return TwoLayers(a, b)


def _same_grads(model, original, x, *args, calls=1):
    """``calls`` calls of ``model`` equal ``original``'s in outputs and in the gradients of the
    parameters and of the arguments that need one."""
    extra = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    for _ in range(calls):
        out, ref = model(x, *args), original(x, *args)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        for g, rg in zip(_grads(out, list(model.parameters()) + extra),
                         _grads(ref, list(original.parameters()) + extra)):
            torch.testing.assert_close(g, rg, atol=1e-4, rtol=1e-4)


def test_granii_optimizes_a_pyg_model_and_restores_it(capsys):
    from granii import granii
    from granii.api import what_ran
    model = _model()
    original = copy.deepcopy(model)
    x, ei = torch.randn(14, 6), _graph("undirected")
    # no tie-break (tune=False): on a graph this small PyG's own forward may win it
    assert granii(model, x, ei, cost_model=AnalyticalCost(), tune=False) is model
    ran = what_ran(model)
    assert set(ran) == {"first", "second"}
    _same_grads(model, original, x, ei, calls=3)        # training, gradients of every parameter
    assert all(r.kind == "plan" for r in what_ran(model).values()), what_ran(model)
    model.eval()
    original.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, ei), original(x, ei), atol=1e-4, rtol=1e-4)
    granii.explain(model)
    shown = capsys.readouterr().out
    assert "layer 'first' (GCNConv)" in shown and "D_in^-0.5 . A . D_in^-0.5" in shown
    granii.restore(model)
    assert "forward" not in vars(model.first) and "forward" not in vars(model.second)


class PreferTorchCsr(AnalyticalCost):
    """Prices torch's CSR kernels below the others, so plans run them (the weighted product's
    edge-value gradient included)."""

    def predict(self, prim, impl, gi, dims):
        return super().predict(prim, impl, gi, dims) * (0.01 if impl == "torch_csr" else 1.0)


def test_granii_passes_edge_weights_and_explains_a_refused_layer(capsys):
    from granii import granii
    from granii.api import what_ran
    torch.manual_seed(0)
    model = TwoLayers(_layer("gcn"), pyg_nn.SAGEConv(5, 3, aggr=["mean", "max"]))
    original = copy.deepcopy(model)
    x, ei = torch.randn(14, 6), _graph("directed")
    w = (torch.rand(ei.shape[1]) + 0.5).requires_grad_()
    # torch_csr's weighted product, edge-value gradient included, where it runs
    granii(model, x, ei, extra_args=(w,), cost_model=PreferTorchCsr(), tune=False)
    _same_grads(model, original, x, ei, w, calls=3)      # the edge weights' gradient too
    ran = what_ran(model)
    assert ran["second"].kind == "fallback" and "MultiAggregation" in ran["second"].reason
    assert ran["first"].kind == "plan", ran
    granii.explain(model)
    assert "MultiAggregation" in capsys.readouterr().out


def test_granii_takes_the_arguments_of_one_forward_call():
    """``granii(model, x, edge_index, edge_weight)``: the arguments of one call, as the model
    takes them (``GINEConv``'s edge feature vectors too, by a plan with PyG's outputs and
    gradients); too few arguments, or the same ones twice, is refused."""
    from granii import granii
    from granii.api import what_ran
    torch.manual_seed(0)
    gcn = _layer("gcn")
    original = copy.deepcopy(gcn)
    x, ei = torch.randn(14, 6), _graph("directed")
    w = torch.rand(ei.shape[1]) + 0.5
    granii(gcn, x, ei, w, tune=False)
    _same_grads(gcn, original, x, ei, w, calls=2)
    assert what_ran(gcn)["GCNConv"].kind == "plan"
    gine = pyg_nn.GINEConv(torch.nn.Linear(6, 4), edge_dim=3)
    original = copy.deepcopy(gine)
    ea = torch.randn(ei.shape[1], 3)
    granii(gine, x, ei, ea)
    _same_grads(gine, original, x, ei, ea, calls=2)
    ran = what_ran(gine)["GINEConv"]
    assert ran.kind == "plan", ran
    with pytest.raises(TypeError, match="arguments of one forward call"):
        granii(gcn, x)
    with pytest.raises(TypeError, match="not both"):
        granii(gcn, x, ei, w, extra_args=(w,))


NO_DGL = """
import sys
class _NoDGL:
    def find_spec(self, name, path=None, target=None):
        if name == "dgl" or name.startswith("dgl."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, _NoDGL())
import warnings
warnings.simplefilter("ignore")
import torch
from torch_geometric.nn import GCNConv, SAGEConv
from granii import pyg
ei = torch.randint(0, 12, (2, 40))
x = torch.randn(12, 6, requires_grad=True)
n = 0
for layer in (GCNConv(6, 4), SAGEConv(6, 4, aggr="max")):
    ref = layer(x, ei)
    p = pyg.prepare(layer, x, ei)
    for plan, impls in pyg.plan_choices(p):
        out = pyg.run(p, plan, impls)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        out.sum().backward()
        n += 1
assert not any(m == "dgl" or m.startswith("dgl.") for m in sys.modules), "dgl loaded"
print("plans", n)
"""


def test_pyg_layers_run_their_plans_without_dgl():
    """Nothing of granii/pyg, the core it drives or the kernels it picks imports DGL."""
    import subprocess
    import sys
    from pathlib import Path
    proc = subprocess.run([sys.executable, "-c", NO_DGL], capture_output=True, text=True,
                          timeout=240, cwd=Path(__file__).resolve().parent.parent,
                          env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 4


def test_granii_runs_a_pyg_model_once():
    """The PyG layers are found by their class: ``granii()`` runs the model once (the run that
    decides), not a second time to find them; an unused layer is wrapped and never run."""
    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = pyg_nn.GCNConv(6, 5), pyg_nn.GCNConv(5, 4)
            self.spare = pyg_nn.SAGEConv(6, 4)

        def forward(self, x, edge_index):
            runs.append(1)          # outside the module: granii() restores what it holds
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    runs = []
    torch.manual_seed(0)
    ref = Counted().eval()
    model = copy.deepcopy(ref)
    x, ei = torch.randn(30, 6), torch.randint(0, 30, (2, 90))
    import granii
    from granii.api import layer_states, what_ran
    with torch.no_grad():
        granii.granii(model, x, ei, cost_model=AnalyticalCost())
        assert len(runs) == 1
        torch.testing.assert_close(model(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert {st.name for st in layer_states(model)} == {"conv1", "conv2", "spare"}
    ran = what_ran(model)
    assert ran["conv1"].kind == ran["conv2"].kind == "plan" and ran["spare"] is None


def test_a_function_over_a_dimension_lowers_only_within_rows():
    """``F.normalize(out, dim=-1)`` (SAGEConv's ``normalize``) is a pure function of each row;
    over the rows (``dim=0``) or a softmax without a dim it is not, and is not lowered."""
    import torch.nn.functional as F
    from granii import ir
    from granii.frontend import udf
    from granii.frontend.values import Tensor
    t = Tensor(ir.Leaf("H", "N", "k_in", ir.DENSE, ir.DATA, ("arg", "x")), 2)
    assert udf.pure_ref(F.normalize, (t,), {"p": 2.0, "dim": -1}) is not None
    assert udf.pure_ref(F.normalize, (t,), {}) is not None           # dim=1 of a matrix
    assert udf.pure_ref(F.normalize, (t,), {"dim": 0}) is None
    assert udf.pure_ref(F.softmax, (t,), {}) is None
