"""The models of the headline benchmark: DGL's example models as users write them, dropout included.

Full-batch models (``FULL``), in the shapes of DGL's examples (the classes of ``tests/models.py``
where they fit, ``SAGE`` below otherwise):

* ``gcn``    GraphConv(F, 16, relu) -> dropout 0.5 -> GraphConv(16, C);
* ``gat``    GATConv(F, 8 x 8 heads, elu) -> GATConv(64, C, 1 head), feature and attention
             dropout 0.6;
* ``sage``   SAGEConv(F, 16, mean) -> relu, dropout 0.5 -> SAGEConv(16, C, mean);
* ``gin``    4 GINConv layers (an MLP of two Linear with BatchNorm, sum, fixed eps), BatchNorm
             and relu after each, a sum-pooled prediction per layer with dropout 0.5; hidden 16;
* ``sgc``    SGConv(F, C, k=2); ``cached=True`` in training as DGL's example (the features do not
             change between epochs), ``cached=False`` on new features (a cache would be stale);
* ``tagcn``  TAGConv(F, 16, k=2, relu) -> dropout 0.5 -> TAGConv(16, C, k=2); the model keeps its
             graph and its forward takes only the features.

Mini-batch models (``SAMPLED``) take the blocks of a neighbour sampler, one block per layer, as
DGL's sampling examples do (hidden width 256, dropout 0.5): ``sage`` (3 mean SAGEConv layers,
fanouts 10/10/10), ``gcn`` (2 GraphConv layers, fanouts 10/10), ``gat`` (GATConv with 8 heads of 32,
then one head; fanouts 10/10).
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from dgl.nn import GATConv, GraphConv, SAGEConv
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import models as tm  # noqa: E402


class SAGE(nn.Module):
    """GraphSAGE with the mean aggregator; ``g`` is a graph (every layer on it) or a list of
    blocks (one per layer)."""

    def __init__(self, in_feats, hidden, classes, n_layers=2, dropout=0.5):
        super().__init__()
        widths = [in_feats] + [hidden] * (n_layers - 1) + [classes]
        self.layers = nn.ModuleList([SAGEConv(widths[i], widths[i + 1], "mean")
                                     for i in range(n_layers)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, g, features):
        graphs = g if isinstance(g, (list, tuple)) else [g] * len(self.layers)
        h = features
        for i, (layer, block) in enumerate(zip(self.layers, graphs)):
            h = layer(block, h)
            if i < len(self.layers) - 1:
                h = self.dropout(F.relu(h))
        return h


class BlockGCN(nn.Module):
    """GCN over the blocks of a neighbour sampler."""

    def __init__(self, in_feats, hidden, classes, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList([GraphConv(in_feats, hidden, activation=F.relu),
                                     GraphConv(hidden, classes)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, features):
        h = features
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            if i > 0:
                h = self.dropout(h)
            h = layer(block, h)
        return h


class BlockGAT(nn.Module):
    """GAT over the blocks of a neighbour sampler: heads concatenated, then one output head."""

    def __init__(self, in_feats, hidden, classes, heads=8, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList([
            GATConv(in_feats, hidden, heads, feat_drop=dropout, attn_drop=dropout,
                    activation=F.elu),
            GATConv(hidden * heads, classes, 1, feat_drop=dropout, attn_drop=dropout)])

    def forward(self, blocks, features):
        h = self.layers[0](blocks[0], features).flatten(1)
        return self.layers[1](blocks[1], h).mean(1)


@dataclass(frozen=True)
class Spec:
    name: str
    label: str
    build: object             # build(graph, in_feats, classes, training) -> nn.Module
    holds_graph: bool = False

    def run(self, model, g, x):
        return model(x) if self.holds_graph else model(g, x)


FULL = {
    "gcn": Spec("gcn", "GCN (2 GraphConv, 16 hidden)",
                lambda g, f, c, t: tm.GCN(f, 16, c, n_layers=2, dropout=0.5)),
    "gat": Spec("gat", "GAT (8 heads x 8, then 1 head)",
                lambda g, f, c, t: tm.GAT(f, 8, c, heads=(8, 1), feat_drop=0.6, attn_drop=0.6)),
    "sage": Spec("sage", "GraphSAGE (2 SAGEConv mean, 16 hidden)",
                 lambda g, f, c, t: SAGE(f, 16, c, n_layers=2, dropout=0.5)),
    "gin": Spec("gin", "GIN (4 GINConv with MLP + BatchNorm, 16 hidden)",
                lambda g, f, c, t: tm.GIN(f, 16, c, n_layers=4, learn_eps=False, dropout=0.5)),
    "sgc": Spec("sgc", "SGC (SGConv k=2; cached in training)",
                lambda g, f, c, t: tm.SGC(f, c, k=2, cached=t)),
    "tagcn": Spec("tagcn", "TAGCN (2 TAGConv k=2, 16 hidden)",
                  lambda g, f, c, t: tm.TAGCN(g, f, 16, c, n_layers=1, dropout=0.5),
                  holds_graph=True),
}

SAMPLED = {
    "sage": (Spec("sage", "GraphSAGE (3 SAGEConv mean, 256 hidden)",
                  lambda g, f, c, t: SAGE(f, 256, c, n_layers=3, dropout=0.5)), [10, 10, 10]),
    "gcn": (Spec("gcn", "GCN (2 GraphConv, 256 hidden)",
                 lambda g, f, c, t: BlockGCN(f, 256, c)), [10, 10]),
    "gat": (Spec("gat", "GAT (8 heads x 32, then 1 head)",
                 lambda g, f, c, t: BlockGAT(f, 32, c, heads=8)), [10, 10]),
}


def build(spec, g, in_feats, classes, training, seed=0):
    """The model of ``spec`` with the weights of ``seed``."""
    torch.manual_seed(seed)
    return spec.build(g, in_feats, classes, training)


def set_graph(model, g):
    """Point a model that keeps its graph (``model.g``) at ``g``; others are left alone."""
    if hasattr(model, "g"):
        model.g = g
    return model


__all__ = ["FULL", "SAMPLED", "Spec", "build", "set_graph", "SAGE", "BlockGCN", "BlockGAT"]
