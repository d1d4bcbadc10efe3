"""Every promoted plan of DGL's GraphConv equals GraphConv: outputs and gradients, all configurations."""
import itertools

import dgl
import pytest
import torch
from dgl.nn import GraphConv

from granii import granii
from granii.runtime.bind import prepare
from graphs import GRAPHS, block, edge_weights
from plan_check import check_all_plans, state_for

CONFIGS = list(itertools.product(["none", "left", "right", "both"], [True, False], [True, False],
                                 [None, torch.relu], [False, True]))
SIZES = [(5, 9), (9, 5)]          # k_in < k_out and k_in > k_out


def make_layer(k_in, k_out, norm, weight, bias, act, allow_zero=True, seed=0):
    torch.manual_seed(seed)
    layer = GraphConv(k_in, k_out, norm=norm, weight=weight, bias=bias, activation=act,
                      allow_zero_in_degree=allow_zero)
    if bias:
        torch.nn.init.uniform_(layer.bias)      # DGL starts biases at zero: make them matter
    return layer


def call_args(g, k_in, k_out, weight, edge_w, seed=0):
    torch.manual_seed(seed + 1)
    feat = torch.randn(g.num_src_nodes(), k_in, requires_grad=True)
    kwargs, grad_inputs = {}, [feat]
    if not weight:
        kwargs["weight"] = torch.randn(k_in, k_out, requires_grad=True)
        grad_inputs.append(kwargs["weight"])
    if edge_w:
        kwargs["edge_weight"] = edge_weights(g).requires_grad_()
        grad_inputs.append(kwargs["edge_weight"])
    return feat, kwargs, grad_inputs


@pytest.mark.parametrize("norm,weight,bias,act,edge_w", CONFIGS)
def test_every_plan_equals_graphconv(norm, weight, bias, act, edge_w):
    n_run = 0
    for gname, make_graph in GRAPHS.items():
        g = make_graph()
        for k_in, k_out in SIZES:
            layer = make_layer(k_in, k_out, norm, weight, bias, act)
            feat, kwargs, grad_inputs = call_args(g, k_in, k_out, weight, edge_w)
            params = [p for p in layer.parameters()]
            n_run += check_all_plans(layer, (g, feat), kwargs, grad_inputs + params)
    assert n_run >= len(GRAPHS) * len(SIZES) * 2


@pytest.mark.parametrize("norm", ["none", "left", "right", "both"])
def test_every_plan_on_a_block(norm):
    b = block()
    assert b.num_src_nodes() > b.num_dst_nodes()
    for k_in, k_out in SIZES:
        layer = make_layer(k_in, k_out, norm, True, True, torch.relu)
        feat = torch.randn(b.num_src_nodes(), k_in, requires_grad=True)
        check_all_plans(layer, (b, feat), {}, [feat] + list(layer.parameters()))


def test_zero_in_degree_raises_dgls_error():
    g = GRAPHS["zero_in_degree"]()
    layer = make_layer(4, 3, "both", True, True, None, allow_zero=False)
    feat = torch.randn(g.num_nodes(), 4)
    with pytest.raises(dgl.DGLError, match="0-in-degree"):
        layer(g, feat)
    ok = dgl.add_self_loop(g)
    granii(layer, ok, torch.randn(ok.num_nodes(), 4))
    with pytest.raises(dgl.DGLError, match="0-in-degree"):
        layer(g, feat)
    torch.testing.assert_close(layer(ok, torch.ones(ok.num_nodes(), 4)),
                               granii.restore(layer)(ok, torch.ones(ok.num_nodes(), 4)))


def test_external_weight_with_own_weight_raises_like_dgl():
    g = GRAPHS["directed"]()
    layer = make_layer(4, 3, "both", True, True, None)
    granii(layer, g, torch.randn(g.num_nodes(), 4))
    with pytest.raises(dgl.DGLError, match="External weight"):
        layer(g, torch.randn(g.num_nodes(), 4), weight=torch.randn(4, 3))


class GCN(torch.nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            GraphConv(a, b, activation=torch.relu if i < len(sizes) - 2 else None)
            for i, (a, b) in enumerate(zip(sizes, sizes[1:])))

    def forward(self, g, x):
        for layer in self.layers:
            x = layer(g, x)
        return x


