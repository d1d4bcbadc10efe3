"""What granii's dispatcher adds per call over running the chosen plan directly.

    python -m bench.dispatch_overhead [--out results/bench] [--threads 1] [--grad]
                                      [--graphs random-500,pubmed] [--clock wall|cpu]

For each layer of ``bench.models`` on a small graph (where per-call work is smallest, so the
overhead shows most) and on the shipped PubMed graph, calls on features that are new at each call
(made before the timer): ``layer(g, x)`` through the dispatcher, against the compiled function of
the plan the layer chose, called with the same leaf values (what ``explain`` prints as generated
code). Each round times ``CALLS`` pairs of calls, one of each, on two different new feature
tensors, the order alternating; the overhead is the median, over ``ROUNDS`` rounds, of each round's
median difference within a pair:

    overhead = dispatcher call - direct call           (microseconds, paired)

Pairing keeps slow phases of a loaded machine out of the difference: both calls of a pair see
the same load. The dispatcher's figure includes ``nn.Module.__call__``, which DGL's own layer
pays too. Also DGL's own layer on the same calls (rounds of ``CALLS`` calls), to read the overhead
against its time. ``--grad``: calls with gradients enabled (a training forward, no backward);
by default inference (``torch.no_grad``). ``--clock cpu`` times with this thread's CPU time
instead of wall time, for a machine other work loads.

The header of the report gives the command, the CPUs the process may run on and the 1-minute load
average before and after the run: timings on a loaded machine are slower and noisier.
"""
import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import dgl
import torch

from granii import granii
from granii.runtime.bind import prepare
from granii.runtime.dispatch import dispatcher_of

from .csvfile import write_csv
from .graphs import with_self_loops
from .models import MODELS

CALLS = 20
ROUNDS = 15
LAYERS = ("gcn", "sgc", "tagcn", "gin", "sage", "gat4")
SIZES = ((32, 32), (128, 128))
GRAPHS = ("random-500", "pubmed")
# wall: time.perf_counter; cpu: this thread's CPU time (leaves out the time other processes hold
# the CPU, so a loaded machine inflates it less; each reading costs about a microsecond)
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
CLOCK = {"ns": CLOCKS["wall"]}


def _graphs(names):
    def make(name):
        if name == "random-500":
            return dgl.add_self_loop(dgl.rand_graph(500, 2500, idtype=torch.int64))
        from granii.datasets import load_graph
        return with_self_loops(load_graph(name))
    return {name: make(name) for name in names}


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


def _paired_round(dispatcher, direct, xs, ys, first_dispatcher):
    """Per-call microseconds of both and the median difference, over one round of pairs."""
    t_disp, t_direct, diffs = [], [], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        order = ((dispatcher, x), (direct, y))
        if (i % 2 == 0) != first_dispatcher:
            order = order[::-1]
        took = {}
        for f, feat in order:
            t = CLOCK["ns"]()
            f(feat)
            took[f] = CLOCK["ns"]() - t
        t_disp.append(took[dispatcher])
        t_direct.append(took[direct])
        diffs.append(took[dispatcher] - took[direct])
    return [statistics.median(v) * 1e-3 for v in (t_disp, t_direct, diffs)]


def _round(f, xs):
    t = CLOCK["ns"]()
    for x in xs:
        f(x)
    return (CLOCK["ns"]() - t) * 1e-3 / len(xs)


def measure(name, g, k_in, k_out, grad=False):
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
    ys = [torch.randn(n, k_in) for _ in range(CALLS)]
    dispatcher = lambda x: layer(g, x)          # noqa: E731
    dgl_layer = lambda x: ref(g, x)             # noqa: E731
    rounds, dgl_rounds = [], []
    with torch.set_grad_enabled(grad):
        for f in (dispatcher, direct, dgl_layer):
            for x in xs[:3]:
                f(x)
        for r in range(ROUNDS):
            rounds.append(_paired_round(dispatcher, direct, xs, ys, r % 2 == 0))
            dgl_rounds.append(_round(dgl_layer, xs))
    disp, dir_, over = (statistics.median(col) for col in zip(*rounds))
    dgl_us = statistics.median(dgl_rounds)
    return dict(layer=name, graph=None, k_in=k_in, k_out=k_out, plan=label,
                dispatcher_us=round(disp, 1), direct_us=round(dir_, 1),
                overhead_us=round(over, 1), dgl_us=round(dgl_us, 1),
                overhead_of_dgl=round(over / dgl_us, 4))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--grad", action="store_true",
                    help="calls with gradients enabled (a training forward)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall time, or this thread's CPU time (on a loaded machine)")
    ap.add_argument("--graphs", default=",".join(GRAPHS),
                    help="comma-separated: random-500 and/or shipped graphs (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    CLOCK["ns"] = CLOCKS[args.clock]
    load_before = os.getloadavg()[0]
    rows = []
    graphs = _graphs(args.graphs.split(","))
    todo = [(gname, name, ki, ko) for gname in graphs for name in LAYERS for ki, ko in SIZES]
    for i, (gname, name, ki, ko) in enumerate(todo, 1):
        r = measure(name, graphs[gname], ki, ko, args.grad)
        if r is None:
            print(f"[{i}/{len(todo)}] {gname} {name} {ki}->{ko}: kept the original forward")
            continue
        r["graph"] = gname
        rows.append(r)
        print(f"[{i}/{len(todo)}] {gname} {name} {ki}->{ko}: dispatcher {r['dispatcher_us']} us, "
              f"direct {r['direct_us']} us, overhead {r['overhead_us']} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "dispatch_overhead" + ("_grad" if args.grad else "")
    write_csv(args.out / f"{stem}.csv", rows)
    command = " ".join(["python -m bench.dispatch_overhead"]
                       + list(sys.argv[1:] if argv is None else argv))
    _write_md(rows, args, command, stem, load_before, os.getloadavg()[0])


def _write_md(rows, args, command, stem, load_before, load_after):
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    mode = "gradients enabled (training forward)" if args.grad else "inference (no_grad)"
    lines = ["# Dispatcher overhead per call", "",
             f"Command: `{command}`; {args.threads} torch thread(s), "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, CPUs {cpus}; "
             f"{mode}; {args.clock} clock. 1-minute load average: {load_before:.2f} before, "
             f"{load_after:.2f} after the run, on {os.cpu_count()} CPUs. Features new at each "
             f"call. Per call: median of {ROUNDS} rounds of {CALLS} paired calls (dispatcher, "
             "plan run directly); overhead: median of the rounds' median paired differences.",
             "", "| graph | layer | k_in→k_out | plan | dispatcher µs | plan direct µs | "
             "overhead µs | DGL layer µs | overhead / DGL |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['layer']} | {r['k_in']}→{r['k_out']} | {r['plan']} | "
                     f"{r['dispatcher_us']} | {r['direct_us']} | {r['overhead_us']} | "
                     f"{r['dgl_us']} | {100 * r['overhead_of_dgl']:.1f}% |")
    ov = sorted(r["overhead_us"] for r in rows)
    lines += ["", f"Overhead: median {statistics.median(ov):.1f} µs, max {ov[-1]:.1f} µs per layer "
              "call (target: at most 30 µs)."]
    for gname in dict.fromkeys(r["graph"] for r in rows):
        mine = sorted(r["overhead_us"] for r in rows if r["graph"] == gname)
        lines.append(f"On {gname}: median {statistics.median(mine):.1f} µs, "
                     f"from {mine[0]:.1f} to {mine[-1]:.1f} µs.")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(line for line in lines if line.startswith(("Overhead", "On "))))


if __name__ == "__main__":
    main()
