"""k-hop propagation layers: how long ``granii()`` takes to decide, and what the plans gain.

    flock -x /tmp/granii-cpu.lock python -m bench.khop [--graphs cora pubmed] [--calls 50]
                                                       [--out results/khop]

Part 1, deciding: ``granii(layer, g, x)`` in a fresh process each, after one ``granii()`` of a
GraphConv that pays the process's one-time costs (loading the cost models; reported beside),
for APPNPConv at k = 2, 5, 10,
20, a user k-hop layer written with ``update_all`` (``KHop``: row-broadcast normalisation,
``copy_u`` + ``sum``, ``(1 - alpha) h + alpha h_0``) at k = 10 and 20, and TAGConv (16 -> 16) at
k = 8 and 10, on Cora; each child has a timeout (a search that does not end shows as one). Beside
it, the CPU time of enumeration alone (``enumerate_layer``) and the candidates it made.

Part 2, running: APPNPConv at k = 10 and 20 on the real graphs (self-loops added), features of
the dataset's class count (what APPNP propagates in DGL's example: an MLP's logits) and of 64.
``calls`` calls on new features (made before the timer), DGL's layer and granii's copy taking
turns call by call; granii's first call includes its ``granii(...)`` call. Inference under
``torch.no_grad()``; training: forward and backward of a weighted sum, the features requiring
grad. Reported: totals over the calls (first call included) and the median of the later calls.
2 torch threads.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import dgl.function as fn
import torch
from torch import nn

from .csvfile import write_csv

CLASSES = {"cora": 7, "citeseer": 6, "pubmed": 3}
DECIDE = [("appnp", 2), ("appnp", 5), ("appnp", 10), ("appnp", 20), ("khop", 10), ("khop", 20),
          ("tagconv", 8), ("tagconv", 10)]


class KHop(nn.Module):
    """APPNP's propagation as a user writes it with ``update_all``."""

    def __init__(self, k, alpha=0.1):
        super().__init__()
        self.k, self.alpha = k, alpha

    def forward(self, g, feat):
        with g.local_scope():
            norm = torch.pow(g.in_degrees().float().clamp(min=1), -0.5).unsqueeze(1)
            h0 = h = feat
            for _ in range(self.k):
                g.ndata["h"] = h * norm
                g.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
                h = g.ndata["h"] * norm
                h = (1 - self.alpha) * h + self.alpha * h0
            return h


def make_layer(name, k, width):
    from dgl.nn import APPNPConv, TAGConv
    if name == "appnp":
        return APPNPConv(k, 0.1)
    if name == "khop":
        return KHop(k)
    return TAGConv(width, width, k=k)


def child(name, k):
    """One ``granii()`` in this (fresh) process; prints a JSON line."""
    import granii
    from granii import enumerate as en
    from granii.datasets import load_graph
    from granii.runtime.dispatch import layer_states
    from granii.frontend import lower_layer
    torch.set_num_threads(2)
    from dgl.nn import GraphConv
    g = load_graph("cora", self_loops="add")
    width = 16
    t = time.perf_counter()             # the process's one-time costs, on another layer
    granii.granii(GraphConv(width, width).eval(), g, torch.randn(g.num_nodes(), width))
    setup_s = time.perf_counter() - t
    layer = make_layer(name, k, width).eval()
    x = torch.randn(g.num_nodes(), width)
    ref = layer(g, x)
    t = time.perf_counter()
    granii.granii(layer, g, x)
    decide_s = time.perf_counter() - t
    err = (layer(g, x) - ref).abs().max().item()
    st = layer_states(layer)[0]
    t = en.clock()
    found = en.enumerate_layer(lower_layer(make_layer(name, k, width)).root)
    enum_cpu = en.clock() - t
    print(json.dumps(dict(layer=name, k=k, first_granii_s=setup_s, granii_s=decide_s,
                          enumerate_cpu_s=enum_cpu,
                          candidates=found.n_candidates, trees=found.n_trees,
                          forms=found.n_forms, kept=len(found.forest),
                          budget_hit=found.budget_hit,
                          runs=("original forward" if st.ran is None or st.ran.kind == "fallback"
                                else "plan"), max_error=err)))


def decide_rows(timeout):
    rows = []
    for name, k in DECIDE:
        env = dict(os.environ, OMP_NUM_THREADS="2")
        t = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "bench.khop", "--child", name, str(k)],
                                  capture_output=True, text=True, timeout=timeout, env=env)
            line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(line[-1]) if line else dict(layer=name, k=k, error=done.stderr[-300:])
        except subprocess.TimeoutExpired:
            row = dict(layer=name, k=k, granii_s=f"> {timeout}", runs="timeout")
        row["process_s"] = time.perf_counter() - t
        print(row, flush=True)
        rows.append(row)
    return rows


