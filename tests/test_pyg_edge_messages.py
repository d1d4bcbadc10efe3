"""PyG's GINEConv and GATv2Conv through granii's plans: per-edge messages of node rows and edge
features (``ir.EdgeMessage``). Every plan and kernel against PyG (outputs; gradients of ``x``, of
``edge_attr`` and of every parameter), in training and eval, on directed and undirected graphs,
with isolated nodes and self loops; GATv2's attention dropout drawn as PyG draws it; the kernels
by ``gradcheck``; what ran through ``granii(...)``; the variants that still run PyG's forward."""
import copy
import warnings

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")

from granii import pyg  # noqa: E402
from granii.costmodel import AnalyticalCost  # noqa: E402
from granii.graph import graph_info  # noqa: E402
from granii.kernels import edge_message as em  # noqa: E402
from granii.pyg import FrontendError  # noqa: E402
from granii.pyg.graph import index_graph  # noqa: E402
from test_pyg_frontend import _graph, check_every_plan  # noqa: E402
from test_pyg_gat import _refused  # noqa: E402

warnings.filterwarnings("ignore", message=".*native kernels.*")
warnings.filterwarnings("ignore", message=".*Sparse invariant checks.*")

GRAPHS = ("directed", "undirected", "loops", "sources")    # directed: the last 3 nodes isolated


def _perturbed(layer):
    with torch.no_grad():            # a bias that is not zero, attention vectors of both signs
        for p in layer.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    return layer


def _edge_attr(ei, width, grad=True):
    return torch.randn(ei.shape[1], width, requires_grad=grad)


def _impls(prepared):
    return {i for _, impls in pyg.plan_choices(prepared) for i in impls}


# -- GINEConv -------------------------------------------------------------------------------------
GINE = {
    "plain": dict(),
    "edge_dim": dict(edge_dim=3),
    "train_eps": dict(train_eps=True, eps=0.3),
    "edge_dim_train_eps": dict(edge_dim=3, train_eps=True),
    "mean": dict(edge_dim=3, aggr="mean"),
}


def _gine(config, seed=0):
    torch.manual_seed(seed)
    nn = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    return _perturbed(pyg_nn.GINEConv(nn, **GINE[config]))


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("config", sorted(GINE))
def test_every_gine_plan_matches_pyg(config, graph):
    layer = _gine(config)
    ei = _graph(graph)
    x = torch.randn(14, 6, requires_grad=True)
    ea = _edge_attr(ei, 3 if "edge_dim" in GINE[config] else 6)
    assert check_every_plan(layer, x, ei, ea) >= 2
    prepared = pyg.prepare(layer, x, ei, ea)
    assert all("edge_message_sum" in p.composition() for p, _ in pyg.plan_choices(prepared))
    if em.AVAILABLE:
        assert "native" in _impls(prepared)


@pytest.mark.parametrize("config", ["plain", "edge_dim"])
def test_gine_in_eval_without_grad(config):
    layer = _gine(config).eval()
    ei = _graph("undirected")
    ea = _edge_attr(ei, 3 if config == "edge_dim" else 6, grad=False)
    with torch.no_grad():
        assert check_every_plan(layer, torch.randn(14, 6), ei, ea) >= 2


def test_lowered_gine():
    ei = _graph("directed")
    p = pyg.prepare(_gine("edge_dim"), torch.randn(14, 6), ei, _edge_attr(ei, 3))
    raw = str(p.pir.layer_ir.raw)
    assert "(((edge_sum(relu(H[src] + ((edge_attr . lin.weight^T) + lin.bias)[edge])) + " \
           "((1+eps)I . H)) . nn.0.weight^T) + nn.0.bias)" in raw, raw
    assert p.pir.how is None


