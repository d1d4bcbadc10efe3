"""The single layers the benchmark times: one DGL layer per model name, and PyG's equivalent.

Each model name maps to a ``Model`` with a factory for the DGL layer, one for the PyG layer (when
torch_geometric imports) and whether its graphs get a self-loop on every node (GCN, SGC and GAT:
DGL refuses nodes of zero in-degree for them). Layers are built after ``torch.manual_seed(seed)`` so
the same seed gives the same weights. PyG layers compute the same function on the same graph
(``add_self_loops=False``: the graph already carries its loops) with their own weights: only
their time is compared.
"""
from dataclasses import dataclass

import torch
from dgl import nn as dglnn

try:
    import torch_geometric
    from torch_geometric import nn as pygnn
except Exception as e:             # noqa: BLE001 - any import failure means "no PyG column"
    torch_geometric, pygnn = None, None
    PYG_ERROR = f"{type(e).__name__}: {e}"
else:
    PYG_ERROR = None


@dataclass
class Model:
    name: str
    label: str
    self_loops: bool
    dgl: object                   # (k_in, k_out) -> DGL layer
    pyg: object = None            # (k_in, k_out) -> PyG layer, or None


def _gat_dgl(heads):
    def make(k_in, k_out):
        return dglnn.GATConv(k_in, max(1, k_out // heads), num_heads=heads)
    return make


def _gat_pyg(heads):
    def make(k_in, k_out):
        return pygnn.GATConv(k_in, max(1, k_out // heads), heads=heads, add_self_loops=False)
    return make


MODELS = {
    "gcn": Model("gcn", "GCN (GraphConv, norm=both)", True,
                 lambda i, o: dglnn.GraphConv(i, o, norm="both"),
                 lambda i, o: pygnn.GCNConv(i, o, add_self_loops=False)),
    "gin": Model("gin", "GIN (GINConv, Linear, sum)", False,
                 lambda i, o: dglnn.GINConv(torch.nn.Linear(i, o), "sum"),
                 lambda i, o: pygnn.GINConv(torch.nn.Linear(i, o))),
    "sgc": Model("sgc", "SGC (SGConv, k=2)", True,
                 lambda i, o: dglnn.SGConv(i, o, k=2),
                 lambda i, o: pygnn.SGConv(i, o, K=2, add_self_loops=False)),
    "tagcn": Model("tagcn", "TAGCN (TAGConv, k=2)", False,
                   lambda i, o: dglnn.TAGConv(i, o, k=2),
                   lambda i, o: pygnn.TAGConv(i, o, K=2)),
    "gat": Model("gat", "GAT (GATConv, 1 head)", True, _gat_dgl(1), _gat_pyg(1)),
    "gat4": Model("gat4", "GAT (GATConv, 4 heads of k_out/4)", True, _gat_dgl(4), _gat_pyg(4)),
    "sage": Model("sage", "SAGE (SAGEConv, mean)", False,
                  lambda i, o: dglnn.SAGEConv(i, o, "mean"),
                  lambda i, o: pygnn.SAGEConv(i, o, aggr="mean")),
}

DEFAULT_MODELS = ["gcn", "gin", "sgc", "tagcn", "gat", "sage"]      # gat4 on request


def build(model, k_in, k_out, seed=0):
    """The DGL layer of ``model`` with the weights of ``seed``."""
    torch.manual_seed(seed)
    return MODELS[model].dgl(k_in, k_out)


def build_pyg(model, k_in, k_out, seed=0):
    """PyG's layer for ``model``, or None when PyG is missing."""
    spec = MODELS[model]
    if pygnn is None or spec.pyg is None:
        return None
    torch.manual_seed(seed)
    return spec.pyg(k_in, k_out)


def pyg_version():
    return getattr(torch_geometric, "__version__", None)


__all__ = ["MODELS", "DEFAULT_MODELS", "build", "build_pyg", "PYG_ERROR", "pyg_version"]
