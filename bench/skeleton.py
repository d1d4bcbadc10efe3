"""The dense skeleton of a model: what remains of its epoch when the graph work costs nothing.

``skeleton(model)`` is a copy of ``model`` whose DGL graph layers (GraphConv, SAGEConv, GATConv)
are replaced by their dense products on the destination rows, with no aggregation and no
attention: ``GraphConv``: ``act(H_dst W + b)``; ``SAGEConv``: ``act(fc_self(H_dst) +
fc_neigh(H_dst))``; ``GATConv``: ``act(fc(feat_drop(H_dst)) + b)`` per head. Everything around the
layers (sampling, the feature gather, dropout between layers, the loss, the optimizer) is left as
it is. Every plan of those layers makes these products (before or after aggregating, the weight
multiplies at least the destination rows), so the skeleton's epoch is a floor for any plan on
torch's GEMM, and DGL's epoch over it bounds the speedup reachable on that model and graph.

``skeleton(model, sources=True)`` projects every source row in GATConv (``fc(feat_drop(H_src))``,
then the destination rows): the floor of every GAT plan that projects before it aggregates, as
DGL's layer does. Only the per-head plans (each head's raw features aggregated, then multiplied by
that head's block of ``W``) can go below it, by doing more work on the edges.
"""
import copy

from dgl.nn import GATConv, GraphConv, SAGEConv
from torch import nn


class Skeleton(nn.Module):
    """``layer``'s dense products on the destination rows (see module doc)."""

    def __init__(self, layer, sources=False):
        super().__init__()
        self.layer, self.sources = layer, sources

    def forward(self, graph, feat, *args, **kwargs):
        layer = self.layer
        n = graph.num_dst_nodes() if graph.is_block else graph.num_nodes()
        h = (feat[1] if isinstance(feat, tuple) else feat)[:n]
        if isinstance(layer, GraphConv):
            out = h @ layer.weight if layer.weight is not None else h
            out = out + layer.bias if layer.bias is not None else out
            return layer._activation(out) if layer._activation else out
        if isinstance(layer, SAGEConv):
            out = layer.fc_self(h) + layer.fc_neigh(h)
            return layer.activation(out) if layer.activation else out
        heads, width = layer._num_heads, layer._out_feats
        if self.sources:
            src = feat[0] if isinstance(feat, tuple) else feat
            out = layer.fc(layer.feat_drop(src))[:n].view(n, heads, width)
        else:
            out = layer.fc(layer.feat_drop(h)).view(n, heads, width)
        if layer.bias is not None:
            out = out + layer.bias.view(1, heads, width)
        return layer.activation(out) if layer.activation else out


LAYERS = (GraphConv, SAGEConv, GATConv)


def skeleton(model, sources=False):
    """A copy of ``model`` with each graph layer replaced by its ``Skeleton``."""
    model = copy.deepcopy(model)
    for child in list(model.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, LAYERS):
                setattr(child, attr, Skeleton(sub, sources))
    return model


def has_gat(model):
    return any(isinstance(m, GATConv) for m in model.modules())


__all__ = ["skeleton", "Skeleton", "has_gat"]