def test_gine_edge_attr_of_another_width_lowers_again():
    """The plan holds while ``edge_attr`` has the features' width (the message's check): a
    call with another width reads the layer again, and refuses what PyG refuses."""
    ei = _graph("directed")
    layer = _gine("plain")
    pyg.prepare(layer, torch.randn(14, 6), ei, _edge_attr(ei, 6))
    with pytest.raises(FrontendError) as e:
        pyg.prepare(layer, torch.randn(14, 6), ei, _edge_attr(ei, 4))
    assert "feature widths" in str(e.value)


# -- GATv2Conv ------------------------------------------------------------------------------------
GATV2 = {
    "heads1": dict(heads=1),
    "heads4": dict(heads=4),
    "heads4_mean": dict(heads=4, concat=False),
    "heads1_mean": dict(heads=1, concat=False),
    "no_loops": dict(heads=4, add_self_loops=False),
    "share": dict(heads=2, share_weights=True),
    "residual": dict(heads=4, residual=True),
    "residual_mean": dict(heads=4, concat=False, residual=True),
    "no_bias_slope": dict(heads=2, bias=False, negative_slope=0.35),
    "edge_dim": dict(heads=4, edge_dim=3),
    "edge_dim1": dict(heads=1, edge_dim=3, concat=False),
    "edge_dim_no_loops": dict(heads=2, edge_dim=3, add_self_loops=False),
    "edge_dim_fill": dict(heads=2, edge_dim=3, fill_value=0.5),
    "edge_dim_fill_add": dict(heads=2, edge_dim=3, fill_value="add"),
}


def _gatv2(config, seed=0, **extra):
    torch.manual_seed(seed)
    return _perturbed(pyg_nn.GATv2Conv(6, 5, **GATV2[config], **extra))


def _gatv2_args(config, ei, grad=True):
    return (_edge_attr(ei, 3, grad),) if "edge_dim" in GATV2[config] else ()


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("config", sorted(GATV2))
def test_every_gatv2_plan_matches_pyg(config, graph):
    layer = _gatv2(config)
    ei = _graph(graph)
    x = torch.randn(14, 6, requires_grad=True)
    args = _gatv2_args(config, ei)
    assert check_every_plan(layer, x, ei, *args, seed=3) >= 2
    prepared = pyg.prepare(layer, x, ei, *args)
    compositions = [p.composition() for p, _ in pyg.plan_choices(prepared)]
    assert any("edge_message_score" in c for c in compositions), compositions
    assert any("edge_message ->" in c for c in compositions), compositions
    if em.AVAILABLE:
        assert "native" in _impls(prepared)


@pytest.mark.parametrize("config", ["heads4", "heads1_mean", "edge_dim"])
def test_gatv2_in_eval_without_grad(config):
    layer = _gatv2(config, dropout=0.5).eval()       # dropout is the identity in eval
    ei = _graph("undirected")
    args = _gatv2_args(config, ei, grad=False)
    with torch.no_grad():
        assert check_every_plan(layer, torch.randn(14, 6), ei, *args) >= 2
    assert "dropout" not in str(pyg.prepare(layer, torch.randn(14, 6), ei, *args)
                                .pir.layer_ir.raw)


@pytest.mark.parametrize("graph", ["directed", "loops"])
@pytest.mark.parametrize("config", ["heads1", "heads4", "heads4_mean", "no_loops", "edge_dim"])
def test_gatv2_attention_dropout_draws_as_pyg(config, graph):
    """In training with dropout every plan draws PyG's mask under the same seed (one
    ``F.dropout`` on the (E', heads) attention values, in PyG's edge order): equal outputs and
    gradients, the generator left as PyG leaves it."""
    layer = _gatv2(config, dropout=0.4)
    ei = _graph(graph)
    x = torch.randn(14, 6, requires_grad=True)
    args = _gatv2_args(config, ei)
    assert check_every_plan(layer, x, ei, *args, seed=7) >= 2
    assert "dropout(0.4)(edge_softmax(" in str(pyg.prepare(layer, x, ei, *args).pir.layer_ir.raw)


