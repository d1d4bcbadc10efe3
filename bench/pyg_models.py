"""2-layer PyG models as PyG's examples write them: granii against the variants PyG users run.

    python -m bench.pyg_models [--graph github-social] [--calls 20] [--models gcn,sage,...]
                               [--variants eager,adj_t,compile,granii] [--out results/pyg]

Models (hidden 64, the examples' structure): ``gcn`` (GCNConv, ReLU, dropout, GCNConv),
``sage`` (SAGEConv mean x2), ``gin`` (GINConv with a 2-layer MLP x2), ``sgc`` (one SGConv,
K = 2), ``appnp`` (Linear, ReLU, Linear, APPNP K = 10), ``tagcn`` (TAGConv K = 3 x2), ``gat``
(GATConv with 8 heads, ELU, GATConv with one head) and ``tutorial`` (the "creating message
passing networks" GCN layer written as a user ``MessagePassing`` subclass, x2).

Variants, each in a fresh process (so the first call is a user's first call, and peak memory
is the process's own):

    eager    the model on ``edge_index``
    adj_t    the model on a ``torch.sparse`` CSR adjacency (``adj_t``, rows are targets) where
             every layer of it accepts one (not ``tutorial``, whose forward unpacks
             ``edge_index``; the graph has no parallel edges, so GAT's attention is the same);
             building it from ``edge_index`` counts in the first call, as granii's index does
    compile  ``torch.compile(model)`` on ``edge_index``; its compilation counts in the first call
    granii   ``granii(model, x, edge_index)`` (its time counts in the first call), then the model
    granii_compile
             ``granii(...)``, then ``torch.compile`` of the model: the compiler leaves the
             optimized layers' calls out of its graphs and compiles what lies between them
             (not in the default set: a configuration some users run, reported apart)
    granii_torch_dropout
             the same as ``granii`` with ``GRANII_FAST_DROPOUT=0``: the model's dropout draws
             with torch's own kernel (an ablation, training only: granii's faster draw of the
             same masks is not plan choice; inference has no dropout)

Modes: ``inference`` (``eval()``, ``no_grad``, new random features each call) and
``training`` (``train()``, forward, cross entropy on random labels, backward, Adam step).
Reported per (model, mode, variant): the first call (ms), the median of the later calls (ms),
the total of ``--calls`` calls, first included (s), peak resident memory growth over the process
after loading the graph (MiB), what granii ran, and the largest difference of the outputs from
eager PyG's over the same inputs (inference) or of the first step's loss (training).

    speedup = eager's total / variant's total

Writes ``pyg_models.csv`` and ``pyg_models.md`` under ``--out``.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch_geometric.nn import MessagePassing
from torch_geometric.utils import add_self_loops, degree

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("gcn", "sage", "gin", "sgc", "appnp", "tagcn", "gat", "tutorial")
VARIANTS = ("eager", "adj_t", "compile", "granii", "granii_torch_dropout")
MORE_VARIANTS = ("granii_compile",)                                  # asked for by name only
ABLATIONS = {"granii_torch_dropout": {"GRANII_FAST_DROPOUT": "0"}}   # environment of each
NO_ADJ_T = {"tutorial"}     # the tutorial reads edge_index (PyG's GATConv sets the diagonal of
                            # a sparse adjacency in place of remove/add_self_loops)
HIDDEN, CLASSES, FEATURES = 64, 8, 64


class TutorialGCNConv(MessagePassing):
    """PyG's tutorial GCN layer ("creating message passing networks"), at module level as a
    user's script defines it."""

    def __init__(self, in_channels, out_channels):
        super().__init__(aggr="add")
        self.lin = torch.nn.Linear(in_channels, out_channels, bias=False)
        self.bias = torch.nn.Parameter(torch.empty(out_channels))
        self.reset_parameters()

    def reset_parameters(self):
        self.lin.reset_parameters()
        self.bias.data.zero_()

    def forward(self, x, edge_index):
        edge_index, _ = add_self_loops(edge_index, num_nodes=x.size(0))
        x = self.lin(x)
        row, col = edge_index
        deg = degree(col, x.size(0), dtype=x.dtype)
        deg_inv_sqrt = deg.pow(-0.5)
        deg_inv_sqrt[deg_inv_sqrt == float("inf")] = 0
        norm = deg_inv_sqrt[row] * deg_inv_sqrt[col]
        out = self.propagate(edge_index, x=x, norm=norm)
        return out + self.bias

    def message(self, x_j, norm):
        return norm.view(-1, 1) * x_j


