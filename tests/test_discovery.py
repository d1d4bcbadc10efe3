"""Finding a model's GNN layers: the submodules that receive a graph when the model runs, whatever
their forward calls it (``bg``, ``hg``, ``mfg``, ``blocks``, a held ``self.g``, a ``dgl.sparse``
matrix). Layers granii can lower run its plans; the others run their own forward, with the reason
in ``explain``; outputs and gradients are the unwrapped model's either way."""
import copy
import io
import math

import dgl
import dgl.function as fn
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from granii import granii
from granii.api import find_layers, graph_receivers, what_ran

RTOL = 1e-4


def assert_close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-5, msg=lambda m: f"{what}: {m}")


def side_by_side(model, ref, run, calls=2):
    """Training calls (same seed on both sides, gradients compared), then an eval call."""
    for i in range(calls):
        for m in (model, ref):
            m.train()
            m.zero_grad()
        torch.manual_seed(i)
        out = run(model)
        torch.manual_seed(i)
        want = run(ref)
        assert_close(out, want, f"training call {i}")
        gen = torch.Generator().manual_seed(i)
        r = torch.randn(want.shape, generator=gen)
        (out * r).sum().backward()
        (want * r).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None, name
            else:
                assert_close(p.grad, q.grad, f"gradient of {name}, call {i}")
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert_close(run(model), run(ref), "eval")


# -- layers whose graph argument has another name ---------------------------------------------------
class Net(nn.Module):
    def __init__(self, conv, k=8):
        super().__init__()
        self.a = conv(k, 16)
        self.b = conv(16, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, g, x):
        return self.b(g, self.drop(F.relu(self.a(g, x))))


class BGConv(nn.Module):
    """A layer as DGL's batched-graph examples write it: ``forward(self, bg, h)``."""

    def __init__(self, i, o):
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, bg, h):
        with bg.local_scope():
            bg.ndata["h"] = h
            bg.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            return self.lin(bg.ndata["h"])


class HGConv(nn.Module):
    """``forward(self, hg, feat)``, mean aggregation and a self term."""

    def __init__(self, i, o):
        super().__init__()
        self.neigh = nn.Linear(i, o)
        self.self_ = nn.Linear(i, o, bias=False)

    def forward(self, hg, feat):
        with hg.local_scope():
            hg.srcdata["h"] = self.neigh(feat)
            hg.update_all(fn.copy_u("h", "m"), fn.mean("m", "h"))
            return hg.dstdata["h"] + self.self_(feat[:hg.num_dst_nodes()])


class MFGConv(nn.Module):
    """``forward(self, mfg, h)`` as DGL's mini-batch examples name a block."""

    def __init__(self, i, o):
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, mfg, h):
        with mfg.local_scope():
            mfg.srcdata["h"] = self.lin(h)
            mfg.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            return mfg.dstdata["h"]


def _batched_graph():
    dgl.seed(0)
    g = dgl.batch([dgl.rand_graph(30, 120), dgl.rand_graph(45, 160), dgl.rand_graph(12, 30)])
    torch.manual_seed(0)
    return g, torch.randn(g.num_nodes(), 8)


@pytest.mark.parametrize("conv", [BGConv, HGConv, MFGConv])
def test_layers_taking_bg_hg_mfg_are_found_and_run_plans(conv):
    """Before: ``granii`` raised "holds no GNN layer" (it looked for a parameter named like
    ``g``). Now the layers are the modules that received the graph, and they run plans."""
    g, x = _batched_graph()
    torch.manual_seed(0)
    model = Net(conv)
    ref = copy.deepcopy(model)
    granii(model, g, x, tune=False)
    assert [n for n, _ in find_layers(model, g, x)] == ["a", "b"]
    ran = []

    def run(m):
        out = m(g, x)
        if m is model:
            ran.append(what_ran(model))
        return out
    side_by_side(model, ref, run)
    for r in ran:
        assert {n: v.kind for n, v in r.items()} == {"a": "plan", "b": "plan"}, r


