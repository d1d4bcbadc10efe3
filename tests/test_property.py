"""Property: on any graph, any sizes and any configuration, a layer optimized by granii gives DGL's
outputs and gradients over consecutive training calls under the same seed, and in eval mode.

Graphs are drawn directed or not, with duplicate edges, self-loops, nodes without in-edges, or as
sampled blocks (``dgl.to_block``); layers with their norms, weights, biases, heads, hops,
aggregators, dropout probabilities and activations (with and without parameters). When DGL refuses
an input, the optimized layer must refuse it too.

Each compared call records what it ran (``granii.api.what_ran``): layers decide without the measured
tie-break (``tune=False``), so no call is DGL's forward standing in for a plan; a call that runs
DGL's forward is a fallback with its reason, and is counted as one.
"""
import copy
import functools

import dgl
import torch
import torch.nn.functional as F
from dgl.nn import GATConv, GINConv, GraphConv, SAGEConv, SGConv, TAGConv
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from torch import nn

from granii import granii
from granii.api import layer_states
from models import scaled_tanh
from test_real_models import (RTOL_GRAD, assert_close, assert_same_grads, projection, ran_in,
                              sync)

# Deterministic and bounded; no shrinking, so a failing run takes as long as a passing one (the
# failing example is reported as drawn, with every labelled choice).
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate), print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
WIDTHS = st.sampled_from([1, 2, 3, 5, 8])
CALLS = 3


# -- graphs -------------------------------------------------------------------------------------------
@st.composite
def graphs(draw, blocks=True):
    kinds = ["directed", "self_loops", "zero_in_degree", "bidirected"] + (["block"] if blocks
                                                                          else [])
    kind = draw(st.sampled_from(kinds))
    n = draw(st.integers(1, 24))
    m = draw(st.integers(0, 4 * n))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    u = torch.randint(0, n, (m,), generator=gen)
    v = torch.randint(0, n, (m,), generator=gen)
    if kind == "zero_in_degree":
        v = v % max(1, n // 2)
    dup = draw(st.integers(0, 5)) if m else 0       # repeated edges
    u, v = torch.cat([u, u[:dup]]), torch.cat([v, v[:dup]])
    g = dgl.graph((u, v), num_nodes=n)
    if kind == "self_loops":
        g = dgl.add_self_loop(g)
    elif kind == "bidirected":
        g = dgl.add_reverse_edges(g)
    elif kind == "block":
        n_dst = draw(st.integers(1, n))
        seeds = torch.randperm(n, generator=gen)[:n_dst]
        g = dgl.to_block(dgl.in_subgraph(g, seeds), dst_nodes=seeds)
    return kind, g


# -- module choices -------------------------------------------------------------------------------------
SLOPES = st.sampled_from([0.01, 0.2, 0.5])


@st.composite
def activations(draw):
    kind = draw(st.sampled_from(["none", "relu", "leaky", "elu", "prelu", "partial", "closure",
                                 "functional_elu"]))
    if kind == "none":
        return None
    if kind == "relu":
        return torch.relu
    if kind == "leaky":
        return nn.LeakyReLU(draw(SLOPES))
    if kind == "elu":
        return nn.ELU(alpha=draw(st.sampled_from([0.3, 1.0, 1.7])))
    if kind == "prelu":
        return nn.PReLU(init=draw(SLOPES))
    if kind == "partial":
        return functools.partial(F.leaky_relu, negative_slope=draw(SLOPES))
    if kind == "closure":
        return scaled_tanh(draw(st.sampled_from([0.5, 2.0])))
    return F.elu


DROPOUT = st.sampled_from([0.0, 0.3, 0.7])
# DGL refuses graphs with nodes without in-edges unless told otherwise: mostly allow them
ZERO_OK = st.sampled_from([True, True, True, False])


def norm_module(draw, width):
    """A normalisation of ``width`` columns; none below 3, where it only scales rounding."""
    if width < 3:
        return None
    kind = draw(st.sampled_from(["none", "layer", "batch"]), label="norm")
    if kind == "layer":
        return nn.LayerNorm(width)
    if kind == "batch":
        return nn.BatchNorm1d(width)
    return None


# -- comparison --------------------------------------------------------------------------------------
def check_against_dgl(make_layer, g, k_in, data, edge_weight_ok=True, input_grad_ok=True):
    """Build the layer (seeded), wrap a copy with granii, compare CALLS training calls and an eval
    call; or, when DGL refuses the input, check the wrapped layer refuses it too."""
    fresh_input = input_grad_ok and data.draw(st.booleans(),
                                              label="features with gradient, new each call")
    weighted = edge_weight_ok and data.draw(st.booleans(), label="edge weights")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), label="feature seed"))
    x = torch.randn(g.num_src_nodes(), k_in, generator=gen)
    w = torch.rand(g.num_edges(), generator=gen) + 0.1 if weighted else None
    torch.manual_seed(0)
    ref = make_layer()
    ref.train()
    model = copy.deepcopy(ref)
    try:
        copy.deepcopy(ref)(g, x, edge_weight=w)
    except Exception as e:       # noqa: BLE001 - whatever DGL refuses, granii must refuse
        event(f"DGL refuses the input: {type(e).__name__}")
        _check_refused(model, g, x, w, type(e))
        return
    granii(model, g, x, tune=False)
    ran = []
    what = f"{type(ref).__name__} on a graph of {g.num_src_nodes()}->{g.num_dst_nodes()} " \
           f"nodes, {g.num_edges()} edges"
    for i in range(CALLS):
        outs, grads = [], []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_() if fresh_input else x
            wi = None if w is None else w.clone().requires_grad_(input_grad_ok)
            torch.manual_seed(i)
            if m is model:
                out, r = ran_in(model, lambda: m(g, xi, edge_weight=wi))
                ran.append(r)
            else:
                out = m(g, xi, edge_weight=wi)
            if out.requires_grad:
                (out * projection(out)).sum().backward()
            outs.append(out)
            grads.append((xi.grad, None if wi is None else wi.grad))
        step = f"{what}, training call {i + 1}"
        assert_close(outs[1], outs[0], f"{step}: output")
        assert_same_grads(model, ref, step)
        for got, want, name in zip(grads[1], grads[0], ("features", "edge weights")):
            assert (got is None) == (want is None), f"{step}: gradient of the {name}"
            if want is not None:
                assert_close(got, want, f"{step}: gradient of the {name}", RTOL_GRAD)
        sgd_step(ref)
        sync(model, ref)
    model.eval()
    ref.eval()
    with torch.no_grad():
        for i in range(2):
            out, r = ran_in(model, lambda: model(g, x, edge_weight=w))
            ran.append(r)
            assert_close(out, ref(g, x, edge_weight=w), f"{what}, eval call {i + 1}")
    calls = [c for r in ran for c in r.values()]
    assert len(ran) == CALLS + 2 and all(len(r) == len(layer_states(model)) for r in ran), \
        f"{what}: a layer did not run on some call: {ran}"
    assert all(c.kind == "plan" or (c.kind == "fallback" and c.reason) for c in calls), \
        f"{what}: DGL's forward ran as a decision without the tie-break: {calls}"
    if all(c.kind == "plan" for c in calls):
        event("a plan ran on every call, training and eval")
    else:
        event("fell back: " + "; ".join(sorted({c.reason for c in calls if c.kind != "plan"})))