def build(name):
    """The model ``name`` (seeded weights), a ``torch.nn.Module`` called as ``model(x, g)``."""
    import torch.nn.functional as F
    from torch import nn
    from torch_geometric import nn as gnn
    torch.manual_seed(0)
    k, h, c = FEATURES, HIDDEN, CLASSES

    class Two(nn.Module):
        def __init__(self, first, second, act=F.relu, dropout=0.5):
            super().__init__()
            self.conv1, self.conv2, self.act, self.dropout = first, second, act, dropout

        def forward(self, x, g):
            x = F.dropout(x, p=self.dropout, training=self.training)
            x = self.act(self.conv1(x, g))
            x = F.dropout(x, p=self.dropout, training=self.training)
            return self.conv2(x, g)

    class SGC(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = gnn.SGConv(k, c, K=2, cached=False)

        def forward(self, x, g):
            return self.conv(x, g)

    class APPNPNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(k, h), nn.Linear(h, c)
            self.prop = gnn.APPNP(K=10, alpha=0.1)

        def forward(self, x, g):
            x = F.dropout(x, p=0.5, training=self.training)
            x = F.relu(self.lin1(x))
            x = F.dropout(x, p=0.5, training=self.training)
            return self.prop(self.lin2(x), g)

    def mlp(a, b):
        return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b))

    return {
        "gcn": lambda: Two(gnn.GCNConv(k, h), gnn.GCNConv(h, c)),
        "sage": lambda: Two(gnn.SAGEConv(k, h), gnn.SAGEConv(h, c)),
        "gin": lambda: Two(gnn.GINConv(mlp(k, h)), gnn.GINConv(mlp(h, c)), dropout=0.0),
        "sgc": SGC,
        "appnp": APPNPNet,
        "tagcn": lambda: Two(gnn.TAGConv(k, h, K=3), gnn.TAGConv(h, c, K=3)),
        "gat": lambda: Two(gnn.GATConv(k, 8, heads=8, dropout=0.6),
                           gnn.GATConv(64, c, heads=1, dropout=0.6), act=F.elu, dropout=0.6),
        "tutorial": lambda: Two(TutorialGCNConv(k, h), TutorialGCNConv(h, c), dropout=0.0),
    }[name]()


def _graph(name):
    from bench.pyg import edge_index_of
    ei, n = edge_index_of(name)
    return ei, n


def _adj_t(ei, n):
    """The ``adj_t`` PyG's ``ToSparseTensor`` makes, as a ``torch.sparse`` CSR tensor: row
    ``v`` holds the sources of the edges into ``v``."""
    src, dst = ei
    coo = torch.sparse_coo_tensor(torch.stack([dst, src]), torch.ones(src.numel()), (n, n))
    return coo.coalesce().to_sparse_csr()


def _rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_one(model_name, variant, training, graph, calls):
    """One configuration in this process: a dict of figures."""
    from granii import granii
    from granii.api import what_ran
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")
    ei, n = _graph(graph)
    g = ei
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, FEATURES, generator=gen) for _ in range(calls)]
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    ref = build(model_name)
    model = build(model_name)
    model.train(training)
    ref.train(training)
    base = _rss_mib()
    run = model
    if variant == "compile":
        run = torch.compile(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01) if training else None

    def step(m, x, o):
        if not training:
            with torch.no_grad():
                return m(x, g)
        torch.manual_seed(7)                       # the same dropout masks for every variant
        out = m(x, g)
        loss = torch.nn.functional.cross_entropy(out, labels)
        o.zero_grad()
        loss.backward()
        o.step()
        return loss.detach()

    times = []
    t0 = time.perf_counter()
    if variant == "adj_t":         # built once per graph, as granii's index: in the first call
        g = _adj_t(ei, n)
    if variant.startswith("granii"):
        if training:
            torch.manual_seed(7)
            granii(model, xs[0], ei)
        else:
            with torch.no_grad():
                granii(model, xs[0], ei)
    if variant == "granii_compile":
        run = torch.compile(model)
    setup = time.perf_counter() - t0
    outs = []
    for i, x in enumerate(xs):
        t = time.perf_counter()
        outs.append(step(run, x, opt))
        times.append(time.perf_counter() - t)
    times[0] += setup
    peak = _rss_mib() - base
    # eager PyG on the first input (and in training the first step), to compare
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01) if training else None
    want = step(ref, xs[0], ref_opt)
    diff = float((outs[0] - want).abs().max() / max(float(want.abs().max()), 1e-6))
    ran = ""
    if variant.startswith("granii"):
        kinds = sorted({f"{r.kind} {r.label}" for r in what_ran(model).values()})
        ran = "; ".join(kinds)
    return {"model": model_name, "variant": variant,
            "mode": "training" if training else "inference", "graph": graph, "N": n,
            "E": int(ei.shape[1]), "calls": calls, "first_ms": round(1e3 * times[0], 2),
            "steady_ms": round(1e3 * statistics.median(times[1:]), 3),
            "total_s": round(sum(times), 4), "peak_mib": round(peak, 1), "ran": ran,
            "max_rel_diff": f"{diff:.1e}"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph", default="github-social")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "results" / "pyg"))
    ap.add_argument("--replace", action="store_true",
                    help="run only --variants and replace their rows in the CSV under --out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        m, v, mode = args.child.split(":")
        print(json.dumps(run_one(m, v, mode == "training", args.graph, args.calls)))
        return None
    rows = []
    configs = [(m, v, mode) for m in args.models.split(",") for mode in ("inference", "training")
               for v in args.variants.split(",") if not (v == "adj_t" and m in NO_ADJ_T)
               and not (v in ABLATIONS and mode == "inference")]
    for i, (m, v, mode) in enumerate(configs):
        cmd = [sys.executable, "-m", "bench.pyg_models", "--graph", args.graph, "--calls",
               str(args.calls), "--child", f"{m}:{v}:{mode}"]
        env = dict(os.environ, PYTHONWARNINGS="ignore", **ABLATIONS.get(v, {}))
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=1800)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            row = {"model": m, "variant": v, "mode": mode, "graph": args.graph,
                   "error": tail[:200]}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"[{i + 1}/{len(configs)}] {m:9s} {mode:9s} {v:8s} "
              + (f"first {row['first_ms']:9.1f} ms  steady {row['steady_ms']:8.2f} ms  "
                 f"total {row['total_s']:7.3f} s  peak {row['peak_mib']:7.1f} MiB  {row['ran']}"
                 if "error" not in row else f"ERROR {row['error']}"), flush=True)
    cmd = " ".join(["python -m bench.pyg_models"] + (argv or sys.argv[1:]))
    if args.replace:
        rows = _replaced(Path(args.out) / "pyg_models.csv", rows)
        cmd += " (its rows replacing those of the earlier run in the CSV)"
    _report(rows, cmd, args.out)
    return rows