class SampledNet(nn.Module):
    """Mini-batch training as DGL's examples write it: ``forward(self, blocks, x)``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MFGConv(8, 16), MFGConv(16, 4)])

    def forward(self, blocks, x):
        h = x
        for i, (layer, mfg) in enumerate(zip(self.layers, blocks)):
            h = layer(mfg, h)
            if i == 0:
                h = F.relu(h)
        return h


class WholeBlocksLayer(nn.Module):
    """A layer that takes the list of blocks itself (no plan takes a list): it runs its own
    forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, blocks, h):
        for b in blocks:
            with b.local_scope():
                b.srcdata["h"] = h
                b.update_all(fn.copy_u("h", "m"), fn.mean("m", "h"))
                h = b.dstdata["h"]
        return self.lin(h)


def _blocks():
    dgl.seed(0)
    g = dgl.to_bidirected(dgl.rand_graph(200, 900))
    torch.manual_seed(0)
    x = torch.randn(g.num_nodes(), 8)
    loader = dgl.dataloading.DataLoader(g, torch.arange(40), dgl.dataloading.NeighborSampler(
        [4, 4]), batch_size=20, shuffle=False)
    return [(x[inp], blocks) for inp, _, blocks in loader]


def test_a_model_taking_a_list_of_blocks_has_its_layers_found():
    batches = _blocks()
    torch.manual_seed(0)
    model = SampledNet()
    ref = copy.deepcopy(model)
    granii(model, batches[0][1], batches[0][0])
    assert sorted(st for st in what_ran(model)) == ["layers.0", "layers.1"]
    for h, blocks in batches:
        side_by_side(model, ref, lambda m: m(blocks, h), calls=1)
        assert all(r.kind in ("plan", "original") for r in what_ran(model).values())


def test_a_layer_taking_the_list_of_blocks_runs_its_own_forward_and_says_why():
    batches = _blocks()
    torch.manual_seed(0)
    model = WholeBlocksLayer()
    ref = copy.deepcopy(model)
    granii(model, batches[0][1], batches[0][0])
    h, blocks = batches[1]
    side_by_side(model, ref, lambda m: m(blocks, h), calls=1)
    ran = what_ran(model)[type(model).__name__]
    assert ran.kind == "fallback" and "list" in ran.reason, ran
    assert ran.reason in granii.explain(model, file=io.StringIO())


# -- DGL's gcn_mp example: the graph held by the layer, Python message functions ---------------------
def gcn_msg(edge):
    return {"m": edge.src["h"] * edge.src["norm"]}


def gcn_reduce(node):
    return {"h": torch.sum(node.mailbox["m"], 1) * node.data["norm"]}


class NodeApplyModule(nn.Module):
    def __init__(self, out_feats, activation=None, bias=True):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(out_feats) * 0.1) if bias else None
        self.activation = activation

    def forward(self, nodes):
        h = nodes.data["h"]
        if self.bias is not None:
            h = h + self.bias
        if self.activation:
            h = self.activation(h)
        return {"h": h}


class GCNLayer(nn.Module):
    def __init__(self, g, in_feats, out_feats, activation, dropout, bias=True):
        super().__init__()
        self.g = g
        self.weight = nn.Parameter(torch.randn(in_feats, out_feats) / math.sqrt(out_feats))
        self.dropout = nn.Dropout(p=dropout) if dropout else 0.0
        self.node_update = NodeApplyModule(out_feats, activation, bias)

    def forward(self, h):
        if self.dropout:
            h = self.dropout(h)
        self.g.ndata["h"] = torch.mm(h, self.weight)
        self.g.update_all(gcn_msg, gcn_reduce, self.node_update)
        h = self.g.ndata.pop("h")
        return h


