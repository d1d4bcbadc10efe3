"""Models the way users write them with DGL: the shapes of DGL's example models (GCN, GAT, GAT on
PPI, GraphSAGE, GIN, SGC, TAGCN, APPNP, GCNII, MixHop, JKNet, DAGNN, a message-passing GCN) and
the small variations real code has (dropout between and inside layers, activations with
parameters, shared modules, models that keep their graph).

``CASES`` lists one ``Case`` per model configuration; tests and benchmarks build each with
``case.build(graph, in_feats, zero_ok)`` and call it with ``case.run(model, graph, feats, w)``.
"""
import functools
import math
from dataclasses import dataclass

import dgl.function as fn
import torch
import torch.nn.functional as F
from dgl.nn import (APPNPConv, EdgeWeightNorm, GATConv, GINConv, GraphConv, JumpingKnowledge,
                    SAGEConv, SGConv, SumPooling, TAGConv)
from torch import nn

HIDDEN = 16
CLASSES = 5


# -- models of DGL's built-in layers ---------------------------------------------------------------
class GCN(nn.Module):
    """Kipf & Welling: GraphConv layers, dropout on the input of every layer after the first."""

    def __init__(self, in_feats, hidden, classes, n_layers=2, dropout=0.5, zero_ok=False,
                 norm="both"):
        super().__init__()
        widths = [in_feats] + [hidden] * (n_layers - 1) + [classes]
        self.layers = nn.ModuleList()
        for i in range(n_layers):
            last = i == n_layers - 1
            self.layers.append(GraphConv(widths[i], widths[i + 1], norm=norm,
                                         activation=None if last else F.relu,
                                         allow_zero_in_degree=zero_ok))
        self.dropout = nn.Dropout(dropout)

    def forward(self, g, features, edge_weight=None):
        h = features
        for i, layer in enumerate(self.layers):
            if i > 0:
                h = self.dropout(h)
            h = layer(g, h, edge_weight=edge_weight)
        return h


class GCNGraphClassifier(nn.Module):
    """Graph classification: GraphConv layers, then a sum readout over each graph's nodes and a
    linear classifier (the readout is a module that takes the graph too)."""

    def __init__(self, in_feats, hidden, classes, zero_ok=False):
        super().__init__()
        self.conv1 = GraphConv(in_feats, hidden, activation=F.relu, allow_zero_in_degree=zero_ok)
        self.conv2 = GraphConv(hidden, hidden, activation=F.relu, allow_zero_in_degree=zero_ok)
        self.readout = SumPooling()
        self.classify = nn.Linear(hidden, classes)
        self.dropout = nn.Dropout(0.5)

    def forward(self, g, features):
        h = self.conv2(g, self.dropout(self.conv1(g, features)))
        return self.classify(self.dropout(self.readout(g, h)))


class GCNEdgeNorm(nn.Module):
    """GCN on a weighted graph, the weights normalised by EdgeWeightNorm as DGL documents it."""

    def __init__(self, in_feats, hidden, classes, zero_ok=False):
        super().__init__()
        self.edge_norm = EdgeWeightNorm(norm="both")
        self.conv1 = GraphConv(in_feats, hidden, norm="none", activation=F.relu,
                               allow_zero_in_degree=zero_ok)
        self.conv2 = GraphConv(hidden, classes, norm="none", allow_zero_in_degree=zero_ok)
        self.dropout = nn.Dropout(0.3)

    def forward(self, g, features, edge_weight=None):
        w = None if edge_weight is None else self.edge_norm(g, edge_weight)
        h = self.conv1(g, features, edge_weight=w)
        return self.conv2(g, self.dropout(h), edge_weight=w)


class GAT(nn.Module):
    """Velickovic et al. on Cora: 8 heads concatenated with ELU, then one output head."""

    def __init__(self, in_feats, hidden, classes, heads=(8, 1), feat_drop=0.6, attn_drop=0.6,
                 zero_ok=False):
        super().__init__()
        self.layers = nn.ModuleList([
            GATConv(in_feats, hidden, heads[0], feat_drop=feat_drop, attn_drop=attn_drop,
                    activation=F.elu, allow_zero_in_degree=zero_ok),
            GATConv(hidden * heads[0], classes, heads[1], feat_drop=feat_drop,
                    attn_drop=attn_drop, allow_zero_in_degree=zero_ok),
        ])

    def forward(self, g, features, edge_weight=None):
        h = self.layers[0](g, features, edge_weight=edge_weight).flatten(1)
        return self.layers[1](g, h, edge_weight=edge_weight).mean(1)