def speed_rows(graphs, calls):
    import granii
    from dgl.nn import APPNPConv
    from granii.datasets import load_graph
    from granii.runtime.dispatch import layer_states
    torch.set_num_threads(2)
    # the process's one-time costs (cost models, first kernel calls) before any timing
    warm = load_graph("cora", self_loops="add")
    w = APPNPConv(2, 0.1)
    granii.granii(w, warm, torch.randn(warm.num_nodes(), 8))
    w(warm, torch.randn(warm.num_nodes(), 8, requires_grad=True)).sum().backward()
    rows = []
    for gname in graphs:
        g = load_graph(gname, self_loops="add")
        n = g.num_nodes()
        for k in (10, 20):
            for width in (CLASSES.get(gname, 8), 64):
                for mode in ("inference", "train"):
                    rows.append(_speed(g, gname, n, k, width, mode, calls, granii, layer_states))
                    print(rows[-1], flush=True)
    return rows


def _speed(g, gname, n, k, width, mode, calls, granii, layer_states):
    from dgl.nn import APPNPConv
    train = mode == "train"
    dgl_layer = APPNPConv(k, 0.1).train(train)
    ours = copy.deepcopy(dgl_layer)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, width, generator=gen).requires_grad_(train) for _ in range(calls)]
    r = torch.randn(n, width, generator=gen)

    def call(m, x):
        if train:
            (m(g, x) * r).sum().backward()
        else:
            with torch.no_grad():
                m(g, x)

    times = {"dgl": [], "granii": []}
    decide = 0.0
    for i, x in enumerate(xs):
        for label, m in (("dgl", dgl_layer), ("granii", ours)):
            t = time.perf_counter()
            if label == "granii" and i == 0:
                if train:
                    granii.granii(m, g, x.detach())
                else:
                    with torch.no_grad():
                        granii.granii(m, g, x)
                decide = time.perf_counter() - t
            call(m, x)
            times[label].append(time.perf_counter() - t)
    with torch.no_grad():
        x = torch.randn(n, width)
        err = (ours(g, x) - dgl_layer(g, x)).abs().max().item()
    st = layer_states(ours)[0]
    runs = "original forward" if st.ran is None or st.ran.kind == "fallback" else \
        (st.ran[1] if len(st.ran) > 1 else "plan")
    total = {k_: sum(v) for k_, v in times.items()}
    steady = {k_: statistics.median(v[1:]) for k_, v in times.items()}
    return dict(graph=gname, nodes=n, edges=g.num_edges(), k=k, width=width, mode=mode,
                calls=calls, dgl_total_ms=1e3 * total["dgl"], granii_total_ms=1e3 * total["granii"],
                granii_decide_ms=1e3 * decide,
                speedup_first_included=total["dgl"] / total["granii"],
                dgl_median_ms=1e3 * steady["dgl"], granii_median_ms=1e3 * steady["granii"],
                speedup_steady=steady["dgl"] / steady["granii"], runs=str(runs), max_error=err)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def write_report(out, decide, speed, args):
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "khop.csv", [dict(part="decide", **r) for r in decide] +
              [dict(part="speed", **r) for r in speed])
    load = " / ".join(f"{a:.1f}" for a in os.getloadavg())
    lines = ["# k-hop layers: deciding and running", "",
             f"`python -m bench.khop --graphs {' '.join(args.graphs)} --calls {args.calls}` "
             f"(2 torch threads; load average when the report was written: {load}).", "",
             "## `granii()` in a fresh process (Cora, 16 features; TAGConv 16 -> 16)", "",
             "`first_granii_s`: the process's first `granii(...)` (a GraphConv: loading the cost "
             "models, first kernel calls); `granii_s`: then the k-hop layer's `granii(...)`; "
             "`enumerate_cpu_s`: enumeration alone (CPU seconds); `candidates`/`trees`/`forms`: "
             "what it made; `kept`: layer trees left to prune; `runs`: what the next call ran.", ""]
    cols = ["layer", "k", "first_granii_s", "granii_s", "enumerate_cpu_s", "candidates", "trees", "forms", "kept",
            "budget_hit", "runs", "max_error"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in decide]
    lines += ["", f"## APPNPConv against DGL's layer ({args.calls} calls on new features)", "",
              "`speedup_first_included`: DGL's total over granii's, granii's first call with its "
              "`granii(...)`; `speedup_steady`: medians of the later calls.", ""]
    cols = ["graph", "k", "width", "mode", "dgl_total_ms", "granii_total_ms", "granii_decide_ms",
            "speedup_first_included", "dgl_median_ms", "granii_median_ms", "speedup_steady",
            "runs", "max_error"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in speed]
    (out / "khop.md").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("LAYER", "K"))
    ap.add_argument("--graphs", nargs="+", default=["cora", "pubmed"])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--out", default="results/khop")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    decide = decide_rows(args.timeout)
    speed = speed_rows(args.graphs, args.calls)
    write_report(Path(args.out), decide, speed, args)
    print(f"wrote {args.out}/khop.md and khop.csv")


if __name__ == "__main__":
    main()