def _replaced(path, new):
    """The rows of ``path`` with those of ``new`` (same model, mode, variant) in their place."""
    import csv
    nums = ("first_ms", "steady_ms", "total_s", "peak_mib", "N", "E", "calls")
    with open(path) as f:
        old = [{k: (float(v) if k in nums and v not in ("", None) else v) for k, v in r.items()}
               for r in csv.DictReader(f)]
    fresh = {(r["model"], r["mode"], r["variant"]): r for r in new}
    out = [fresh.pop((r["model"], r["mode"], r["variant"]), r) for r in old]
    return out + list(fresh.values())


def _report(rows, cmd, out):
    from bench.csvfile import write_csv
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if "error" not in r]
    eager = {(r["model"], r["mode"]): r for r in ok if r["variant"] == "eager"}
    for r in ok:
        e = eager.get((r["model"], r["mode"]))
        r["speedup_total"] = round(e["total_s"] / r["total_s"], 3) if e else ""
        r["speedup_steady"] = round(e["steady_ms"] / r["steady_ms"], 3) if e else ""
    write_csv(out / "pyg_models.csv", rows)
    lines = ["# 2-layer PyG models: granii against eager PyG, `adj_t` and `torch.compile`", "",
             f"`{cmd}` (2 threads, CPU; each row a fresh process; torch {torch.__version__}). "
             "*speedup*: eager's total over the variant's (first call included: `granii(...)` "
             "and `torch.compile`'s compilation count there); *steady*: the same of the medians "
             "of the later calls. *peak*: growth of the process's peak resident memory during "
             "the calls.", "",
             "| model | mode | variant | first ms | steady ms | total s | speedup | steady x | "
             "peak MiB | granii ran | rel. diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['variant']} | error: "
                         f"{r['error']} |||||||")
            continue
        lines.append(f"| {r['model']} | {r['mode']} | {r['variant']} | {r['first_ms']} | "
                     f"{r['steady_ms']} | {r['total_s']} | **{r['speedup_total']}x** | "
                     f"{r['speedup_steady']}x | {r['peak_mib']} | {r['ran']} | "
                     f"{r['max_rel_diff']} |")
    lines.append("")
    for mode in ("inference", "training"):
        for v in VARIANTS + MORE_VARIANTS:
            sel = [r["speedup_total"] for r in ok if r["mode"] == mode and r["variant"] == v
                   and r["speedup_total"] not in ("", 0)]
            if sel and v != "eager":
                gm = float(np.exp(np.mean(np.log(sel))))
                lines.append(f"- {mode}, {v}: geometric mean {gm:.2f}x over eager "
                             f"({len(sel)} models, lowest {min(sel):.2f}x)")
        best = []
        for m in {r["model"] for r in ok if r["mode"] == mode}:
            others = [r["total_s"] for r in ok if r["model"] == m and r["mode"] == mode
                      and not r["variant"].startswith("granii")]
            mine = [r["total_s"] for r in ok if r["model"] == m and r["mode"] == mode
                    and r["variant"] == "granii"]
            if others and mine:
                best.append(min(others) / mine[0])
        if best:
            gm = float(np.exp(np.mean(np.log(best))))
            lines.append(f"- {mode}: granii against the fastest PyG variant of each model: "
                         f"geometric mean {gm:.2f}x, lowest {min(best):.2f}x")
    lines.append(f"\nLoad average at the end: {os.getloadavg()[0]:.2f}.")
    (out / "pyg_models.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
