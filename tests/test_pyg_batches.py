"""PyG models on sampled subgraphs, a new ``edge_index`` of another size every call.

PyG's ``NeighborLoader`` needs ``pyg-lib`` or ``torch-sparse`` to sample, and the package index
this project installs from serves neither for current torch (``pyg-lib`` is not there,
``torch-sparse`` only as source). Its batches are built here as it builds them, with PyG's own
``k_hop_subgraph``: the seed nodes first, then the other nodes within the hops, the edges among
them relabelled. Each batch is a new graph: its call binds anew and takes the decision of its
class of graphs (sizes and degree statistics alike), so granii ranks plans once, not per batch.
"""
import copy

import pytest
import torch

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GCNConv, GINConv, SAGEConv  # noqa: E402
from torch_geometric.utils import k_hop_subgraph, to_undirected  # noqa: E402

import granii  # noqa: E402
from granii.api import what_ran  # noqa: E402
from granii.runtime.dispatch import layer_states  # noqa: E402

N, K = 1500, 24


def _graph():
    torch.manual_seed(0)
    return to_undirected(torch.randint(0, N, (2, 9000)), num_nodes=N), torch.randn(N, K)


def sampled_batch(ei, x, seed, batch_size=48, hops=2):
    """``(x, edge_index, batch_size)`` of one batch as ``NeighborLoader`` gives it: seeds first."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randperm(N, generator=gen)[:batch_size]
    subset, _, _, _ = k_hop_subgraph(seeds, hops, ei, num_nodes=N)
    others = subset[~torch.isin(subset, seeds)]
    nodes = torch.cat([seeds, others])
    local = torch.full((N,), -1, dtype=torch.long)
    local[nodes] = torch.arange(nodes.numel())
    keep = (local[ei[0]] >= 0) & (local[ei[1]] >= 0)
    return x[nodes], local[ei[:, keep]], batch_size


class Net(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        if kind == "gcn":
            self.c1, self.c2 = GCNConv(K, 16), GCNConv(16, 8)
        elif kind == "sage":
            self.c1, self.c2 = SAGEConv(K, 16), SAGEConv(16, 8)
        else:
            mlp = lambda a, b: torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(),  # noqa: E731
                                                   torch.nn.Linear(b, b))
            self.c1, self.c2 = GINConv(mlp(K, 16)), GINConv(mlp(16, 8))

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


@pytest.mark.parametrize("kind", ["gcn", "sage", "gin"])
@pytest.mark.parametrize("training", [False, True])
def test_sampled_batches_equal_pyg_and_reuse_one_decision(kind, training):
    ei, x = _graph()
    torch.manual_seed(1)
    model = Net(kind)
    ref = copy.deepcopy(model)
    model.train(training)
    ref.train(training)
    xb, eb, _ = sampled_batch(ei, x, 0)
    # the cost model decides alone: a measured tie-break's turns on the last batches (a new class
    # of sizes starts one) would run PyG's forward as a turn, and under load it may keep it
    granii.granii(model, xb, eb, tune=False)
    sizes = set()
    for i in range(1, 16):
        xb, eb, bs = sampled_batch(ei, x, i)
        sizes.add(eb.shape[1])
        xa = xb.clone().requires_grad_(training)
        xr = xb.clone().requires_grad_(training)
        out, want = model(xa, eb)[:bs], ref(xr, eb)[:bs]
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        if training:
            out.square().sum().backward()
            want.square().sum().backward()
            torch.testing.assert_close(xa.grad, xr.grad, atol=1e-4, rtol=1e-4)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
                p.grad = q.grad = None
    assert len(sizes) > 5                                   # new graphs of other sizes
    assert all(r.kind == "plan" for r in what_ran(model).values()), what_ran(model)
    for st in layer_states(model):
        assert st.ranked <= 2 and st.class_reused >= 10, (st.name, st.ranked, st.class_reused)