def sgd_step(model, lr=1e-2):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)


def _check_refused(model, g, x, w, error):
    try:
        granii(model, g, x)
        model(g, x, edge_weight=w)
    except Exception:            # noqa: BLE001 - granii may say it in its own words
        return
    raise AssertionError(f"DGL refused the input with {error.__name__}; granii ran it")


# -- the properties --------------------------------------------------------------------------------------
@SETTINGS
@given(graph=graphs(), k_in=WIDTHS, k_out=WIDTHS, data=st.data())
def test_graphconv(graph, k_in, k_out, data):
    kind, g = graph
    norm = data.draw(st.sampled_from(["none", "both", "right", "left"]), label="norm")
    weight = data.draw(st.booleans(), label="weight")
    k_out = k_out if weight else k_in
    bias = data.draw(st.booleans(), label="bias")
    act = data.draw(activations(), label="activation")
    zero_ok = data.draw(ZERO_OK, label="allow_zero_in_degree")
    make = lambda: GraphConv(k_in, k_out, norm=norm, weight=weight, bias=bias, activation=act,
                             allow_zero_in_degree=zero_ok)
    check_against_dgl(make, g, k_in, data)


@SETTINGS
@given(graph=graphs(), k_in=WIDTHS, k_out=WIDTHS, data=st.data())
def test_sageconv_mean(graph, k_in, k_out, data):
    kind, g = graph
    feat_drop = data.draw(DROPOUT, label="feat_drop")
    bias = data.draw(st.booleans(), label="bias")
    act = data.draw(activations(), label="activation")
    norm = norm_module(data.draw, k_out)
    make = lambda: SAGEConv(k_in, k_out, "mean", feat_drop=feat_drop, bias=bias, norm=norm,
                            activation=act)
    check_against_dgl(make, g, k_in, data)


