"""HGT and RGAT-style layers on heterogeneous graphs: DGL's layer against the granii copy of it.

    python -m bench.hetero_layers [--datasets aifb,mutag] [--out results/hetero]

Graphs generated with the published statistics of the RGCN benchmarks (``granii.hetero_graphs``,
each relation with its inverse; not the real datasets), node features random (the real nodes
are featureless: RGCN-style models learn them).

* ``HGTConv`` (DGL's, ``dgl.nn.HGTConv``) on the homogeneous form of the graph
  (``dgl.to_homogeneous``: node and edge types as tensors), k_in = heads x head size:
  2 heads x 8 and 4 heads x 16, no dropout.
* ``HeteroGraphConv({relation: GATConv(k, k / 4, 4 heads)}, aggregate="sum")`` on the
  heterograph itself, node features per node type (RGAT as DGL users write it), k = 32.
* ``HeteroGraphConv({relation: SAGEConv(k, k, "mean")}, aggregate="sum")``, k = 32.
* ``HeteroGraphConv({relation: GraphConv(k, k, norm="right", weight=False, bias=False)})`` with
  one weight per relation passed at each call (``mod_kwargs``), as DGL's ``rgcn-hetero`` example
  writes its RGCN layer; k = 16 and 64, also on the BGS-sized graph (``--rgcn-datasets``).

``kernel calls``: sparse, dense and typed products (``aten::mm``/``addmm``/``bmm``, DGL's
``GSpMM``/``GSDDMM``/segment and gather products, granii's native operators) in one forward of
the row's mode after the tie-breaks settled, counted by ``torch.profiler``: what grows with the
number of relations.

Modes: ``infer`` (no gradients, a new feature tensor at every call) and ``train`` (forward and
backward of ``(out * R).sum()``; gradients to the features and the weights). DGL's layer and
the granii copy (``copy.deepcopy`` + ``granii(...)``, same weights) run side by side
(``granii.profiling.timing.side_by_side``: warm-up calls, then up to 9 rounds of the two in turn, within
a time budget; medians), after ``SETTLE`` untimed calls of the granii copy in which its
measured tie-breaks settle (steady state). ``first call``: ``granii(...)`` and its first call on a fresh copy of
the graph, beside DGL's first call on another fresh copy. Before timing, both outputs of one call
are compared (``max rel err``). Writes ``layers.csv`` and ``layers.md``.
"""
import argparse
import copy
import os
import sys
import time
from pathlib import Path

import dgl
import torch
from dgl.nn import GATConv, GraphConv, HeteroGraphConv, HGTConv, SAGEConv

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.csvfile import write_csv  # noqa: E402
from granii import granii, hetero_conv, hetero_graphs  # noqa: E402
from granii.runtime.tiebreak import TRIAL_ROUNDS# noqa: E402
from granii.profiling.timing import side_by_side  # noqa: E402

# calls after which every tie-break has settled: each relation's own, then the container's
SETTLE = hetero_conv.ROUTED_WARMUP + 2 * (TRIAL_ROUNDS + 1) + 2


def _rel_err(a, b):
    if isinstance(a, dict):
        return max((_rel_err(a[k], b[k]) for k in a), default=0.0)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


class RGAT(torch.nn.Module):
    def __init__(self, relations, k, heads=4):
        super().__init__()
        self.conv = HeteroGraphConv({r: GATConv(k, k // heads, heads, allow_zero_in_degree=True)
                                     for r in relations}, aggregate="sum")

    def forward(self, g, x):
        return self.conv(g, x)


class RGCNHetero(torch.nn.Module):
    """The relational layer of DGL's rgcn-hetero example, without its self-loop and
    activation: a GraphConv per relation, the relation's weight passed at each call."""

    def __init__(self, relations, k_in, k_out):
        super().__init__()
        self.rels = list(relations)
        self.conv = HeteroGraphConv({r: GraphConv(k_in, k_out, norm="right", weight=False,
                                                  bias=False) for r in self.rels})
        self.weight = torch.nn.Parameter(torch.empty(len(self.rels), k_in, k_out))
        torch.nn.init.xavier_uniform_(self.weight)

    def forward(self, g, x):
        w = {r: {"weight": wr.squeeze(0)} for r, wr in zip(self.rels, torch.split(self.weight, 1))}
        return self.conv(g, x, mod_kwargs=w)


KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "GSpMM", "GSDDMM", "SegmentMM", "GatherMM",
           "GatherMMScatter", "granii::")


