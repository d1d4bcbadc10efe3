"""The repeated-call path of PyG layers: after a few calls on one graph input, a call binds its
operands with the generated reader (``runtime/fastpath.py``) instead of PyG's binder, with PyG's
outputs and gradients; anything the reader cannot prove sends the call the normal way."""
import copy

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")

from granii import granii  # noqa: E402
from granii.api import layer_states, what_ran  # noqa: E402
from granii.costmodel import AnalyticalCost  # noqa: E402
from granii.runtime import fastpath  # noqa: E402

N = 40


def _graph(seed=0, e=160):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, N, (e,), generator=gen)
    dst = torch.randint(0, N - 4, (e,), generator=gen)       # the last 4 nodes receive nothing
    return torch.stack([src, dst])


LAYERS = {
    "gcn": lambda: pyg_nn.GCNConv(8, 6),
    "sage": lambda: pyg_nn.SAGEConv(8, 6),
    "sage_max": lambda: pyg_nn.SAGEConv(8, 6, aggr="max"),
    "gin": lambda: pyg_nn.GINConv(torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU())),
    "gat": lambda: pyg_nn.GATConv(8, 3, heads=2),
}


def _normal_path_calls(monkeypatch):
    """A list that grows by one each time a call takes the dispatcher's normal path."""
    from granii.runtime import dispatch
    calls, real = [], dispatch.prepare
    monkeypatch.setattr(dispatch, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _optimized_pair(name, ei, x, grad=False):
    torch.manual_seed(0)
    ref = LAYERS[name]()
    layer = copy.deepcopy(ref)
    granii(layer, x, ei, cost_model=AnalyticalCost(), tune=False)
    with torch.set_grad_enabled(grad):
        for feats in [x] * fastpath._FAST_AFTER + [x, x.clone(), x.clone()]:
            layer(feats, ei)
    return layer, ref


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_repeated_pyg_calls_skip_the_binding_with_pygs_results(name, monkeypatch):
    ei = _graph()
    x = torch.randn(N, 8)
    layer, ref = _optimized_pair(name, ei, x)
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(N, 8)
            torch.testing.assert_close(layer(x, ei), ref(x, ei), atol=1e-5, rtol=1e-4)
    assert normal == [], "repeated calls on one graph must take the fast path"
    assert what_ran(layer)[next(iter(what_ran(layer)))].kind == "plan"
    # training: parameters read live, gradients as PyG's
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (layer, ref))
    for step in range(fastpath._FAST_AFTER + 4):
        x = torch.randn(N, 8)
        outs = [m(x, ei) for m in (layer, ref)]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
        for out, o in zip(outs, (opt, opt_ref)):
            o.zero_grad()
            out.square().sum().backward()
            o.step()
        for p, q in zip(layer.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)
        if step == fastpath._FAST_AFTER:
            normal.clear()                        # the training mode has its fast path now
    assert normal == []


def test_a_graph_edited_in_place_or_a_new_graph_takes_the_normal_path(monkeypatch):
    ei = _graph()
    x = torch.randn(N, 8)
    layer, ref = _optimized_pair("gcn", ei, x)
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        ei[0, :5] = torch.arange(5)                # the same tensor, other edges
        torch.testing.assert_close(layer(x, ei), ref(x, ei), atol=1e-5, rtol=1e-4)
        assert len(normal) == 1
        other = _graph(seed=3)
        torch.testing.assert_close(layer(x, other), ref(x, other), atol=1e-5, rtol=1e-4)
        assert len(normal) == 2
        same_edges = ei.clone()                    # equal values, another tensor
        torch.testing.assert_close(layer(x, same_edges), ref(x, same_edges), atol=1e-5,
                                   rtol=1e-4)
        assert len(normal) == 3


def test_per_edge_values_computed_per_call_keep_the_normal_path(monkeypatch):
    """GCN's edge weights are normalised per call (PyG's values with self loops added): the
    reader does not compute them, so those calls are bound the normal way, with PyG's results
    for every new weight."""
    ei = _graph()
    x = torch.randn(N, 8)
    torch.manual_seed(0)
    ref = LAYERS["gcn"]()
    layer = copy.deepcopy(ref)
    w = torch.rand(ei.shape[1]) + 0.5
    granii(layer, x, ei, w, cost_model=AnalyticalCost(), tune=False)
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        for i in range(fastpath._FAST_AFTER + 4):
            w = torch.rand(ei.shape[1]) + 0.5
            torch.testing.assert_close(layer(x, ei, w), ref(x, ei, w), atol=1e-5, rtol=1e-4)
    assert len(normal) == fastpath._FAST_AFTER + 4
    assert what_ran(layer)[next(iter(what_ran(layer)))].kind == "plan"


def test_a_changed_pyg_layer_is_seen(monkeypatch):
    ei = _graph()
    x = torch.randn(N, 8)
    layer, ref = _optimized_pair("gcn", ei, x)
    w = torch.randn(6, 8)
    for m in (layer, ref):
        m.lin.weight = torch.nn.Parameter(w.clone())    # re-assigned: read live, same shape
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(layer(x, ei), ref(x, ei), atol=1e-5, rtol=1e-4)
        assert normal == []
        w5, b5 = torch.randn(5, 8), torch.randn(5)
        for m in (layer, ref):                          # another width: sizes bound anew
            m.lin.weight = torch.nn.Parameter(w5.clone())
            m.bias = torch.nn.Parameter(b5.clone())
        torch.testing.assert_close(layer(x, ei), ref(x, ei), atol=1e-5, rtol=1e-4)
        assert len(normal) == 1
        for m in (layer, ref):
            m.bias = None
        normal.clear()
        torch.testing.assert_close(layer(x, ei), ref(x, ei), atol=1e-5, rtol=1e-4)
        assert normal, "a bias removed must send the call the normal way"


def test_features_of_another_width_or_a_keyword_graph_are_bound_the_normal_way(monkeypatch):
    ei = _graph()
    x = torch.randn(N, 8)
    layer, ref = _optimized_pair("sage", ei, x)
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, edge_index=ei), ref(x, edge_index=ei))
        assert len(normal) == 1
        fewer = torch.randn(N - 2, 8)              # fewer nodes: another graph for PyG too
        small = ei[:, (ei < N - 2).all(0)]
        torch.testing.assert_close(layer(fewer, small), ref(fewer, small), atol=1e-5,
                                   rtol=1e-4)
        assert len(normal) == 2
        assert all(st.fallback is None for st in layer_states(layer))