class GATPPI(nn.Module):
    """The inductive GAT of the PPI experiment: three layers, residual connections from the
    second on, averaged output heads."""

    def __init__(self, in_feats, hidden, classes, heads=(4, 4, 6), zero_ok=False):
        super().__init__()
        self.layers = nn.ModuleList([
            GATConv(in_feats, hidden, heads[0], feat_drop=0.1, activation=F.elu,
                    allow_zero_in_degree=zero_ok),
            GATConv(hidden * heads[0], hidden, heads[1], feat_drop=0.1, residual=True,
                    activation=F.elu, allow_zero_in_degree=zero_ok),
            GATConv(hidden * heads[1], classes, heads[2], residual=True,
                    allow_zero_in_degree=zero_ok),
        ])

    def forward(self, g, features):
        h = features
        for layer in self.layers[:-1]:
            h = layer(g, h).flatten(1)
        return self.layers[-1](g, h).mean(1)


class GraphSAGE(nn.Module):
    """GraphSAGE with the mean aggregator, dropout on each layer's input features and a PReLU
    (an activation with its own parameters) between layers."""

    def __init__(self, in_feats, hidden, classes, feat_drop=0.5):
        super().__init__()
        self.layers = nn.ModuleList([
            SAGEConv(in_feats, hidden, "mean", feat_drop=feat_drop, activation=nn.PReLU(hidden)),
            SAGEConv(hidden, hidden, "mean", feat_drop=feat_drop, activation=nn.PReLU()),
            SAGEConv(hidden, classes, "mean", feat_drop=feat_drop),
        ])

    def forward(self, g, features, edge_weight=None):
        h = features
        for layer in self.layers:
            h = layer(g, h, edge_weight=edge_weight)
        return h


class SampledSAGE(nn.Module):
    """GraphSAGE over the blocks of a neighbour sampler, one block per layer."""

    def __init__(self, in_feats, hidden, classes, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList([SAGEConv(in_feats, hidden, "mean"),
                                     SAGEConv(hidden, classes, "mean")])
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, features):
        h = features
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i < len(self.layers) - 1:
                h = self.dropout(F.relu(h))
        return h


class GINMLP(nn.Module):
    """GIN's update function: two linear maps with batch normalisation and ReLU between."""

    def __init__(self, in_feats, hidden, out_feats):
        super().__init__()
        self.lin1 = nn.Linear(in_feats, hidden, bias=False)
        self.lin2 = nn.Linear(hidden, out_feats, bias=False)
        self.norm = nn.BatchNorm1d(hidden)

    def forward(self, x):
        return self.lin2(F.relu(self.norm(self.lin1(x))))


class GIN(nn.Module):
    """Xu et al.: GIN layers with MLP update, batch norm and ReLU after each layer, a prediction
    from the sum-pooled output of every layer (the input included) with dropout."""

    def __init__(self, in_feats, hidden, classes, n_layers=3, aggregator="sum", learn_eps=True,
                 dropout=0.5):
        super().__init__()
        self.gin_layers = nn.ModuleList()
        self.norms = nn.ModuleList()
        for i in range(n_layers):
            mlp = GINMLP(in_feats if i == 0 else hidden, hidden, hidden)
            self.gin_layers.append(GINConv(mlp, aggregator, learn_eps=learn_eps))
            self.norms.append(nn.BatchNorm1d(hidden))
        self.predict = nn.ModuleList([nn.Linear(in_feats if i == 0 else hidden, classes)
                                      for i in range(n_layers + 1)])
        self.pool = SumPooling()
        self.dropout = nn.Dropout(dropout)

    def forward(self, g, features, edge_weight=None):
        h = features
        per_layer = [h]
        for layer, norm in zip(self.gin_layers, self.norms):
            h = F.relu(norm(layer(g, h, edge_weight)))
            per_layer.append(h)
        score = 0
        for lin, h in zip(self.predict, per_layer):
            score = score + self.dropout(lin(self.pool(g, h)))
        return self.predict[-1](h) + score      # per node: its own logits and the graph's


class SGC(nn.Module):
    """Wu et al.: one SGConv with two hops (cached as in DGL's example when asked)."""

    def __init__(self, in_feats, classes, k=2, cached=False, zero_ok=False):
        super().__init__()
        self.conv = SGConv(in_feats, classes, k=k, cached=cached, allow_zero_in_degree=zero_ok)

    def forward(self, g, features, edge_weight=None):
        return self.conv(g, features, edge_weight=edge_weight)


