"""PyG's GATConv through granii's plans: every plan against PyG (outputs and the gradients of the
features, the projection, the attention vectors, the bias and the residual weight), attention
dropout drawn as PyG draws it, the three graph inputs, the refusals and the whole-model path."""
import copy
import warnings

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")

from granii import pyg  # noqa: E402
from granii.costmodel import AnalyticalCost  # noqa: E402
from granii.pyg import FrontendError  # noqa: E402
from test_pyg_frontend import _as_inputs, _grads, _graph, check_every_plan  # noqa: E402

warnings.filterwarnings("ignore", message=".*native kernels.*")
warnings.filterwarnings("ignore", message=".*Sparse invariant checks.*")

CONFIGS = {
    "heads1": dict(heads=1),
    "heads4": dict(heads=4),
    "heads4_mean": dict(heads=4, concat=False),
    "heads1_mean": dict(heads=1, concat=False),
    "no_loops": dict(heads=4, add_self_loops=False),
    "residual": dict(heads=4, residual=True),
    "residual_mean": dict(heads=4, concat=False, residual=True),
    "no_bias": dict(heads=2, bias=False),
    "slope": dict(heads=2, negative_slope=0.35, add_self_loops=False, bias=False),
}
GRAPHS = ("directed", "undirected", "loops", "sources")


def _gat(config, seed=0, **extra):
    torch.manual_seed(seed)
    layer = pyg_nn.GATConv(6, 5, **CONFIGS[config], **extra)
    with torch.no_grad():            # a bias that is not zero, attention vectors of both signs
        for p in layer.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    return layer


def check_plans_seeded(layer, x, graph, seed=7, atol=1e-4):
    """Every plan choice equals PyG's forward called under the same seed: outputs, gradients of
    ``x`` and of every parameter, and the random number generator's state after the call (the
    same draws, in the same number). Returns the number of (plan, kernels) run."""
    return check_every_plan(layer, x, graph, atol=atol, seed=seed)


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_gat_plan_matches_pyg(config, graph):
    layer = _gat(config)
    x = torch.randn(14, 6, requires_grad=True)
    n = check_plans_seeded(layer, x, _graph(graph))
    assert n >= 2
    # the fused GAT step is among them
    prepared = pyg.prepare(layer, x, _graph(graph))
    assert any("gat_aggregate" in p.composition() for p, _ in pyg.plan_choices(prepared))


@pytest.mark.parametrize("config", ["heads4", "heads1_mean", "residual_mean"])
def test_every_gat_plan_matches_pyg_in_eval_without_grad(config):
    layer = _gat(config, dropout=0.5).eval()         # dropout is the identity in eval
    with torch.no_grad():
        assert check_plans_seeded(layer, torch.randn(14, 6), _graph("undirected")) >= 2
    p = pyg.prepare(layer, torch.randn(14, 6), _graph("undirected"))
    assert "dropout" not in str(p.pir.layer_ir.raw)


@pytest.mark.parametrize("graph", ["directed", "loops"])
@pytest.mark.parametrize("config", ["heads1", "heads4", "heads4_mean", "no_loops"])
def test_attention_dropout_draws_as_pyg(config, graph):
    """In training with dropout every plan, fused (the mask drawn on ones) or not, draws PyG's
    mask under the same seed: equal outputs and gradients, the generator left as PyG leaves it."""
    layer = _gat(config, dropout=0.4)
    assert layer.training
    x = torch.randn(14, 6, requires_grad=True)
    assert check_plans_seeded(layer, x, _graph(graph)) >= 2
    raw = str(pyg.prepare(layer, x, _graph(graph)).pir.layer_ir.raw)
    assert "dropout(0.4)(edge_softmax(" in raw
    fused = [p for p, _ in pyg.plan_choices(pyg.prepare(layer, x, _graph(graph)))
             if "gat_aggregate" in p.composition()]
    assert fused, "attention dropout keeps the fused plans"