def test_gatv2_dropout_masks_differ_between_seeds():
    layer = _gatv2("heads4", dropout=0.4)
    p = pyg.prepare(layer, torch.randn(14, 6), _graph("directed"))
    torch.manual_seed(1)
    a = pyg.run(p)
    torch.manual_seed(2)
    assert not torch.allclose(a, pyg.run(p))


def test_lowered_gatv2():
    ei = _graph("loops")
    p = pyg.prepare(_gatv2("edge_dim"), torch.randn(14, 6), ei, _edge_attr(ei, 3))
    raw = str(p.pir.layer_ir.raw)
    assert "edge_softmax((leaky_relu(0.2)(((H . lin_r.weight^T) + lin_r.bias)[dst] + " \
           "((H . lin_l.weight^T) + lin_l.bias)[src] + (edge_attr_remaining_mean . " \
           "lin_edge.weight^T)[edge]) . blockdiag(att)))" in raw, raw
    # remove_self_loops, then add_self_loops: each edge that is not a loop, then one per node
    assert p.pir.how == "remaining"
    assert p.call.gi.num_edges == int((ei[0] != ei[1]).sum()) + 14


# -- the kernels ----------------------------------------------------------------------------------
def _blockdiag(blocks):
    heads = blocks.shape[0]
    eye = torch.eye(heads, dtype=blocks.dtype)
    return (blocks.unsqueeze(-1) * eye.unsqueeze(1)).reshape(-1, heads)


IMPLS = ["torch"] + (["native"] if em.AVAILABLE else [])
ACTS = [(None, 0.0), ("relu", 0.0), ("leaky_relu", 0.2)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("graph", ["directed", "loops"])
def test_edge_message_kernels_gradcheck(impl, act, graph):
    """Both primitives in float64 by ``gradcheck``, every subset of operands; the native kernel
    equals torch's."""
    ei = _graph(graph)
    gi = graph_info(index_graph(ei, 14))
    d = dict(dtype=torch.float64, requires_grad=True)
    a, b, c = torch.randn(14, 6, **d), torch.randn(14, 6, **d), torch.randn(ei.shape[1], 6, **d)
    blocks = torch.randn(2, 3, **d)
    sum_k = em.edge_message_sum_native if impl == "native" else em.edge_message_sum_torch
    score_k = em.edge_message_score_native if impl == "native" else em.edge_message_score_torch
    for ops in ((a, None, c), (a, b, c), (a, b, None), (None, None, c)):
        def f(*t):
            return sum_k(gi, *t, *act)

        def g(x, y, z, bl):
            return score_k(gi, x, y, z, *act, _blockdiag(bl))
        assert torch.autograd.gradcheck(f, ops)
        assert torch.autograd.gradcheck(g, ops + (blocks,))
        torch.testing.assert_close(f(*ops), em.edge_message_sum_torch(gi, *ops, *act))
        torch.testing.assert_close(g(*ops, blocks),
                                   em.edge_message_score_torch(gi, *ops, *act, _blockdiag(blocks)))


# -- granii(model, x, edge_index, edge_attr) ------------------------------------------------------
class GINE2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        mlp = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        self.conv1 = pyg_nn.GINEConv(mlp, edge_dim=3, train_eps=True)
        self.conv2 = pyg_nn.GATv2Conv(8, 4, heads=2, edge_dim=3, dropout=0.3)

    def forward(self, x, edge_index, edge_attr):
        x = torch.relu(self.conv1(x, edge_index, edge_attr))
        return self.conv2(x, edge_index, edge_attr)


def _grads(out, inputs):
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    return torch.autograd.grad((out * r).sum(), inputs)


def test_granii_runs_gine_and_gatv2_by_plans(capsys):
    from granii import granii
    from granii.api import what_ran
    torch.manual_seed(0)
    model = GINE2()
    original = copy.deepcopy(model)
    x, ei = torch.randn(30, 6), torch.randint(0, 27, (2, 120))
    ea = torch.randn(120, 3)
    granii(model, x, ei, ea, cost_model=AnalyticalCost(), tune=False)
    for seed in range(2):
        torch.manual_seed(seed)
        out = model(x, ei, ea)
        torch.manual_seed(seed)
        ref = original(x, ei, ea)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        for g, rg in zip(_grads(out, list(model.parameters())),
                         _grads(ref, list(original.parameters()))):
            torch.testing.assert_close(g, rg, atol=1e-4, rtol=1e-4)
        ran = what_ran(model)
        assert set(ran) == {"conv1", "conv2"}
        assert all(r.kind == "plan" for r in ran.values()), ran
    model.eval()
    original.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, ei, ea), original(x, ei, ea), atol=1e-4, rtol=1e-4)
        assert all(r.kind == "plan" for r in what_ran(model).values()), what_ran(model)
    granii.explain(model)
    shown = capsys.readouterr().out
    assert "edge_message_sum" in shown and "edge_message" in shown