class TAGCN(nn.Module):
    """TAGConv layers; the model keeps its graph and its forward takes only the features."""

    def __init__(self, g, in_feats, hidden, classes, n_layers=2, dropout=0.5):
        super().__init__()
        self.g = g
        self.layers = nn.ModuleList([TAGConv(in_feats, hidden, k=2, activation=F.relu)])
        for _ in range(n_layers - 1):
            self.layers.append(TAGConv(hidden, hidden, k=2, activation=F.relu))
        self.layers.append(TAGConv(hidden, classes, k=2))
        self.dropout = nn.Dropout(dropout)

    def forward(self, features):
        h = features
        for i, layer in enumerate(self.layers):
            if i > 0:
                h = self.dropout(h)
            h = layer(self.g, h)
        return h


class APPNP(nn.Module):
    """Klicpera et al.: an MLP predicts, personalised PageRank propagates; keeps its graph."""

    def __init__(self, g, in_feats, hidden, classes, feat_drop=0.5, edge_drop=0.3, k=3,
                 alpha=0.1):
        super().__init__()
        self.g = g
        self.lins = nn.ModuleList([nn.Linear(in_feats, hidden), nn.Linear(hidden, classes)])
        self.feat_drop = nn.Dropout(feat_drop)
        self.propagate = APPNPConv(k, alpha, edge_drop)

    def forward(self, features):
        h = F.relu(self.lins[0](self.feat_drop(features)))
        h = self.lins[1](self.feat_drop(h))
        return self.propagate(self.g, h)


class JKNet(nn.Module):
    """Xu et al.: a GraphConv stack whose layer outputs are combined by jumping knowledge
    (concatenation or maximum), then one more aggregation and a linear output."""

    def __init__(self, in_feats, hidden, classes, n_layers=3, mode="cat", dropout=0.5,
                 zero_ok=False):
        super().__init__()
        self.layers = nn.ModuleList([GraphConv(in_feats, hidden, activation=F.relu,
                                               allow_zero_in_degree=zero_ok)])
        for _ in range(n_layers - 1):
            self.layers.append(GraphConv(hidden, hidden, activation=F.relu,
                                         allow_zero_in_degree=zero_ok))
        self.jump = JumpingKnowledge(mode)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden * n_layers if mode == "cat" else hidden, classes)

    def forward(self, g, features):
        outputs = []
        h = features
        for layer in self.layers:
            h = self.dropout(layer(g, h))
            outputs.append(h)
        with g.local_scope():
            g.ndata["h"] = self.jump(outputs)
            g.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            return self.out(g.ndata["h"])


# -- user layers written with DGL's built-in message functions --------------------------------------
class GCNLayer(nn.Module):
    """A GCN layer written out by hand: dropout, linear map, symmetric normalisation around one
    update_all with built-in copy and sum."""

    def __init__(self, in_feats, out_feats, activation=None, dropout=0.0, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_feats, out_feats))
        self.bias = nn.Parameter(torch.zeros(out_feats)) if bias else None
        self.activation = activation
        self.dropout = nn.Dropout(dropout) if dropout else None
        nn.init.xavier_uniform_(self.weight)

    def forward(self, g, h):
        with g.local_scope():
            if self.dropout is not None:
                h = self.dropout(h)
            degs = g.in_degrees().float().clamp(min=1)
            norm = torch.pow(degs, -0.5).unsqueeze(1)
            g.ndata["h"] = torch.matmul(h, self.weight) * norm
            g.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            h = g.ndata["h"] * norm
            if self.bias is not None:
                h = h + self.bias
            if self.activation is not None:
                h = self.activation(h)
            return h


class MessagePassingGCN(nn.Module):
    def __init__(self, in_feats, hidden, classes, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList([
            GCNLayer(in_feats, hidden, F.relu, 0.0),
            GCNLayer(hidden, classes, None, dropout),
        ])

    def forward(self, g, features):
        h = features
        for layer in self.layers:
            h = layer(g, h)
        return h


class GCNIIConv(nn.Module):
    """GCNII's layer: normalised propagation mixed with the initial features, then an identity
    mapping blended with a weight."""

    def __init__(self, width, alpha, lamda, index, activation=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, width))
        self.alpha = alpha
        self.beta = math.log(lamda / index + 1)
        self.activation = activation
        nn.init.uniform_(self.weight, -width ** -0.5, width ** -0.5)

    def forward(self, graph, feat, initial):
        with graph.local_scope():
            src_norm = torch.pow(graph.out_degrees().float().clamp(min=1), -0.5).unsqueeze(1)
            dst_norm = torch.pow(graph.in_degrees().float().clamp(min=1), -0.5).unsqueeze(1)
            graph.srcdata["h"] = feat * src_norm
            graph.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            rst = graph.dstdata["h"] * dst_norm
            rst = (1 - self.alpha) * rst + self.alpha * initial
            rst = self.beta * torch.matmul(rst, self.weight) + (1 - self.beta) * rst
            if self.activation is not None:
                rst = self.activation(rst)
            return rst


