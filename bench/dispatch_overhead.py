"""What granii's dispatcher adds per call over running the chosen plan directly.

    python -m bench.dispatch_overhead [--out results/bench] [--threads 1]

For each layer of ``bench.models`` on a small graph (where per-call work is smallest, so the
overhead shows most) and on the shipped PubMed graph, inference on features that are new at each
call (made before the timer): ``layer(g, x)`` through the dispatcher, against the compiled function
of the plan the layer chose, called with the same leaf values (what ``explain`` prints as generated
code). Both take turns in rounds of ``CALLS`` calls; the per-call figure is the median round over
``ROUNDS`` rounds. Also DGL's own layer on the same calls, to read the overhead against its time.

    overhead = dispatcher - direct        (microseconds per call)
"""
import argparse
import copy
import csv
import statistics
import time
from pathlib import Path

import dgl
import torch

from granii import granii
from granii.dispatch import dispatcher_of, prepare

from .graphs import with_self_loops
from .models import MODELS

CALLS = 20
ROUNDS = 15
LAYERS = ("gcn", "sgc", "tagcn", "gin", "sage", "gat4")
SIZES = ((32, 32), (128, 128))


def _graphs():
    from granii.datasets import load_graph
    small = dgl.add_self_loop(dgl.rand_graph(500, 2500, idtype=torch.int64))
    return {"random-500": small, "pubmed": with_self_loops(load_graph("pubmed"))}


def _kept_plan(layer, g, x):
    """The chosen plan's function and its leaf values for a call on ``(g, x)``, with the position
    of the features among them."""
    st = dispatcher_of(layer).state
    with torch.no_grad():
        call = prepare(st, layer, (g, x), {})
    per_graph = st.decisions[call.gi]
    decision = next(d for k, d in per_graph.items()
                    if isinstance(k, tuple) and k and k[0] == call.key and isinstance(d, tuple))
    label, fn, order = decision[:3]
    if fn is None:
        return None
    vals = [call.leaf_vals[v] for v in order]
    at = next(i for i, v in enumerate(vals) if v is x)
    return lambda feat: fn(call.gi, layer, *(vals[:at] + [feat] + vals[at + 1:])), label, call.gi


def measure(name, g, k_in, k_out):
    torch.manual_seed(0)
    model = MODELS[name]
    ref = model.dgl(k_in, k_out)
    layer = copy.deepcopy(ref)
    n = g.num_nodes()
    x0 = torch.randn(n, k_in)
    granii(layer, g, x0, tune=False)
    kept = _kept_plan(layer, g, x0)
    if kept is None:
        return None
    direct, label, _ = kept
    xs = [torch.randn(n, k_in) for _ in range(CALLS)]
    runs = {"dispatcher": lambda x: layer(g, x), "direct": direct, "dgl": lambda x: ref(g, x)}
    times = {k: [] for k in runs}
    with torch.no_grad():
        for f in runs.values():
            for x in xs[:3]:
                f(x)
        for _ in range(ROUNDS):
            for k, f in runs.items():
                t = time.perf_counter()
                for x in xs:
                    f(x)
                times[k].append((time.perf_counter() - t) / CALLS)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return dict(layer=name, graph=None, k_in=k_in, k_out=k_out, plan=label,
                dispatcher_us=round(med["dispatcher"], 1), direct_us=round(med["direct"], 1),
                overhead_us=round(med["dispatcher"] - med["direct"], 1),
                dgl_us=round(med["dgl"], 1),
                overhead_of_dgl=round((med["dispatcher"] - med["direct"]) / med["dgl"], 4))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    graphs = _graphs()
    todo = [(gname, name, ki, ko) for gname in graphs for name in LAYERS for ki, ko in SIZES]
    for i, (gname, name, ki, ko) in enumerate(todo, 1):
        r = measure(name, graphs[gname], ki, ko)
        if r is None:
            print(f"[{i}/{len(todo)}] {gname} {name} {ki}->{ko}: kept the original forward")
            continue
        r["graph"] = gname
        rows.append(r)
        print(f"[{i}/{len(todo)}] {gname} {name} {ki}->{ko}: dispatcher {r['dispatcher_us']} us, "
              f"direct {r['direct_us']} us, overhead {r['overhead_us']} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "dispatch_overhead.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _write_md(rows, args)


def _write_md(rows, args):
    load = [round(x, 2) for x in __import__("os").getloadavg()]
    lines = ["# Dispatcher overhead per call", "",
             f"Command: `python -m bench.dispatch_overhead --threads {args.threads}`; "
             f"{args.threads} torch thread(s); 1-min load average at the end {load[0]}. "
             f"Median of {ROUNDS} rounds of {CALLS} calls, new features each call, inference.",
             "", "| graph | layer | k_in→k_out | plan | dispatcher µs | plan direct µs | "
             "overhead µs | DGL layer µs | overhead / DGL |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['layer']} | {r['k_in']}→{r['k_out']} | {r['plan']} | "
                     f"{r['dispatcher_us']} | {r['direct_us']} | {r['overhead_us']} | "
                     f"{r['dgl_us']} | {100 * r['overhead_of_dgl']:.1f}% |")
    ov = sorted(r["overhead_us"] for r in rows)
    lines += ["", f"Overhead: median {statistics.median(ov):.1f} µs, max {ov[-1]:.1f} µs per layer "
              "call (target: at most 30 µs)."]
    (args.out / "dispatch_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main()