class GCNMP(nn.Module):
    def __init__(self, g, in_feats, hidden, classes, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList([GCNLayer(g, in_feats, hidden, F.relu, 0.0),
                                     GCNLayer(g, hidden, classes, None, dropout)])

    def forward(self, features):
        h = features
        for layer in self.layers:
            h = layer(h)
        return h


def test_dgls_gcn_mp_example_is_found_and_runs_its_own_forward():
    """examples/pytorch/gcn/gcn_mp.py: each layer holds the graph (``self.g``) and takes only
    the features. Before: "holds no GNN layer". Now the two layers are found (they hold the
    graph they read), run their own forward, and ``explain`` says why."""
    dgl.seed(0)
    g = dgl.add_self_loop(dgl.rand_graph(60, 240))
    g.ndata["norm"] = g.in_degrees().float().clamp(min=1).pow(-0.5).unsqueeze(1)
    torch.manual_seed(0)
    x = torch.randn(g.num_nodes(), 8)
    model = GCNMP(g, 8, 16, 4)
    ref = copy.deepcopy(model)
    ref.layers[0].g = ref.layers[1].g = g        # deepcopy copied the graph: share it, as model
    granii(model, g, x)
    side_by_side(model, ref, lambda m: m(x))
    ran = what_ran(model)
    assert sorted(ran) == ["layers.0", "layers.1"]
    assert all(r.kind == "fallback" for r in ran.values()), ran
    text = granii.explain(model, file=io.StringIO())
    assert "holds in self.g" in text and ran["layers.0"].reason in text


# -- DGL's sparse GCNII example (examples/sparse/gcnii.py): dgl.sparse products ---------------------
class GCNIIConvolution(nn.Module):
    def __init__(self, in_size, out_size):
        super().__init__()
        self.out_size = out_size
        self.weight = nn.Linear(in_size, out_size, bias=False)

    def forward(self, A_norm, H, H0, lamda, alpha, l):
        beta = math.log(lamda / l + 1)
        H = A_norm @ H
        H = (1 - alpha) * H + alpha * H0
        H = (1 - beta) * H + beta * self.weight(H)
        return H


class GCNII(nn.Module):
    def __init__(self, in_size, out_size, hidden_size, n_layers, lamda, alpha, dropout=0.5):
        super().__init__()
        self.lamda, self.alpha, self.dropout = lamda, alpha, dropout
        self.layers = nn.ModuleList([nn.Linear(in_size, hidden_size)]
                                    + [GCNIIConvolution(hidden_size, hidden_size)
                                       for _ in range(n_layers)]
                                    + [nn.Linear(hidden_size, out_size)])
        self.activation = nn.ReLU()

    def forward(self, A_norm, feature):
        H = F.dropout(feature, self.dropout, training=self.training)
        H = self.activation(self.layers[0](H))
        H0 = H
        for l, layer in enumerate(self.layers[1:-1]):
            H = F.dropout(H, self.dropout, training=self.training)
            H = self.activation(layer(A_norm, H, H0, self.lamda, self.alpha, l + 1))
        H = F.dropout(H, self.dropout, training=self.training)
        return self.layers[-1](H)


def test_dgl_sparse_gcnii_example_is_found_and_runs_its_own_forward():
    """A model on a ``dgl.sparse`` matrix: the convolutions receive it, are found, and run
    their own forward (the frontend does not lower ``dgl.sparse`` products), saying why."""
    dglsp = pytest.importorskip("dgl.sparse")
    dgl.seed(0)
    g = dgl.rand_graph(50, 200)
    src, dst = g.edges()
    n = g.num_nodes()
    a = dglsp.spmatrix(torch.stack([dst, src]), shape=(n, n))
    a_hat = a + dglsp.identity(a.shape)
    d_hat = dglsp.diag(a_hat.sum(1)) ** -0.5
    a_norm = d_hat @ a_hat @ d_hat
    torch.manual_seed(0)
    x = torch.randn(n, 8)
    model = GCNII(8, 4, 16, 3, 0.5, 0.1)
    ref = copy.deepcopy(model)
    granii(model, a_norm, x)
    side_by_side(model, ref, lambda m: m(a_norm, x))
    ran = what_ran(model)
    assert sorted(ran) == ["layers.1", "layers.2", "layers.3"]
    assert all(r.kind == "fallback" and "SparseMatrix" in r.reason for r in ran.values()), ran
    assert "SparseMatrix" in granii.explain(model, file=io.StringIO())


# -- what finding does not do ----------------------------------------------------------------------
class NoGraph(nn.Module):
    """Takes a graph but hands none to a submodule, and its own forward is the model's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, g, x):
        return self.lin(x)


def test_a_model_whose_modules_receive_no_graph_is_found_as_one_layer():
    """The model itself received the graph and none of its submodules did: it is the layer (it
    runs its plan: a product the graph does not enter)."""
    g, x = _batched_graph()
    model = NoGraph()
    assert [n for n, _ in find_layers(model, g, x)] == [""]


def test_a_model_given_no_graph_is_refused():
    model = NoGraph()
    _, x = _batched_graph()
    with pytest.raises(TypeError, match="holds no GNN layer"):
        granii(model, x, x)


def test_finding_the_layers_leaves_the_model_and_the_random_numbers_as_found():
    g, x = _batched_graph()
    torch.manual_seed(3)
    model = Net(BGConv)
    rng = torch.get_rng_state()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    found = find_layers(model, g, x)
    assert [n for n, _ in found] == ["a", "b"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_pre_hooks for m in model.modules())


# -- DGL's layers found without a run -----------------------------------------------------------------
class DGLNet(nn.Module):
    """DGL's layers with a user MLP inside one and plain modules around them."""

    def __init__(self, user_layer=None):
        super().__init__()
        from dgl.nn import GINConv, GraphConv, SumPooling
        self.a = GraphConv(8, 16)
        self.b = GINConv(nn.Sequential(nn.Linear(16, 4), nn.ReLU()), "sum")
        self.norm = nn.LayerNorm(16)
        self.pool = SumPooling()
        self.user = user_layer

    def forward(self, g, x):
        h = self.norm(F.relu(self.a(g, x)))
        if self.user is not None:
            h = self.user(g, h)
        return self.b(g, h), self.pool(g, h)


class UserConv(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, graph, h):
        with graph.local_scope():
            graph.ndata["h"] = h
            graph.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            return graph.ndata["h"]


def _forward_runs(model, monkeypatch):
    runs = []
    real = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a: runs.append(1) or real(self, *a))
    return runs