class GCNII(nn.Module):
    def __init__(self, in_feats, hidden, classes, n_layers=3, alpha=0.1, lamda=0.5, dropout=0.5):
        super().__init__()
        self.lin_in = nn.Linear(in_feats, hidden)
        self.convs = nn.ModuleList([GCNIIConv(hidden, alpha, lamda, i + 1, F.relu)
                                    for i in range(n_layers)])
        self.lin_out = nn.Linear(hidden, classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, g, features):
        h0 = F.relu(self.lin_in(self.dropout(features)))
        h = h0
        for conv in self.convs:
            h = conv(g, self.dropout(h), h0)
        return self.lin_out(self.dropout(h))


class MixHopConv(nn.Module):
    """MixHop's layer: a linear map of each power of the normalised adjacency, concatenated,
    batch-normalised, activated and dropped out."""

    def __init__(self, in_feats, out_feats, powers=(0, 1, 2), dropout=0.0, activation=None,
                 batchnorm=True):
        super().__init__()
        self.powers = powers
        self.activation = activation
        self.dropout = nn.Dropout(dropout)
        self.bn = nn.BatchNorm1d(out_feats * len(powers)) if batchnorm else None
        self.weights = nn.ModuleDict({str(j): nn.Linear(in_feats, out_feats, bias=False)
                                      for j in powers})

    def forward(self, graph, feats):
        with graph.local_scope():
            degs = graph.in_degrees().float().clamp(min=1)
            norm = torch.pow(degs, -0.5).unsqueeze(1)
            outputs = []
            for j in range(max(self.powers) + 1):
                if j in self.powers:
                    outputs.append(self.weights[str(j)](feats))
                feats = feats * norm
                graph.ndata["h"] = feats
                graph.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
                feats = graph.ndata.pop("h") * norm
            final = torch.cat(outputs, dim=1)
            if self.bn is not None:
                final = self.bn(final)
            if self.activation is not None:
                final = self.activation(final)
            return self.dropout(final)


class MixHop(nn.Module):
    def __init__(self, in_feats, hidden, classes, powers=(0, 1, 2), input_drop=0.7,
                 layer_drop=0.9):
        super().__init__()
        width = hidden * len(powers)
        self.dropout = nn.Dropout(input_drop)
        self.layers = nn.ModuleList([
            MixHopConv(in_feats, hidden, powers, input_drop, torch.tanh),
            MixHopConv(width, hidden, powers, layer_drop, torch.tanh),
        ])
        self.out = nn.Linear(width, classes, bias=False)

    def forward(self, graph, feats):
        feats = self.dropout(feats)
        for layer in self.layers:
            feats = layer(graph, feats)
        return self.out(feats)


class DAGNNConv(nn.Module):
    """DAGNN's adaptive propagation: hop outputs stacked and weighted by a learned score."""

    def __init__(self, width, k):
        super().__init__()
        self.s = nn.Parameter(torch.empty(width, 1))
        self.k = k
        nn.init.xavier_uniform_(self.s, gain=nn.init.calculate_gain("sigmoid"))

    def forward(self, graph, feats):
        with graph.local_scope():
            results = [feats]
            norm = torch.pow(graph.in_degrees().float().clamp(min=1), -0.5).unsqueeze(1)
            for _ in range(self.k):
                feats = feats * norm
                graph.ndata["h"] = feats
                graph.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
                feats = graph.ndata["h"] * norm
                results.append(feats)
            stacked = torch.stack(results, dim=1)
            scores = torch.sigmoid(torch.matmul(stacked, self.s)).permute(0, 2, 1)
            return torch.matmul(scores, stacked).squeeze(1)