def test_dropout_masks_differ_between_seeds():
    """The test above is not vacuous: another seed gives another output."""
    layer = _gat("heads4", dropout=0.4)
    x, ei = torch.randn(14, 6), _graph("directed")
    p = pyg.prepare(layer, x, ei)
    torch.manual_seed(1)
    a = pyg.run(p)
    torch.manual_seed(2)
    b = pyg.run(p)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("kind", ["EdgeIndex", "adj_t"])
@pytest.mark.parametrize("config", ["heads4", "no_loops", "heads4_mean"])
def test_gat_on_each_graph_input(kind, config):
    """An ``EdgeIndex`` is read as ``edge_index``; on a sparse adjacency PyG sets its diagonal
    (``add_self_loops``) or reads its entries in CSR order. Parallel edges merge in a sparse
    adjacency, so the graph has none."""
    n = 14
    ei = torch.unique(_graph("loops", n), dim=1)
    graph_input = _as_inputs(ei.contiguous(), n)[kind]
    x = torch.randn(n, 6, requires_grad=True)
    assert check_plans_seeded(_gat(config), x, graph_input) >= 2


@pytest.mark.parametrize("kind", ["EdgeIndex", "adj_t"])
def test_gat_dropout_on_each_graph_input(kind):
    """Dropout in training without added loops: the edges in the input's order (a sparse
    adjacency's is its CSR order), as PyG draws them."""
    n = 14
    ei = torch.unique(_graph("directed", n), dim=1)
    graph_input = _as_inputs(ei.contiguous(), n)[kind]
    x = torch.randn(n, 6, requires_grad=True)
    assert check_plans_seeded(_gat("no_loops", dropout=0.3), x, graph_input) >= 2


def test_lowered_gat():
    x, ei = torch.randn(14, 6), _graph("directed")
    p = pyg.prepare(_gat("heads4"), x, ei)
    assert str(p.pir.layer_ir.raw) == (
        "((A[edge_softmax(leaky_relu(negative_slope=0.2)(sddmm_add((H . lin.weight^T . "
        "blockdiag(att_src)), (H . lin.weight^T . blockdiag(att_dst)))))] . H . lin.weight^T)"
        " + bias)")
    # remove_self_loops, then add_self_loops: each edge that is not a loop, then one per node
    assert p.pir.how == "remaining"
    assert p.call.gi.num_edges == int((ei[0] != ei[1]).sum()) + 14
    mean = pyg.prepare(_gat("residual_mean"), x, ei)
    assert str(mean.pir.layer_ir.raw).startswith("((mean_heads(4)((A[edge_softmax(")
    assert "(H . res.weight^T)) + bias)" in str(mean.pir.layer_ir.raw)
    assert pyg.prepare(_gat("no_loops"), x, ei).pir.how is None


# -- refusals -------------------------------------------------------------------------------------
def _refused(layer, *args, **kwargs):
    with pytest.raises(FrontendError) as e:
        pyg.prepare(layer, *args, **kwargs)
    return str(e.value)


def test_gat_refusals_are_named():
    x, ei = torch.randn(14, 6), _graph("directed")
    torch.manual_seed(0)
    edge_attr = torch.randn(ei.shape[1], 3)
    why = _refused(pyg_nn.GATConv(6, 5, heads=2, edge_dim=3), x, ei, edge_attr)
    assert "edge_attr" in why and "edge_dim" in why and "scores of edge features" in why
    why = _refused(pyg_nn.GATConv(6, 5, heads=2, edge_dim=1), x, ei, edge_attr[:, 0])
    assert "remove_self_loops of edge values" in why
    why = _refused(_gat("heads4"), x, ei, return_attention_weights=True)
    assert "return_attention_weights" in why
    adj_t = _as_inputs(torch.unique(ei, dim=1), 14)["adj_t"]
    why = _refused(_gat("heads4", dropout=0.2), x, adj_t)
    assert "attention dropout in training on a sparse adjacency" in why
    # an edge_dim layer called without edge attributes does not read lin_edge: it lowers
    torch.manual_seed(0)
    assert check_plans_seeded(pyg_nn.GATConv(6, 5, heads=2, edge_dim=3),
                              torch.randn(14, 6, requires_grad=True), ei) >= 2


