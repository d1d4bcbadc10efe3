"""Layers written with Python message and reduce functions (UDFs): DGL running them, granii on them,
and DGL's built-in layer computing the same thing.

    python -m bench.udf [--graphs cora pubmed] [--layers gcn sage gat] [--k 64] [--calls 30]
                        [--out results/udf]

Three layers as a user writes them from DGL's tutorials: GCN (normalisation inside the message and
reduce functions), GraphSAGE-mean (methods) and one-head GAT (``apply_edges`` scores, DGL's
``edge_softmax``, ``update_all``). Each runs four ways on the same weights: ``udf`` (DGL executes the
Python functions: per-degree bucketing of the mailbox), ``granii`` (``granii(model, g, x)`` on the
UDF layer), ``builtin`` (DGL's ``GraphConv`` / ``SAGEConv`` / ``GATConv`` with the same parameters)
and ``granii_builtin`` (``granii`` on that built-in layer: where the UDF lowers to the built-in's IR,
the two differ only by what the first calls run).
Inference: ``calls`` calls on new features (made before the timer), the first call included (for
granii, with the ``granii(...)`` call); training: forward and backward of a sum, same rules. The
four take turns call by call; totals are compared. 2 torch threads. Before any timing, each layer
runs each way once on a small graph: the one-time costs of the process (loading the cost models,
the first call of each library and kernel) are not charged to the first row.
"""
import argparse
import copy
import os
import time
from pathlib import Path

import dgl
import dgl.function as fn
import torch
import torch.nn.functional as F
from dgl.nn import GATConv, GraphConv, SAGEConv
from dgl.nn.functional import edge_softmax
from torch import nn

from granii import granii
from granii.datasets import load_graph
from granii.runtime.dispatch import layer_states

from .csvfile import write_csv
from .graphs import with_self_loops


def _scaled_message(edges):
    return {"m": edges.src["h"] * edges.src["s"]}


def _scaled_sum(nodes):
    return {"h": nodes.mailbox["m"].sum(1) * nodes.data["s"]}


class GCNByUDF(nn.Module):
    """``D^-1/2 A D^-1/2 (H W) + b`` with the degree scaling in the message and reduce."""

    def __init__(self, k_in, k_out):
        super().__init__()
        self.lin = nn.Linear(k_in, k_out)

    def forward(self, g, x):
        with g.local_scope():
            g.ndata["s"] = g.in_degrees().float().clamp(min=1).pow(-0.5).unsqueeze(-1)
            g.ndata["h"] = x @ self.lin.weight.t()
            g.update_all(_scaled_message, _scaled_sum)
            return g.ndata["h"] + self.lin.bias


class SAGEByUDF(nn.Module):
    """``H W_self + b + mean_{u -> v}(H_u) W_neigh`` with message and reduce methods."""

    def __init__(self, k_in, k_out):
        super().__init__()
        self.fc_self = nn.Linear(k_in, k_out)
        self.fc_neigh = nn.Linear(k_in, k_out, bias=False)

    def send(self, edges):
        return {"x": edges.src["x"]}

    def average(self, nodes):
        return {"n": torch.mean(nodes.mailbox["x"], dim=1)}

    def forward(self, g, x):
        with g.local_scope():
            g.ndata["x"] = x
            g.update_all(self.send, self.average)
            return self.fc_self(x) + self.fc_neigh(g.ndata["n"])


class GATByUDF(nn.Module):
    """One-head GAT: ``softmax_u(leaky_relu(a_l . z_u + a_r . z_v)) z_u`` summed per destination."""

    def __init__(self, k_in, k_out):
        super().__init__()
        self.fc = nn.Linear(k_in, k_out, bias=False)
        self.attn_l = nn.Parameter(torch.randn(1, 1, k_out) * 0.3)
        self.attn_r = nn.Parameter(torch.randn(1, 1, k_out) * 0.3)
        self.bias = nn.Parameter(torch.zeros(k_out))

    def forward(self, g, x):
        with g.local_scope():
            z = self.fc(x)
            g.ndata["z"] = z
            g.ndata["el"] = (z * self.attn_l[0]).sum(-1, keepdim=True)
            g.ndata["er"] = (z * self.attn_r[0]).sum(-1, keepdim=True)
            g.apply_edges(lambda e: {"e": F.leaky_relu(e.src["el"] + e.dst["er"], 0.2)})
            g.edata["a"] = edge_softmax(g, g.edata["e"])
            g.update_all(lambda e: {"m": e.src["z"] * e.data["a"]},
                         lambda n: {"h": n.mailbox["m"].sum(1)})
            return g.ndata["h"] + self.bias


def builtin_twin(name, udf):
    """DGL's built-in layer holding ``udf``'s parameters."""
    k_in, k_out = (udf.lin if name == "gcn" else udf.fc_self if name == "sage" else udf.fc) \
        .weight.shape[::-1]
    if name == "gcn":
        b = GraphConv(k_in, k_out, norm="both", allow_zero_in_degree=True)
        b.weight.data.copy_(udf.lin.weight.t())
        b.bias.data.copy_(udf.lin.bias)
        return b
    if name == "sage":
        b = SAGEConv(k_in, k_out, "mean")
        b.fc_self.load_state_dict(udf.fc_self.state_dict())
        b.fc_neigh.load_state_dict(udf.fc_neigh.state_dict())
        return b
    b = GATConv(k_in, k_out, 1, negative_slope=0.2, allow_zero_in_degree=True)
    b.fc.weight.data.copy_(udf.fc.weight)
    b.attn_l.data.copy_(udf.attn_l)
    b.attn_r.data.copy_(udf.attn_r)
    b.bias.data.copy_(udf.bias)
    return b