class DAGNN(nn.Module):
    def __init__(self, in_feats, hidden, classes, k=4, dropout=0.5):
        super().__init__()
        self.lin1 = nn.Linear(in_feats, hidden)
        self.lin2 = nn.Linear(hidden, classes)
        self.dropout = nn.Dropout(dropout)
        self.prop = DAGNNConv(classes, k)

    def forward(self, graph, feats):
        h = F.relu(self.lin1(self.dropout(feats)))
        h = self.lin2(self.dropout(h))
        return self.prop(graph, h)


class PReLUMeanConv(nn.Module):
    """A user layer activating its input with a PReLU before aggregating it."""

    def __init__(self, in_feats, out_feats):
        super().__init__()
        self.act = nn.PReLU(in_feats, init=0.1)
        self.lin = nn.Linear(in_feats, out_feats)

    def forward(self, g, h):
        with g.local_scope():
            g.srcdata["h"] = self.act(h)
            g.update_all(fn.copy_u("h", "m"), fn.mean("m", "h"))
            return self.lin(g.dstdata["h"])


class DetachConv(nn.Module):
    """A user layer whose neighbour term is computed without gradient (a stop-gradient)."""

    def __init__(self, in_feats, out_feats):
        super().__init__()
        self.neigh = nn.Linear(in_feats, out_feats)
        self.self_lin = nn.Linear(in_feats, out_feats)

    def forward(self, g, h):
        with g.local_scope():
            g.srcdata["h"] = self.neigh(h).detach()
            g.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            return g.dstdata["h"] + self.self_lin(h)


class UserLayers(nn.Module):
    """Two user layers of built-in functions, a PReLU one and a stop-gradient one."""

    def __init__(self, in_feats, hidden, classes):
        super().__init__()
        self.conv1 = PReLUMeanConv(in_feats, hidden)
        self.conv2 = DetachConv(hidden, classes)

    def forward(self, g, features):
        return self.conv2(g, self.conv1(g, features))


# -- activations that differ only in their parameters ----------------------------------------------
def scaled_tanh(scale):
    def act(x):
        return torch.tanh(x) * scale
    return act


def twice(module):
    return module, module


class TwoConvs(nn.Module):
    """Two GraphConv layers of equal widths, each with its own activation."""

    def __init__(self, width, act_a, act_b, zero_ok=False):
        super().__init__()
        self.a = GraphConv(width, width, activation=act_a, allow_zero_in_degree=zero_ok)
        self.b = GraphConv(width, width, activation=act_b, allow_zero_in_degree=zero_ok)

    def forward(self, g, x):
        return self.b(g, self.a(g, x))


ACTIVATION_PAIRS = {
    "leaky_relu": lambda: (nn.LeakyReLU(0.01), nn.LeakyReLU(0.5)),
    "elu": lambda: (nn.ELU(alpha=0.3), nn.ELU(alpha=1.7)),
    "partial": lambda: (functools.partial(F.leaky_relu, negative_slope=0.1),
                        functools.partial(F.leaky_relu, negative_slope=0.6)),
    "closure": lambda: (scaled_tanh(0.5), scaled_tanh(2.0)),
    "prelu": lambda: (nn.PReLU(init=0.1), nn.PReLU(init=0.6)),
    "shared_prelu": lambda: twice(nn.PReLU(init=0.3)),
}


class SharedLayer(nn.Module):
    """One GraphConv applied twice (tied weights), and one dropout module used in two places."""

    def __init__(self, width, classes, zero_ok=False):
        super().__init__()
        self.conv = GraphConv(width, width, activation=F.relu, allow_zero_in_degree=zero_ok)
        self.out = GraphConv(width, classes, allow_zero_in_degree=zero_ok)
        self.dropout = nn.Dropout(0.4)

    def forward(self, g, x):
        h = self.conv(g, self.dropout(x))
        h = self.conv(g, self.dropout(h))
        return self.out(g, h)


class SharedDropoutGAT(nn.Module):
    """Two GAT layers built with the same feature-dropout module object."""

    def __init__(self, in_feats, hidden, classes, zero_ok=False):
        super().__init__()
        self.conv1 = GATConv(in_feats, hidden, 2, feat_drop=0.5, activation=F.elu,
                             allow_zero_in_degree=zero_ok)
        self.conv2 = GATConv(hidden * 2, classes, 1, allow_zero_in_degree=zero_ok)
        self.conv2.feat_drop = self.conv1.feat_drop

    def forward(self, g, x):
        return self.conv2(g, self.conv1(g, x).flatten(1)).mean(1)