def kernel_calls(model, g, x, extra, train):
    """Sparse, dense and typed product calls in one forward of the row's mode (see the module
    doc), after the tie-breaks have settled."""
    from torch.profiler import profile
    with torch.set_grad_enabled(train), profile() as prof:
        model(g, _fresh(x, train), *extra)
    return sum(1 for ev in prof.events() if ev.name.startswith(KERNELS))


LAYERS = ("HGTConv", "HeteroGraphConv(GATConv)", "HeteroGraphConv(SAGEConv)",
          "HeteroGraphConv(GraphConv)")


def cases(name, layers=LAYERS):
    """``(layer label, size, model, graph, features, extra args)`` for one generated graph."""
    hg = hetero_graphs.generate(name)
    if "HGTConv" in layers:
        g = dgl.to_homogeneous(hg)
        nt, et = g.ndata[dgl.NTYPE].long(), g.edata[dgl.ETYPE].long()
        g = dgl.graph(g.edges(order="eid"), num_nodes=g.num_nodes())
        for heads, size in ((2, 8), (4, 16)):
            torch.manual_seed(0)
            layer = HGTConv(heads * size, size, heads, len(hg.ntypes), len(hg.canonical_etypes),
                            dropout=0.0)
            x = torch.randn(g.num_nodes(), heads * size)
            yield "HGTConv", f"{heads} heads x {size}", layer, g, x, (nt, et)
    if "HeteroGraphConv(GATConv)" in layers:
        k = 32
        torch.manual_seed(0)
        model = RGAT(hg.etypes, k)
        x = {t: torch.randn(hg.num_nodes(t), k) for t in hg.ntypes}
        yield "HeteroGraphConv(GATConv)", f"k={k}, 4 heads", model, hg, x, ()
    if "HeteroGraphConv(SAGEConv)" in layers:
        k = 32
        torch.manual_seed(0)
        model = HeteroGraphConv({r: SAGEConv(k, k, "mean") for r in hg.etypes}, aggregate="sum")
        x = {t: torch.randn(hg.num_nodes(t), k) for t in hg.ntypes}
        yield "HeteroGraphConv(SAGEConv)", f"k={k}, mean", model, hg, x, ()
    if "HeteroGraphConv(GraphConv)" in layers:
        for k in (16, 64):
            torch.manual_seed(0)
            x = {t: torch.randn(hg.num_nodes(t), k) for t in hg.ntypes}
            yield "HeteroGraphConv(GraphConv)", f"k={k}", RGCNHetero(hg.etypes, k, k), hg, x, ()


def _fresh(x, grad):
    if isinstance(x, dict):
        return {t: v.clone().requires_grad_(grad) for t, v in x.items()}
    return x.clone().requires_grad_(grad)


def _total(out, seed):
    if isinstance(out, dict):
        return sum(_total(out[k], seed + i) for i, k in enumerate(sorted(out)))
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return (out * r).sum()


def step(model, g, x, extra, train):
    """One call as the mode makes it: a new feature tensor; in training, a backward."""
    def f():
        if train:
            xi = _fresh(x, True)
            _total(model(g, xi, *extra), 0).backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                model(g, _fresh(x, False), *extra)
    return f


