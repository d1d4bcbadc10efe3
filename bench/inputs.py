"""Graphs, features and labels of the headline benchmark (the real graphs shipped in ``data/``).

Cora and CiteSeer come with their Planetoid features, labels and training split
(``granii.datasets.load_planetoid``). For PubMed and GitHub (the largest graph shipped) only the
edges are shipped: their features are random with PubMed's width (500) and 128 for GitHub, labels
random over 3 and 2 classes, and the training nodes a fixed random 10%. Every graph gets exactly one
self-loop per node, as DGL's examples do before GCN and GAT (no node without in-edges).

Features are fixed by ``seed``; ``fresh_features`` gives new tensors for the calls that must see
features that are new each time.
"""
from dataclasses import dataclass

import dgl
import torch

from granii.datasets import PLANETOID, load_graph, load_planetoid

FULL_GRAPHS = ("cora", "citeseer", "pubmed", "github-social")
QUICK_GRAPHS = ("cora", "citeseer")
RANDOM_WIDTH = {"pubmed": (500, 3), "github-social": (128, 2)}


@dataclass
class Inputs:
    name: str
    g: object
    x: torch.Tensor
    y: torch.Tensor
    train: torch.Tensor       # boolean mask of the training nodes
    classes: int

    @property
    def features(self):
        return self.x.shape[1]


def with_self_loops(g):
    return dgl.add_self_loop(dgl.remove_self_loop(g))


def load(name, seed=0):
    """``Inputs`` of the graph ``name`` (see module doc)."""
    if name in PLANETOID:
        g, x, y, train, _, _ = load_planetoid(name)
        return Inputs(name, with_self_loops(g), x, y, train, int(y.max()) + 1)
    g = with_self_loops(load_graph(name))
    width, classes = RANDOM_WIDTH.get(name, (128, 4))
    gen = torch.Generator().manual_seed(seed)
    n = g.num_nodes()
    x = torch.randn(n, width, generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    train = torch.rand(n, generator=gen) < 0.1
    return Inputs(name, g, x, y, train, classes)


def fresh_graph(g):
    """A new graph object with the same edges (no formats built, nothing cached on it)."""
    u, v = g.edges(order="eid")
    return dgl.graph((u, v), num_nodes=g.num_nodes(), idtype=g.idtype)


class FreshFeatures:
    """``next()`` gives a new tensor each call (``pool`` random tensors of the shape, cloned in
    turn), so no call sees a tensor an earlier call saw. Make it outside the timed region."""

    def __init__(self, shape, pool=4, seed=1):
        gen = torch.Generator().manual_seed(seed)
        self.pool = [torch.randn(*shape, generator=gen) for _ in range(pool)]
        self.i = 0

    def next(self):
        self.i += 1
        return self.pool[self.i % len(self.pool)].clone()


__all__ = ["load", "Inputs", "FULL_GRAPHS", "QUICK_GRAPHS", "fresh_graph", "FreshFeatures",
           "with_self_loops"]
