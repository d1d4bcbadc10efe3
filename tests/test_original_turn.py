"""The layer's own forward in the measured tie-break: no turn where what it writes alone would
raise the process's peak memory far above what granii's plans need (PyG's messages, one row per
edge); a turn, as before, where the frontend knows of no such cost or it is small."""
import copy

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
from torch_geometric import EdgeIndex  # noqa: E402

from granii import granii, pyg  # noqa: E402
from granii.api import layer_states, what_ran  # noqa: E402
from granii.costmodel import AnalyticalCost  # noqa: E402
from granii.runtime import decide, dispatch  # noqa: E402
from granii.runtime.state import ORIGINAL, new_state  # noqa: E402


def _graph(n=60, e=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=gen)
    return ei[:, ei[0] != ei[1]]


def _bound(conv, x, g, *args):
    call = pyg.prepare_call(new_state(conv), conv, (x, g) + args, {})
    assert not isinstance(call, str), call
    return call


@pytest.mark.parametrize("name, widths, loops", [
    ("gcn", [5], True),            # lin first: messages of k_out, over the graph with self loops
    ("gat", [2 * 3], True),        # heads x features per edge
    ("sage", [6], False),          # messages of k_in, then lin
    ("gin", [6], False),
    ("appnp", [6, 6, 6], True),    # one propagate per step
])
def test_message_bytes_count_what_pygs_propagate_writes_per_edge(name, widths, loops):
    torch.manual_seed(0)
    conv = {"gcn": lambda: pyg_nn.GCNConv(6, 5),
            "gat": lambda: pyg_nn.GATConv(6, 3, heads=2),
            "sage": lambda: pyg_nn.SAGEConv(6, 5),
            "gin": lambda: pyg_nn.GINConv(torch.nn.Linear(6, 5)),
            "appnp": lambda: pyg_nn.APPNP(3, 0.1)}[name]()
    ei = _graph()
    x = torch.randn(60, 6)
    e = ei.shape[1] + (60 if loops else 0)
    assert _bound(conv, x, ei).original_bytes == 4 * e * sum(widths)


def test_fused_propagates_write_no_messages():
    """PyG runs ``message_and_aggregate`` on a sparse adjacency (GCN, SAGE) and on an
    ``EdgeIndex`` sorted by column for a layer that says it supports it: nothing per edge.
    GAT has no fused form and writes its messages on a sparse adjacency too."""
    torch.manual_seed(0)
    ei = _graph()
    x = torch.randn(60, 6)
    adj_t = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.shape[1]), (60, 60)).coalesce()
    assert _bound(pyg_nn.SAGEConv(6, 5), x, adj_t).original_bytes == 0
    assert _bound(pyg_nn.GATConv(6, 3, heads=2, add_self_loops=False), x,
                  adj_t).original_bytes == 4 * adj_t._nnz() * 6     # parallel edges merged

    class FusedOnEdgeIndex(pyg_nn.SAGEConv):
        SUPPORTS_FUSED_EDGE_INDEX = True

    order = torch.argsort(ei[1] * 60 + ei[0])
    by_col = EdgeIndex(ei[:, order], sparse_size=(60, 60), sort_order="col")
    unsorted = EdgeIndex(ei, sparse_size=(60, 60))
    assert _bound(FusedOnEdgeIndex(6, 5), x, by_col).original_bytes == 0
    assert _bound(FusedOnEdgeIndex(6, 5), x, unsorted).original_bytes == 4 * ei.shape[1] * 6
    assert _bound(pyg_nn.SAGEConv(6, 5), x, by_col).original_bytes == 4 * ei.shape[1] * 6


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = pyg_nn.GATConv(6, 32, heads=2)
        self.conv2 = pyg_nn.GCNConv(64, 3)

    def forward(self, x, edge_index):
        return self.conv2(torch.relu(self.conv1(x, edge_index)), edge_index)


def _run(monkeypatch, calls=30, **options):
    """``calls`` training calls of a 2-layer PyG model through granii, each against PyG's own
    results; the layers' own forwards the dispatcher ran."""
    torch.manual_seed(0)
    ref = TwoLayers()
    model = copy.deepcopy(ref)
    x, ei = torch.randn(60, 6), _graph(e=1200)      # messages many times a plan's results
    granii(model, x, ei, cost_model=AnalyticalCost(), **options)
    ran_own = []
    real = dispatch.original_forward

    def counted(layer, args, kwargs):
        ran_own.append(layer)
        return real(layer, args, kwargs)
    monkeypatch.setattr(dispatch, "original_forward", counted)
    for _ in range(calls):
        out, want = model(x, ei), ref(x, ei)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        out.square().sum().backward()
        want.square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)
    return model, ran_own


def test_a_forward_whose_messages_need_far_more_memory_than_the_plans_takes_no_turn(
        monkeypatch, capsys):
    monkeypatch.setattr(decide, "ORIGINAL_MEMORY_FLOOR", 0)
    model, ran_own = _run(monkeypatch)
    assert ran_own == []
    for st in layer_states(model):
        assert "takes no turn" in st.original_turn and "times the chosen plan" in st.original_turn
        assert st.tuned is None or all(label != ORIGINAL for label, _ in st.tuned[0])
    assert all(r.kind == "plan" for r in what_ran(model).values())
    granii.explain(model)
    assert "the original forward: its messages alone take" in capsys.readouterr().out


def test_a_forward_whose_messages_exceed_the_memory_limit_takes_no_turn(monkeypatch):
    model, ran_own = _run(monkeypatch, memory_limit=1000)
    assert ran_own == []
    assert all("over the memory limit of 1000 B" in st.original_turn
               for st in layer_states(model))


def test_small_messages_leave_the_forward_its_turn(monkeypatch):
    """On a small graph the messages are far below ``ORIGINAL_MEMORY_FLOOR``: PyG's forward
    takes its turns as before."""
    model, ran_own = _run(monkeypatch)
    assert {type(m) for m in ran_own} == {pyg_nn.GATConv, pyg_nn.GCNConv}
    assert all(st.original_turn is None for st in layer_states(model))


def test_a_dgl_layer_keeps_its_turn(monkeypatch):
    """DGL's frontend knows no least cost of DGL's forward (its builtin message passing is
    fused): ``original_bytes`` stays unknown and the forward takes its turn."""
    dgl = pytest.importorskip("dgl")
    from dgl.nn import GraphConv
    monkeypatch.setattr(decide, "ORIGINAL_MEMORY_FLOOR", 0)
    torch.manual_seed(0)
    ei = _graph()
    g = dgl.graph((ei[0], ei[1]), num_nodes=60)
    layer = GraphConv(6, 5, allow_zero_in_degree=True)
    x = torch.randn(60, 6)
    granii(layer, g, x, cost_model=AnalyticalCost())
    st = layer_states(layer)[0]
    for _ in range(200):                  # until the tie-break settles
        layer(g, x).sum().backward()
        if st.tuned is not None:
            break
    assert st.original_turn is None
    assert any(label == ORIGINAL for label, _ in st.tuned[0]) or st.tuned[1] == ORIGINAL