def measure(name, log, budget, layers=None):
    rows = []
    for label, size, model, g, x, extra in cases(name, layers or LAYERS):
        for mode in ("infer", "train"):
            train = mode == "train"
            ref = copy.deepcopy(model).train(train)
            opt = copy.deepcopy(model).train(train)
            # first calls on fresh graphs
            g1, g2 = copy.deepcopy(g), copy.deepcopy(g)
            t0 = time.perf_counter()
            step(copy.deepcopy(ref), g1, x, extra, train)()
            first_dgl = time.perf_counter() - t0
            first = copy.deepcopy(opt)
            t0 = time.perf_counter()
            granii(first, g2, _fresh(x, False), extra_args=extra)
            step(first, g2, x, extra, train)()
            first_granii = time.perf_counter() - t0
            granii(opt, g, _fresh(x, False), extra_args=extra)
            with torch.no_grad():
                err = _rel_err(opt(g, _fresh(x, False), *extra), ref(g, _fresh(x, False), *extra))
            for _ in range(SETTLE):         # the measured tie-breaks settle before timing
                step(opt, g, x, extra, train)()
            calls = (kernel_calls(ref, g, x, extra, train), kernel_calls(opt, g, x, extra, train))
            t = side_by_side({"dgl": step(ref, g, x, extra, train),
                              "granii": step(opt, g, x, extra, train)},
                             warmup=3, repeat=9, budget=budget)
            row = dict(graph=name, nodes=g.num_nodes(), edges=g.num_edges(), layer=label,
                       size=size, mode=mode, dgl_ms=t["dgl"][0] * 1e3,
                       granii_ms=t["granii"][0] * 1e3,
                       speedup=t["dgl"][0] / t["granii"][0], rounds=len(t["dgl"][1]),
                       first_dgl_ms=first_dgl * 1e3, first_granii_ms=first_granii * 1e3,
                       max_rel_err=err,
                       relations=(int(extra[1].max()) + 1 if extra else len(g.canonical_etypes)),
                       dgl_kernel_calls=calls[0], granii_kernel_calls=calls[1],
                       plans=_plans(opt))
            log(f"  {name} {label} {size} {mode}: DGL {row['dgl_ms']:.1f} ms, granii "
                f"{row['granii_ms']:.1f} ms ({row['speedup']:.2f}x), err {err:.1e}")
            rows.append(row)
    return rows


def _plans(model):
    text = granii.explain(model, file=open(os.devnull, "w"))
    chosen = [ln.strip() for ln in text.splitlines() if "<- chosen" in ln or "kept" in ln]
    return " | ".join(chosen)[:300]


def write(rows, out, runs):
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "layers.csv", rows)
    lines = ["# Heterogeneous layers (HGT, RGAT-style, RGCN-style): DGL vs granii", "",
             "Graphs **generated with the published statistics** of the RGCN benchmarks "
             "(`granii/hetero_graphs.py`), not the real datasets; random node features. "
             "`python -m bench.hetero_layers`; 2 torch threads; medians of interleaved rounds "
             "(ms); `infer`: new features each call, no gradients; `train`: forward + backward. "
             "First call: `granii(...)` + its first call vs DGL's first call, each on a fresh "
             "copy of the graph.", "", f"Run: {runs}", "",
             "| graph | layer | size | mode | DGL | granii | speedup | first call granii / DGL "
             "| kernel calls DGL / granii | max rel err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['graph']} (N={r['nodes']}, E={r['edges']}, R={r['relations']}) | "
                     f"{r['layer']} | {r['size']} | {r['mode']} | {r['dgl_ms']:.2f} | "
                     f"{r['granii_ms']:.2f} | **{r['speedup']:.2f}x** | "
                     f"{r['first_granii_ms']:.0f} / {r['first_dgl_ms']:.0f} | "
                     f"{r['dgl_kernel_calls']} / {r['granii_kernel_calls']} | "
                     f"{r['max_rel_err']:.1e} |")
    for layer in sorted({r["layer"] for r in rows}):
        s = [r["speedup"] for r in rows if r["layer"] == layer]
        geo = torch.tensor(s).log().mean().exp().item()
        lines.append("")
        lines.append(f"{layer}: geomean {geo:.2f}x over {len(s)} cases (worst {min(s):.2f}x).")
    (out / "layers.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="aifb,mutag")
    ap.add_argument("--rgcn-datasets", default="bgs",
                    help="further graphs for the SAGE and RGCN-style layers only (HGT and GAT "
                         "there take minutes)")
    ap.add_argument("--budget", type=float, default=6.0, help="seconds per configuration")
    ap.add_argument("--out", default=str(ROOT / "results" / "hetero"))
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    start, load0 = time.time(), os.getloadavg()[0]
    rows = []
    for name in a.datasets.split(","):
        rows += measure(name, lambda s: print(s, flush=True), a.budget)
    for name in filter(None, a.rgcn_datasets.split(",")):
        rows += measure(name, lambda s: print(s, flush=True), a.budget,
                        ("HeteroGraphConv(SAGEConv)", "HeteroGraphConv(GraphConv)"))
    runs = (f"{a.datasets} (+ {a.rgcn_datasets or 'none'} for the SAGE and GraphConv containers): "
            f"{(time.time() - start) / 60:.1f} min, 1-minute load average "
            f"{load0:.2f} -> {os.getloadavg()[0]:.2f}")
    write(rows, Path(a.out), runs)


if __name__ == "__main__":
    main()
