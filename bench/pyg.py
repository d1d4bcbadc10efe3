"""PyG layers: granii against PyTorch Geometric's eager forward, single layers.

    python -m bench.pyg [--calls 20] [--graphs cora,pubmed,github-social] [--quick]
                        [--layers GINEConv,GATv2Conv,...] [--out results/pyg]

For each real graph of ``data/`` (read as PyG's ``edge_index``, both directions, no self loops),
each supported layer (GCNConv, SAGEConv mean and max, GINConv with a 2-layer MLP, SGConv K=2,
APPNP K=10, GraphConv; with ``--layers``, also those taking edge features or attention:
GATConv and GATv2Conv with 4 heads of 16, GINEConv, GATv2Conv with 8-wide edge features, whose
``edge_attr`` (E x width, random, one per graph) is passed on every call) and each mode (inference: ``eval()`` and ``no_grad``; training: forward
and backward of a random projection of the output; APPNP, which has no parameters, backward to
its features), two copies of one layer with the same
weights run ``--calls`` calls on new random features each call (64 -> 64):

    PyG     the layer's own forward
    granii  ``granii(layer, x_0, edge_index)`` (lowering, enumeration, the decision, and the run
            it makes) then the calls: its first call is included in the total

Each configuration runs in a fresh process (``--one``): PyG's eager times depend on what the
process ran before. Reported: total seconds of each (granii's ``granii(...)`` included, which
loads the cost models in each process), their ratio, the median
of the last half of the calls (steady state), what granii ran, and the largest difference of
the outputs from PyG's (each call is checked). Writes ``results/pyg/pyg.csv`` and ``pyg.md``.
Run under ``flock -x /tmp/granii-cpu.lock`` with 2 threads.
"""
import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.csvfile import write_csv
from granii import datasets

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "pyg"
K = 64