def test_granii_on_a_model_trains_like_dgl_and_restores():
    g = GRAPHS["undirected"]()
    x = torch.randn(g.num_nodes(), 12)
    y = torch.randint(0, 3, (g.num_nodes(),))
    torch.manual_seed(0)
    ref_model = GCN([12, 16, 3])
    model = GCN([12, 16, 3])
    model.load_state_dict(ref_model.state_dict())
    granii(model, g, x)
    assert all("forward" in layer.__dict__ for layer in model.layers)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in (ref_model, model)]
    for _ in range(5):           # the first layer's A x is cached: weights change, cache must not
        for m, opt in zip((ref_model, model), opts):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(g, x), y).backward()
            opt.step()
    for (k, a), (_, b) in zip(ref_model.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=k)
    assert set(model.state_dict()) == set(ref_model.state_dict())
    granii.restore(model)
    assert not any("forward" in layer.__dict__ for layer in model.layers)


def test_new_graph_and_changed_features_are_not_served_from_cache():
    g1, g2 = GRAPHS["directed"](), GRAPHS["undirected"]()
    model = GCN([6, 8, 4])
    ref = GCN([6, 8, 4])
    ref.load_state_dict(model.state_dict())
    x = torch.randn(g1.num_nodes(), 6)
    granii(model, g1, x)
    with torch.no_grad():
        for g in (g1, g2, g1):
            torch.testing.assert_close(model(g, x), ref(g, x))
        x.mul_(2.0)                      # in place: a new version of the same tensor
        torch.testing.assert_close(model(g1, x), ref(g1, x))


def test_wrong_feature_width_is_a_clear_error():
    g = GRAPHS["directed"]()
    model = GCN([6, 8, 4])
    granii(model, g, torch.randn(g.num_nodes(), 6))
    with pytest.raises(ValueError, match=r"expects input features of width 6.*in_feats=7"):
        model(g, torch.randn(g.num_nodes(), 7))
    with pytest.raises(ValueError, match="one row of features per node"):
        model(g, torch.randn(g.num_nodes() + 3, 6))


class UDFConv(torch.nn.Module):
    """A user layer whose Python message function multiplies source and destination features
    (u_mul_v): not in the IR."""
    def __init__(self, k_in, k_out):
        super().__init__()
        self.lin = torch.nn.Linear(k_in, k_out)

    def forward(self, graph, feat):
        with graph.local_scope():
            graph.srcdata["h"] = self.lin(feat)
            graph.update_all(lambda edges: {"m": edges.src["h"] * edges.dst["h"]},
                             dgl.function.sum("m", "h"))
            return graph.dstdata["h"]


def test_unsupported_layer_falls_back_and_explain_names_the_construct():
    g = GRAPHS["directed"]()
    layer = UDFConv(5, 3)
    x = torch.randn(g.num_nodes(), 5)
    ref = layer(g, x)
    granii(layer, g, x)
    torch.testing.assert_close(layer(g, x), ref)
    text = granii.explain(layer, file=open("/dev/null", "w"))
    assert "NOT OPTIMIZED" in text and "product of source and destination values" in text
    assert "message function '<lambda>'" in text


def test_explain_shows_ir_trees_choice_and_code():
    g = GRAPHS["undirected"]()
    model = GCN([20, 8, 4])
    granii(model, g, torch.randn(g.num_nodes(), 20))
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert text.count("12 enumerated (14 binary association orders in all), 8 pruned offline, "
                      "4 promoted") == 2
    assert "<- chosen" in text and "def plan_" in text
    assert "D_in^-0.5 . A . D_out^-0.5 . H . weight" in text


def test_tree_counts_per_configuration():
    """GraphConv's product is D_in^a A D_out^b H W with the degree factors present by ``norm``.

    ``both``: 5 factors have Catalan(4) = 14 binary trees; the two that associate D_in A D_out
    among themselves are one SDDMM, so 12 trees (the paper's 12). Pruning keeps, per scenario,
    the plans at the smaller width (k_out when k_in >= k_out, k_in otherwise) with either
    row-broadcast or precomputed-SDDMM normalisation: 4 promoted, 8 pruned (the paper's 12 and 8).
    ``left``/``right`` (one degree factor, 4 factors): Catalan(3) = 5 trees, 4 promoted.
    ``none`` (A H W): 2 trees, both promoted (aggregate first or update first).
    On a block N_dst < N_src: a GEMM on the destination rows only is smaller, so one more
    tree survives for ``right`` and ``both`` (5 promoted).
    """
    expected = {"none": (2, 2), "left": (5, 4), "right": (5, 4), "both": (12, 4)}
    expected_block = {"none": (2, 2), "left": (5, 4), "right": (5, 5), "both": (12, 5)}
    for norm in expected:
        for is_block, table in ((False, expected), (True, expected_block)):
            layer = make_layer(4, 3, norm, True, True, None)
            st = state_for(layer)
            from granii.runtime.variants import compile_layer as _compile
            comp = _compile(layer, frozenset(), is_block)
            assert (comp.n_trees, comp.n_promoted) == table[norm], (norm, is_block)