# -- what still runs PyG's forward ----------------------------------------------------------------
def test_unsupported_variants_are_named():
    x, ei = torch.randn(14, 6), _graph("directed")
    ea = _edge_attr(ei, 3, grad=False)
    nn = torch.nn.Linear(6, 5)
    why = _refused(pyg_nn.GINEConv(nn, edge_dim=3, aggr="max"), x, ei, ea)
    assert "max of per-edge feature messages" in why
    why = _refused(_gatv2("edge_dim", fill_value="max"), x, ei, ea)
    assert "fill_value='max'" in why
    why = _refused(_gatv2("heads4"), x, ei, return_attention_weights=True)
    assert "return_attention_weights" in why


def test_granii_falls_back_for_an_unsupported_variant_with_the_reason():
    from granii import granii
    from granii.api import what_ran
    torch.manual_seed(0)
    layer = pyg_nn.GINEConv(torch.nn.Linear(6, 5), edge_dim=3, aggr="max")
    original = copy.deepcopy(layer)
    x, ei = torch.randn(14, 6), _graph("directed")
    ea = _edge_attr(ei, 3, grad=False)
    granii(layer, x, ei, ea, cost_model=AnalyticalCost(), tune=False)
    torch.testing.assert_close(layer(x, ei, ea), original(x, ei, ea))
    ran = what_ran(layer)["GINEConv"]
    assert ran.kind == "fallback" and "max of per-edge feature messages" in ran.reason


@pytest.mark.skipif(not em.AVAILABLE, reason="the native edge-message kernels are not built")
def test_edge_messages_priced_by_their_traffic():
    """torch's edge messages write the E x k messages and read them back: the analytical model
    prices them at three times the native pass, so the plan picked without timing runs GINE's
    aggregation and GATv2's scores natively."""
    import re
    from granii import granii
    gi = graph_info(index_graph(_graph("directed"), 14))
    dims = {"n": 14, "k": 6}
    for prim in ("edge_message_sum", "edge_message_score"):
        native, torch_ = (AnalyticalCost().predict(prim, impl, gi, dims)
                          for impl in ("native", "torch"))
        assert native < torch_ < 3.01 * native
    torch.manual_seed(0)
    model = GINE2()
    x, ei = torch.randn(30, 6), torch.randint(0, 27, (2, 120))
    granii(model, x, ei, torch.randn(120, 3), cost_model=AnalyticalCost(), tune=False)
    shown = granii.explain(model)
    # the chosen plans' steps ("t3  edge_message_sum  native  every call ...")
    steps = re.findall(r"^\s+t\d+\s+(edge_message\w*)\s+(\w+)\s", shown, re.M)
    assert {prim for prim, _ in steps} == {"edge_message_sum", "edge_message_score"}, shown
    assert all(impl == "native" for _, impl in steps), steps