LAYERS = {"gcn": GCNByUDF, "sage": SAGEByUDF, "gat": GATByUDF}


def _out(y):
    return y.reshape(y.shape[0], -1)


def warm_up(k):
    """Each layer once each way on a small graph: the process's one-time costs."""
    g = dgl.add_self_loop(dgl.rand_graph(200, 1000))
    for name in LAYERS:
        udf = LAYERS[name](k, k)
        for m in (udf, builtin_twin(name, udf)):
            twin = copy.deepcopy(m)
            with torch.no_grad():
                granii(twin, g, torch.randn(200, k))
            for layer in (m, twin):
                _out(layer(g, torch.randn(200, k, requires_grad=True))).sum().backward()


def run(name, gname, g, k, calls, mode):
    torch.manual_seed(0)
    udf = LAYERS[name](k, k)
    builtin = builtin_twin(name, udf)
    ours = copy.deepcopy(udf)
    ours_builtin = copy.deepcopy(builtin)
    n = g.num_nodes()
    xs = [torch.randn(n, k, requires_grad=(mode == "train")) for _ in range(calls)]
    with torch.no_grad():
        ref, twin = udf(g, xs[0]), _out(builtin(g, xs[0]))
    assert torch.allclose(ref, twin, atol=1e-4, rtol=1e-4), f"{name}: built-in twin differs"

    def call(m, x):
        if mode == "train":
            _out(m(g, x)).sum().backward()
        else:
            with torch.no_grad():
                m(g, x)

    runs = (("udf", udf), ("granii", ours), ("builtin", builtin), ("granii_builtin", ours_builtin))
    total = dict.fromkeys(dict(runs), 0.0)
    for label, m in (("granii", ours), ("granii_builtin", ours_builtin)):
        t = time.perf_counter()
        with torch.no_grad():
            granii(m, g, torch.randn(n, k))
        total[label] += time.perf_counter() - t
    for x in xs:
        for label, m in runs:
            t = time.perf_counter()
            call(m, x)
            total[label] += time.perf_counter() - t
    with torch.no_grad():
        x = torch.randn(n, k)
        err = (ours(g, x) - udf(g, x)).abs().max().item()
    st = layer_states(ours)
    optimized = all(s.fallback is None for s in st) and bool(st)
    ms = {label: 1e3 * v / calls for label, v in total.items()}
    return dict(layer=name, graph=gname, k=k, mode=mode, calls=calls,
                udf_ms=ms["udf"], granii_ms=ms["granii"], builtin_ms=ms["builtin"],
                granii_builtin_ms=ms["granii_builtin"],
                granii_vs_udf=total["udf"] / total["granii"],
                granii_vs_builtin=total["builtin"] / total["granii"],
                optimized=optimized, kept=kept(st), kept_builtin=kept(layer_states(ours_builtin)),
                max_error=err)


def kept(states):
    """The plan the layer runs after its first calls (``[0n]``, "original forward", ...)."""
    st = states[0] if states else None
    if st is None or st.fallback is not None:
        return "original forward"
    if st.tuned is not None:
        return st.tuned[1]
    return f"[{st.last[2].plan.index}]" if st.last else "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", nargs="+", default=["cora", "pubmed"])
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("results/udf"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    warm_up(args.k)
    rows = []
    for gname in args.graphs:
        g = with_self_loops(load_graph(gname))
        for name in args.layers:
            for mode in ("infer", "train"):
                r = run(name, gname, g, args.k, args.calls, mode)
                rows.append(r)
                print(f"{gname} {name} {mode}: udf {r['udf_ms']:.2f} ms, granii "
                      f"{r['granii_ms']:.2f} ms, built-in {r['builtin_ms']:.2f} ms, granii on "
                      f"the built-in {r['granii_builtin_ms']:.2f} ms", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "udf.csv", rows)
    lines = ["# Layers written with Python message and reduce functions", "",
             f"`python -m bench.udf --k {args.k} --calls {args.calls}`; 2 torch threads; "
             f"{(time.perf_counter() - t0) / 60:.1f} min; 1-minute load average {load0:.2f} at the "
             f"start, {os.getloadavg()[0]:.2f} at the end. Per call, {args.calls} calls on new "
             "features with the first included (granii's includes `granii(...)`).", "",
             "| graph | layer | mode | DGL runs the UDFs ms | granii ms | DGL built-in layer ms | "
             "granii on the built-in ms | granii vs UDF | granii vs built-in | optimized | "
             "kept (built-in) | max error |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['layer']} | {r['mode']} | {r['udf_ms']:.2f} | "
                     f"{r['granii_ms']:.2f} | {r['builtin_ms']:.2f} | "
                     f"{r['granii_builtin_ms']:.2f} | "
                     f"**{r['granii_vs_udf']:.2f}x** | {r['granii_vs_builtin']:.2f}x | "
                     f"{'yes' if r['optimized'] else 'no'} | {r['kept']} ({r['kept_builtin']}) | "
                     f"{r['max_error']:.1e} |")
    (args.out / "udf.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
