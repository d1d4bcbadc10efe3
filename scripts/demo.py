"""Demo: granii on a 2-layer GCN over the real Cora graph (shipped in data/), beside DGL's layers.

Prints the composition chosen for each layer, the time per forward pass and per training step of
DGL's model and of the same model after ``granii(...)`` (measured side by side, 2 threads, warm-up,
median), and the test accuracy of both after the same training (same seed, same weights).
"""
import argparse
import copy

import dgl
import torch
from dgl.nn import GraphConv

from granii import granii
from granii.api import layer_states
from granii.datasets import load_planetoid
from granii.profiling.timing import fix_threads, side_by_side


class GCN(torch.nn.Module):
    def __init__(self, k_in, hidden, classes):
        super().__init__()
        self.conv1 = GraphConv(k_in, hidden, activation=torch.relu)
        self.conv2 = GraphConv(hidden, classes)

    def forward(self, g, x):
        return self.conv2(g, self.conv1(g, x))


def train_step(model, opt, g, x, y, mask):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(g, x)[mask], y[mask])
    loss.backward()
    opt.step()
    return loss


def show_choices(model, mode):
    """The plan each layer runs now (the last decision it made), as explain() reports it."""
    for st in layer_states(model):
        symbols, ranking, best = st.last[:3]
        impls = ", ".join(i for i in best.impls if i != "inline")
        print(f"  {mode:<9} {st.name}: {symbols['k_in']} -> {symbols['k_out']}: "
              f"{best.plan.composition()}  (kernels: {impls}; {len(ranking)} candidates)")


def accuracy(model, g, x, y, mask):
    with torch.no_grad():
        return (model(g, x)[mask].argmax(1) == y[mask]).float().mean().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", default="cora", choices=["cora", "citeseer"])
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--explain", action="store_true", help="print granii's full explanation")
    args = ap.parse_args(argv)
    threads = fix_threads(2)

    g, x, y, train, val, test = load_planetoid(args.dataset)
    g = dgl.add_self_loop(dgl.remove_self_loop(g))
    print(f"{args.dataset}: {g.num_nodes()} nodes, {g.num_edges()} edges (with self-loops), "
          f"{x.shape[1]} features, {int(y.max()) + 1} classes; {threads} threads")

    torch.manual_seed(0)
    dgl_model = GCN(x.shape[1], args.hidden, int(y.max()) + 1)
    model = copy.deepcopy(dgl_model)
    granii(model, g, x)

    with torch.no_grad():
        torch.testing.assert_close(model(g, x), dgl_model(g, x), atol=1e-5, rtol=1e-4)
    print("outputs equal DGL's (float tolerance)")

    with torch.no_grad():
        inf = side_by_side({"dgl": lambda: dgl_model(g, x), "granii": lambda: model(g, x)},
                           warmup=5, repeat=51)
    show_choices(model, "inference")
    opt_d = torch.optim.Adam(dgl_model.parameters(), lr=0.01, weight_decay=5e-4)
    opt_g = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    tr = side_by_side({"dgl": lambda: train_step(dgl_model, opt_d, g, x, y, train),
                       "granii": lambda: train_step(model, opt_g, g, x, y, train)},
                      warmup=3, repeat=args.epochs)
    show_choices(model, "training")
    if args.explain:
        granii.explain(model)
    print(f"{'':<22}{'DGL':>10}{'granii':>10}{'speedup':>10}")
    for label, res in (("forward (inference)", inf), ("training step", tr)):
        d, m = res["dgl"][0], res["granii"][0]
        print(f"{label:<22}{d * 1e3:>8.2f}ms{m * 1e3:>8.2f}ms{d / m:>9.2f}x")
    print(f"test accuracy after {args.epochs + 3} epochs: DGL {accuracy(dgl_model, g, x, y, test):.3f}, "
          f"granii {accuracy(model, g, x, y, test):.3f}")


if __name__ == "__main__":
    main()