def edge_index_of(name):
    """A shipped graph as ``edge_index`` (both directions, deduplicated, no self loops) and its
    node count, read without DGL."""
    kind, rel = datasets._FILES[name]
    path = datasets._path(rel)
    if kind == "mtx":
        u, v, n, _ = datasets.read_mtx(path)
    elif kind == "csv":
        u, v, n = datasets.read_edge_csv(path)
    else:
        u, v, n = datasets.read_metis(path)
    u, v = np.concatenate([u, v]), np.concatenate([v, u])
    keep = u != v
    key = np.unique(u[keep] * n + v[keep])
    return torch.from_numpy(np.stack([key // n, key % n])).contiguous(), int(n)


def layers():
    from torch_geometric import nn as gnn

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.ReLU(), torch.nn.Linear(K, K))
    return {
        "GCNConv": lambda: gnn.GCNConv(K, K),
        "SAGEConv-mean": lambda: gnn.SAGEConv(K, K),
        "SAGEConv-max": lambda: gnn.SAGEConv(K, K, aggr="max"),
        "GINConv": lambda: gnn.GINConv(mlp()),
        "SGConv-K2": lambda: gnn.SGConv(K, K, K=2),
        "APPNP-K10": lambda: gnn.APPNP(K=10, alpha=0.1),
        "GraphConv": lambda: gnn.GraphConv(K, K),
    }


def more_layers():
    """Layers ``--layers`` may name besides ``layers()``'s: attention and edge features."""
    from torch_geometric import nn as gnn

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.ReLU(), torch.nn.Linear(K, K))
    return {
        "GATConv-h4": lambda: gnn.GATConv(K, K // 4, heads=4),
        "GATv2Conv-h4": lambda: gnn.GATv2Conv(K, K // 4, heads=4),
        "GINEConv": lambda: gnn.GINEConv(mlp()),
        "GATv2Conv-h4-edge8": lambda: gnn.GATv2Conv(K, K // 4, heads=4, edge_dim=EDGE_DIM),
    }


EDGE_DIM = 8
# the width of the edge features a layer's call takes (GINEConv's are as wide as x)
EDGE_FEATS = {"GINEConv": K, "GATv2Conv-h4-edge8": EDGE_DIM}


def _step(layer, x, ei, training, proj, extra=()):
    out = layer(x, ei, *extra)
    if training:
        (out * proj).sum().backward()
    return out.detach()


def run_one(make, ei, n, training, calls, seed=0, edge_width=None):
    from granii import granii
    from granii.api import what_ran
    torch.manual_seed(seed)
    ref = make()
    opt = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(seed + 1)
    # a layer without parameters (APPNP) trains through its input's gradient
    grad_x = training and not any(True for _ in ref.parameters())
    xs = [torch.randn(n, K, generator=gen).requires_grad_(grad_x) for _ in range(calls)]
    proj = torch.randn(n, K, generator=gen)
    extra = () if edge_width is None else (torch.randn(ei.shape[1], edge_width, generator=gen),)
    for m in (ref, opt):
        m.train(training)
    ctx = torch.enable_grad if training else torch.no_grad
    t_pyg, t_granii, outs = [], [], []
    with ctx():
        for x in xs:
            t = time.perf_counter()
            outs.append(_step(ref, x, ei, training, proj, extra))
            t_pyg.append(time.perf_counter() - t)
        t = time.perf_counter()
        granii(opt, xs[0], ei, *extra)
        setup = time.perf_counter() - t
        diff = 0.0
        for x, want in zip(xs, outs):
            t = time.perf_counter()
            got = _step(opt, x, ei, training, proj, extra)
            t_granii.append(time.perf_counter() - t)
            diff = max(diff, (got - want).abs().max().item())
    ran = next(iter(what_ran(opt).values()))
    half = calls // 2
    return {"pyg_total_s": sum(t_pyg), "granii_total_s": setup + sum(t_granii),
            "granii_setup_s": setup, "speedup_total": sum(t_pyg) / (setup + sum(t_granii)),
            "pyg_steady_ms": 1e3 * statistics.median(t_pyg[half:]),
            "granii_steady_ms": 1e3 * statistics.median(t_granii[half:]),
            "speedup_steady": statistics.median(t_pyg[half:]) / statistics.median(t_granii[half:]),
            "ran": f"{ran.kind} {ran.label}" if ran else "-", "max_abs_diff": diff}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--graphs", default="cora,pubmed,github-social")
    ap.add_argument("--quick", action="store_true", help="cora only, 6 calls")
    ap.add_argument("--layers", help="comma-separated layer names (default: layers())")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--one", nargs=3, metavar=("GRAPH", "LAYER", "MODE"),
                    help=argparse.SUPPRESS)      # one configuration, in this process
    args = ap.parse_args(argv)
    known = {**layers(), **more_layers()}
    names = args.layers.split(",") if args.layers else list(layers())
    unknown = [nm for nm in names if nm not in known]
    if unknown:
        ap.error(f"unknown layers {unknown}: choose from {sorted(known)}")
    out = Path(args.out)
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")
    graphs = ["cora"] if args.quick else args.graphs.split(",")
    calls = 6 if args.quick else args.calls
    if args.one:
        gname, lname, mode = args.one
        ei, n = edge_index_of(gname)
        r = run_one(known[lname], ei, n, mode == "training", calls,
                    edge_width=EDGE_FEATS.get(lname))
        print("RESULT " + json.dumps({"N": n, "E": ei.shape[1], **r}), flush=True)
        return [r]
    rows = []
    for gname in graphs:
        for lname in names:
            for mode in ("inference", "training"):
                r = _in_own_process(gname, lname, mode, calls)
                row = {"graph": gname, "N": r.pop("N"), "E": r.pop("E"), "layer": lname,
                       "mode": mode, "calls": calls, **r}
                rows.append(row)
                print(f"{gname:14s} {lname:14s} {row['mode']:9s} total x{r['speedup_total']:5.2f}"
                      f"  steady x{r['speedup_steady']:5.2f}  ({r['ran']}, diff "
                      f"{r['max_abs_diff']:.1e})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "pyg.csv", rows)
    write_markdown(out / "pyg.md", rows, " ".join(["python -m bench.pyg"] + (argv or sys.argv[1:])))
    return rows


def _in_own_process(gname, lname, mode, calls):
    """``run_one`` of one configuration in a process of its own: PyG's eager times depend on
    what the process ran before (after the Cora and PubMed configurations, GCNConv's calls on
    GitHub took 42 ms where a fresh process takes 140-150), so no configuration inherits
    another's allocator state, nor granii's process-wide caches."""
    cmd = [sys.executable, "-m", "bench.pyg", "--one", gname, lname, mode, "--calls", str(calls)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{gname} {lname} {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def markdown_from_csv(csv_path, md_path, command):
    """``pyg.md`` written again from ``pyg.csv`` (numbers read back as floats)."""
    import csv
    with open(csv_path) as f:
        rows = [{k: (float(v) if k.endswith(("_s", "_ms", "_diff")) or k.startswith("speedup")
                     else v) for k, v in r.items()} for r in csv.DictReader(f)]
    write_markdown(md_path, rows, command)


def write_markdown(path, rows, command):
    lines = [f"# granii against PyG's eager forward, single layers (k = {K} -> {K})", "",
             f"`{command}`, 2 threads, new random features each call. *total*: PyG's calls "
             "against `granii(layer, x, edge_index)` plus the same calls (its first included); "
             "*steady*: medians of the last half of the calls. Each output checked against "
             "PyG's (*diff*). Each configuration runs in a process of its own, PyG's calls "
             "first: granii's setup includes loading this machine's cost models and its first "
             "call's other once-per-process costs.", "",
             "| graph | layer | mode | PyG total s | granii total s (setup) | total x | "
             "PyG ms/call | granii ms/call | steady x | ran | diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['layer']} | {r['mode']} | {r['pyg_total_s']:.3f} | "
                     f"{r['granii_total_s']:.3f} ({r['granii_setup_s']:.3f}) | "
                     f"{r['speedup_total']:.2f} | {r['pyg_steady_ms']:.2f} | "
                     f"{r['granii_steady_ms']:.2f} | {r['speedup_steady']:.2f} | {r['ran']} | "
                     f"{r['max_abs_diff']:.1e} |")
    for mode in ("inference", "training"):
        sel = [r for r in rows if r["mode"] == mode]
        if sel:
            gm = float(np.exp(np.mean([np.log(r["speedup_total"]) for r in sel])))
            gs = float(np.exp(np.mean([np.log(r["speedup_steady"]) for r in sel])))
            lines.append(f"\n{mode}: geometric mean total x{gm:.2f}, steady x{gs:.2f} "
                         f"({len(sel)} configurations)")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
