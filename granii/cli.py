"""``granii-explain``: what granii chooses for one DGL layer on a shipped graph, and why.

    granii-explain --layer gcn --graph cora --sizes 32 16 [--training]

builds the layer with DGL, optimizes it with ``granii`` on the graph (from ``data/``) with random
features of the given width, runs it once and prints ``granii.explain``: the IR, the association
trees enumerated and promoted, the predicted cost of each candidate, the chosen plan and its code.
"""
import argparse

import torch

LAYERS = {
    "gcn": lambda a, b: __import__("dgl.nn", fromlist=["GraphConv"]).GraphConv(
        a, b, allow_zero_in_degree=True),
    "gin": lambda a, b: __import__("dgl.nn", fromlist=["GINConv"]).GINConv(
        torch.nn.Linear(a, b), "sum"),
    "sage": lambda a, b: __import__("dgl.nn", fromlist=["SAGEConv"]).SAGEConv(a, b, "mean"),
    "sgc": lambda a, b: __import__("dgl.nn", fromlist=["SGConv"]).SGConv(
        a, b, k=2, allow_zero_in_degree=True),
    "tagcn": lambda a, b: __import__("dgl.nn", fromlist=["TAGConv"]).TAGConv(a, b, k=2),
    "gat": lambda a, b: __import__("dgl.nn", fromlist=["GATConv"]).GATConv(
        a, b, 1, allow_zero_in_degree=True),
}


def _positive(text):
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def explain_main(argv=None):
    from granii import granii
    from granii.datasets import GRAPHS, load_graph
    ap = argparse.ArgumentParser(prog="granii-explain", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", choices=sorted(LAYERS), default="gcn")
    ap.add_argument("--graph", default="cora", choices=GRAPHS,
                    help="a graph of data/ (default: cora)")
    ap.add_argument("--sizes", type=_positive, nargs=2, default=(32, 16),
                    metavar=("K_IN", "K_OUT"))
    ap.add_argument("--training", action="store_true", help="decide for a training step")
    args = ap.parse_args(argv)
    g = load_graph(args.graph)
    k_in, k_out = args.sizes
    layer = LAYERS[args.layer](k_in, k_out)
    x = torch.randn(g.num_nodes(), k_in)
    granii(layer, g, x, inspect_now=False)
    if args.training:
        layer(g, x.requires_grad_()).sum().backward()
    else:
        with torch.no_grad():
            layer(g, x)
    granii.explain(layer)


if __name__ == "__main__":
    explain_main()