@SETTINGS
@given(graph=graphs(), k_in=WIDTHS, k_out=WIDTHS, data=st.data())
def test_ginconv(graph, k_in, k_out, data):
    kind, g = graph
    aggregator = data.draw(st.sampled_from(["sum", "mean", "max"]), label="aggregator")
    apply = data.draw(st.sampled_from(["none", "linear", "mlp"]), label="apply_func")
    p = data.draw(DROPOUT, label="dropout in the MLP")
    hidden_act = data.draw(st.sampled_from(["relu", "leaky", "elu", "prelu"]),
                           label="MLP activation")
    slope = data.draw(SLOPES, label="its parameter")
    learn_eps = data.draw(st.booleans(), label="learn_eps")
    init_eps = data.draw(st.sampled_from([0.0, 0.3, -0.5]), label="init_eps")
    act = data.draw(activations(), label="activation")

    def make():
        func = {"none": None, "linear": nn.Linear(k_in, k_out),
                "mlp": nn.Sequential(nn.Linear(k_in, 6), nn.Dropout(p),
                                     {"relu": nn.ReLU(), "leaky": nn.LeakyReLU(slope),
                                      "elu": nn.ELU(slope), "prelu": nn.PReLU(6, slope)}[
                                         hidden_act], nn.Linear(6, k_out))}[apply]
        return GINConv(func, aggregator, init_eps=init_eps, learn_eps=learn_eps, activation=act)
    check_against_dgl(make, g, k_in, data, edge_weight_ok=aggregator != "max")


@SETTINGS
@given(graph=graphs(blocks=False), k_in=WIDTHS, k_out=WIDTHS, data=st.data())
def test_sgconv(graph, k_in, k_out, data):
    kind, g = graph
    k = data.draw(st.integers(1, 3), label="hops")
    cached = data.draw(st.booleans(), label="cached")
    bias = data.draw(st.booleans(), label="bias")
    zero_ok = data.draw(ZERO_OK, label="allow_zero_in_degree")
    # DGL caches the propagated features with their autograd graph: a cached layer trains for
    # more than one step in DGL itself only when nothing before the cache needs a gradient
    norm = None if cached else norm_module(data.draw, k_in)     # SGConv normalises its input
    make = lambda: SGConv(k_in, k_out, k=k, cached=cached, bias=bias, norm=norm,
                          allow_zero_in_degree=zero_ok)
    check_against_dgl(make, g, k_in, data, input_grad_ok=not cached)


@SETTINGS
@given(graph=graphs(blocks=False), k_in=WIDTHS, k_out=WIDTHS, data=st.data())
def test_tagconv(graph, k_in, k_out, data):
    kind, g = graph
    k = data.draw(st.integers(1, 3), label="hops")
    bias = data.draw(st.booleans(), label="bias")
    act = data.draw(activations(), label="activation")
    make = lambda: TAGConv(k_in, k_out, k=k, bias=bias, activation=act)
    check_against_dgl(make, g, k_in, data)


@SETTINGS
@given(graph=graphs(), k_in=WIDTHS, k_out=WIDTHS, data=st.data())
def test_gatconv(graph, k_in, k_out, data):
    kind, g = graph
    heads = data.draw(st.integers(1, 3), label="heads")
    feat_drop = data.draw(DROPOUT, label="feat_drop")
    attn_drop = data.draw(DROPOUT, label="attn_drop")
    slope = data.draw(SLOPES, label="negative_slope")
    residual = data.draw(st.booleans(), label="residual")
    bias = data.draw(st.booleans(), label="bias")
    act = data.draw(activations(), label="activation")
    zero_ok = data.draw(ZERO_OK, label="allow_zero_in_degree")
    make = lambda: GATConv(k_in, k_out, heads, feat_drop=feat_drop, attn_drop=attn_drop,
                           negative_slope=slope, residual=residual, bias=bias, activation=act,
                           allow_zero_in_degree=zero_ok)
    check_against_dgl(make, g, k_in, data)


class Stack(nn.Module):
    """Two GraphConv layers with their own activations and a dropout between them."""

    def __init__(self, widths, acts, p, zero_ok):
        super().__init__()
        self.conv1 = GraphConv(widths[0], widths[1], activation=acts[0],
                               allow_zero_in_degree=zero_ok)
        self.conv2 = GraphConv(widths[1], widths[2], activation=acts[1],
                               allow_zero_in_degree=zero_ok)
        self.dropout = nn.Dropout(p)

    def forward(self, g, x, edge_weight=None):
        h = self.dropout(self.conv1(g, x, edge_weight=edge_weight))
        return self.conv2(g, h, edge_weight=edge_weight)


@SETTINGS
@given(graph=graphs(blocks=False), k_in=WIDTHS, k_hidden=WIDTHS, k_out=WIDTHS, data=st.data())
def test_two_graphconv_layers(graph, k_in, k_hidden, k_out, data):
    kind, g = graph
    acts = (data.draw(activations(), label="first activation"),
            data.draw(activations(), label="second activation"))
    p = data.draw(DROPOUT, label="dropout")
    zero_ok = kind != "self_loops"
    make = lambda: Stack((k_in, k_hidden, k_out), acts, p, zero_ok)
    check_against_dgl(make, g, k_in, data)