def test_gine_refusal_is_named():
    """GINEConv lowers (``tests/test_pyg_edge_messages.py``); a max of its messages does not."""
    ei = _graph("directed")
    layer = pyg_nn.GINEConv(torch.nn.Linear(6, 5), edge_dim=3, aggr="max")
    why = _refused(layer, torch.randn(14, 6), ei, torch.randn(ei.shape[1], 3))
    assert "max of per-edge feature messages" in why


# -- granii(model, x, edge_index) -----------------------------------------------------------------
class GAT(torch.nn.Module):
    """PyG's GAT example: feature dropout, 8 heads concatenated, ELU, one averaged head."""

    def __init__(self, k_in, hidden, k_out, heads=8, v2=False):
        super().__init__()
        conv = pyg_nn.GATv2Conv if v2 else pyg_nn.GATConv
        self.conv1 = conv(k_in, hidden, heads=heads, dropout=0.6)
        self.conv2 = conv(hidden * heads, k_out, heads=1, concat=False, dropout=0.6)

    def forward(self, x, edge_index):
        x = torch.nn.functional.dropout(x, p=0.6, training=self.training)
        x = torch.nn.functional.elu(self.conv1(x, edge_index))
        x = torch.nn.functional.dropout(x, p=0.6, training=self.training)
        return self.conv2(x, edge_index)


def _seeded_same(model, original, x, ei, seed):
    torch.manual_seed(seed)
    out = model(x, ei)
    after = torch.get_rng_state()
    torch.manual_seed(seed)
    ref = original(x, ei)
    assert torch.equal(torch.get_rng_state(), after)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    if torch.is_grad_enabled():
        for g, rg in zip(_grads(out, list(model.parameters())),
                         _grads(ref, list(original.parameters()))):
            torch.testing.assert_close(g, rg, atol=1e-4, rtol=1e-4)


def test_granii_runs_a_pyg_gat_model_by_plans(capsys):
    from granii import granii
    from granii.api import what_ran
    torch.manual_seed(0)
    model = GAT(6, 4, 3)
    original = copy.deepcopy(model)
    x, ei = torch.randn(30, 6), torch.randint(0, 27, (2, 120))
    granii(model, x, ei, cost_model=AnalyticalCost(), tune=False)
    for seed in range(3):                   # training: dropout in and between the layers
        _seeded_same(model, original, x, ei, seed)
        ran = what_ran(model)
        assert set(ran) == {"conv1", "conv2"}
        assert all(r.kind == "plan" for r in ran.values()), ran
    model.eval()
    original.eval()
    with torch.no_grad():
        _seeded_same(model, original, x, ei, 0)
        assert all(r.kind == "plan" for r in what_ran(model).values()), what_ran(model)
    granii.explain(model)
    shown = capsys.readouterr().out
    assert "layer 'conv1' (GATConv)" in shown and "layer 'conv2' (GATConv)" in shown
    assert "edge_softmax" in shown and "last call ran: plan" in shown
    assert "mean_heads(1)" in shown
    granii.restore(model)
    assert "forward" not in vars(model.conv1)


def test_granii_runs_a_pyg_gatv2_model_by_plans(capsys):
    """GATv2 (per-edge ``leaky_relu(x_i + x_j)`` scores) runs by plans, dropout drawn as PyG."""
    from granii import granii
    from granii.api import what_ran
    torch.manual_seed(0)
    model = GAT(6, 4, 3, heads=2, v2=True)
    original = copy.deepcopy(model)
    x, ei = torch.randn(30, 6), torch.randint(0, 27, (2, 120))
    granii(model, x, ei, cost_model=AnalyticalCost(), tune=False)
    for seed in range(2):
        _seeded_same(model, original, x, ei, seed)
        ran = what_ran(model)
        assert all(r.kind == "plan" for r in ran.values()), ran
    granii.explain(model)
    assert "edge_message" in capsys.readouterr().out