def test_a_model_of_dgls_layers_has_them_found_by_class_without_a_run(monkeypatch):
    """No module but DGL's layers could receive a graph: they are found by their class, and
    granii() runs the model once (to decide), not twice; what is found is what the run finds."""
    g = dgl.add_self_loop(dgl.rand_graph(30, 90))
    x = torch.randn(30, 8)
    model = DGLNet()
    by_run = [n for n, _ in graph_receivers(model, lambda: model(g, x))]
    assert [n for n, _ in find_layers(model, g, x)] == by_run == ["a", "b", "pool"]
    ref = copy.deepcopy(model)
    runs = _forward_runs(model, monkeypatch)
    granii(model, g, x)
    assert len(runs) == 1
    with torch.no_grad():
        for got, want in zip(model(g, x), ref(g, x)):
            assert_close(got, want, "output")


def test_a_user_layer_beside_dgls_is_found_by_the_run(monkeypatch):
    g = dgl.add_self_loop(dgl.rand_graph(30, 90))
    x = torch.randn(30, 8)
    model = DGLNet(UserConv())
    assert [n for n, _ in find_layers(model, g, x)] == ["a", "b", "pool", "user"]
    runs = _forward_runs(model, monkeypatch)
    granii(model, g, x)
    assert len(runs) == 2                      # the run that finds the layers, and the decision
    assert what_ran(model)["user"].kind in ("plan", "original")