# -- the cases ---------------------------------------------------------------------------------------
GRAPH_KINDS = ("directed", "undirected", "zero_in_degree")


@dataclass(frozen=True)
class Case:
    name: str
    build: object              # build(graph, in_feats, zero_ok) -> nn.Module
    in_feats: int = 12
    edge_weight: bool = False  # forward(g, x, edge_weight)
    holds_graph: bool = False  # forward(x): the model keeps the graph it was built with
    graphs: tuple = GRAPH_KINDS

    def run(self, model, g, x, w=None):
        if self.holds_graph:
            return model(x)
        if self.edge_weight:
            return model(g, x, w)
        return model(g, x)


def _cases():
    H, C = HIDDEN, CLASSES
    cases = [
        Case("gcn", lambda g, k, z: GCN(k, H, C, zero_ok=z)),
        Case("gcn3", lambda g, k, z: GCN(k, H, C, n_layers=3, dropout=0.2, zero_ok=z)),
        Case("gcn_right_norm", lambda g, k, z: GCN(k, H, C, norm="right", zero_ok=z)),
        Case("gcn_weighted", lambda g, k, z: GCN(k, H, C, zero_ok=z), edge_weight=True),
        Case("gcn_edge_norm", lambda g, k, z: GCNEdgeNorm(k, H, C, zero_ok=z), edge_weight=True),
        Case("gcn_graph_readout", lambda g, k, z: GCNGraphClassifier(k, H, C, zero_ok=z)),
        Case("gat", lambda g, k, z: GAT(k, H, C, zero_ok=z)),
        Case("gat_weighted", lambda g, k, z: GAT(k, H, C, heads=(3, 1), zero_ok=z),
             edge_weight=True),
        Case("gat_ppi", lambda g, k, z: GATPPI(k, H, C, zero_ok=z)),
        Case("graphsage", lambda g, k, z: GraphSAGE(k, H, C)),
        Case("graphsage_weighted", lambda g, k, z: GraphSAGE(k, H, C, feat_drop=0.3),
             edge_weight=True),
        Case("gin", lambda g, k, z: GIN(k, H, C)),
        Case("gin_mean_equal_widths", lambda g, k, z: GIN(k, H, C, aggregator="mean",
                                                           learn_eps=False), in_feats=H),
        Case("gin_weighted", lambda g, k, z: GIN(k, H, C, n_layers=2), edge_weight=True),
        Case("sgc", lambda g, k, z: SGC(k, C, zero_ok=z)),
        Case("sgc_cached", lambda g, k, z: SGC(k, C, cached=True, zero_ok=z)),
        Case("tagcn", lambda g, k, z: TAGCN(g, k, H, C), holds_graph=True),
        Case("appnp", lambda g, k, z: APPNP(g, k, H, C), holds_graph=True),
        Case("gcnii", lambda g, k, z: GCNII(k, H, C)),
        Case("mixhop", lambda g, k, z: MixHop(k, H, C)),
        Case("jknet_cat", lambda g, k, z: JKNet(k, H, C, mode="cat", zero_ok=z)),
        Case("jknet_max", lambda g, k, z: JKNet(k, H, C, mode="max", zero_ok=z)),
        Case("dagnn", lambda g, k, z: DAGNN(k, H, C)),
        Case("message_passing_gcn", lambda g, k, z: MessagePassingGCN(k, H, C)),
        Case("user_layers", lambda g, k, z: UserLayers(k, H, C)),
        Case("shared_layer", lambda g, k, z: SharedLayer(k, C, zero_ok=z), in_feats=H),
        Case("shared_dropout_gat", lambda g, k, z: SharedDropoutGAT(k, H, C, zero_ok=z)),
    ]
    for name, make in ACTIVATION_PAIRS.items():
        cases.append(Case(f"activations_{name}",
                          lambda g, k, z, make=make: TwoConvs(k, *make(), zero_ok=z), in_feats=H))
    return cases


CASES = _cases()
CASES_BY_NAME = {c.name: c for c in CASES}

# Layers of the kinds granii optimizes: at least 90% of them must run an optimized plan.
OPTIMIZED_KINDS = (GraphConv, GATConv, SAGEConv, GINConv, SGConv, TAGConv, GCNLayer, GCNIIConv,
                   MixHopConv, PReLUMeanConv, DetachConv)


def of_optimized_kind(layer):
    if isinstance(layer, SAGEConv):
        return layer._aggre_type == "mean"
    return isinstance(layer, OPTIMIZED_KINDS)
