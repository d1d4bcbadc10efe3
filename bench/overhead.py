"""granii's run-time overhead against graph size: the work of the first call that DGL does not do.

For R-MAT and uniform graphs of about 1e4 to 1e7 directed edges, a GCN layer (GraphConv, norm
both, 32 -> 128), medians of ``runs`` repeats, each on a fresh copy of the graph (no cached
formats, no granii cache):

* ``prepare_ms``   frontend + enumerate + prune + bind for a fresh layer (graph-independent work
                   plus binding the call);
* ``index_ms``     ``GraphInfo``'s destination CSR and out-degrees (DGL's own first call builds
                   the same CSC, so part of this is not extra);
* ``features_ms``  the graph features the learned cost models read (``graph_features``);
* ``select_ms``    ranking every promoted plan with the cost model (``rank``) on a graph whose
                   features are computed but whose cost predictions are not cached yet;
* ``compile_ms``   generating and compiling the chosen plan's code;
* ``granii_first_ms`` / ``dgl_first_ms``  the whole first call: ``granii(copy, g, x)`` (which runs
                   the layer once) against DGL's first forward on its own fresh graph;
* ``dgl_steady_ms`` DGL's steady forward (median), to read the overhead in iterations.
"""
import copy
import statistics
import time

import numpy as np
import torch
from dgl.nn import GraphConv

from granii import granii as optimize
from granii.runtime.bind import prepare
from granii.featurize import graph_features
from granii.graph import GraphInfo
from granii.plan import compile_plan
from granii.select import rank
from granii.profiling import generators as gen
from granii.profiling.timing import median_time

from .graphs import with_self_loops
from .measure import fresh_graph, state_for

TARGETS = (1e4, 1e5, 1e6, 1e7)


def graph_specs(max_edges=1e7):
    """``(family, name, factory)`` near each target edge count up to ``max_edges``."""
    for target in (t for t in TARGETS if t <= max_edges * 1.01):
        scale = int(round(np.log2(target / 16)))
        ef = int(np.ceil(1.05 * target / 2 ** (scale + 1)))
        yield "rmat", f"rmat-s{scale}-ef{ef}", lambda s=scale, f=ef: gen.rmat(s, f, seed=3)
        n = int(target / 10)
        yield "uniform", f"uniform-{n}", lambda n=n, m=int(target / 2): gen.uniform(
            n, m, seed=3, undirected=True)


def _ms(fn, runs):
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def measure_graph(g, cost_model, runs=3, k_in=32, k_out=128):
    """The overhead row of one graph (see module doc)."""
    torch.manual_seed(0)
    layer = GraphConv(k_in, k_out, norm="both")
    x = torch.randn(g.num_nodes(), k_in)
    row = {}

    def do_prepare():
        m = copy.deepcopy(layer)
        return prepare(state_for(m), m, (fresh_graph(g), x), {})

    row["prepare_ms"] = _ms(do_prepare, runs)
    times, gi = [], None
    for _ in range(runs):
        fg = fresh_graph(g)
        t = time.perf_counter()
        gi = GraphInfo(fg)
        gi.csr_in()
        gi.out_degrees()
        times.append(time.perf_counter() - t)
    row["index_ms"] = statistics.median(times) * 1e3
    row["features_ms"] = _ms(lambda: (gi.cache.pop("graph_features", None), graph_features(gi)),
                             runs)
    state, sel, best = state_for(layer), [], None
    for _ in range(runs):           # a fresh graph each time: no cached predictions
        fg = fresh_graph(g)
        call = prepare(state, layer, (fg, x), {})
        graph_features(call.gi)     # select is timed with the graph features computed
        t = time.perf_counter()
        best = rank(call.compiled.plans, call.gi, call.symbols, cost_model)[0]
        sel.append(time.perf_counter() - t)
    row["select_ms"] = statistics.median(sel) * 1e3
    row["compile_ms"] = _ms(lambda: compile_plan(best.plan, best.impls), runs)
    row["chosen"] = best.plan.composition()

    firsts_g, firsts_d = [], []
    for _ in range(runs):
        m, fg = copy.deepcopy(layer), fresh_graph(g)
        t = time.perf_counter()
        optimize(m, fg, x, cost_model=cost_model)
        firsts_g.append(time.perf_counter() - t)
        d, fg = copy.deepcopy(layer), fresh_graph(g)
        with torch.no_grad():
            t = time.perf_counter()
            d(fg, x)
            firsts_d.append(time.perf_counter() - t)
    row["granii_first_ms"] = statistics.median(firsts_g) * 1e3
    row["dgl_first_ms"] = statistics.median(firsts_d) * 1e3
    with torch.no_grad():
        row["dgl_steady_ms"] = median_time(lambda: layer(g, x), warmup=1, repeat=5, budget=5) * 1e3
    return row


def sweep(cost_model, max_edges=1e7, runs=3, log=print):
    """Rows for every graph of ``graph_specs(max_edges)``."""
    rows = []
    for family, name, factory in graph_specs(max_edges):
        g = with_self_loops(factory())
        row = dict(family=family, graph=name, nodes=g.num_nodes(), edges=g.num_edges(),
                   cost_model=getattr(cost_model, "name", "?"))
        row.update(measure_graph(g, cost_model, runs))
        rows.append(row)
        log(f"  overhead {name:22s} E={row['edges']:>10,}  features {row['features_ms']:8.1f} ms  "
            f"select {row['select_ms']:7.2f} ms  first call {row['granii_first_ms']:8.1f} ms vs "
            f"DGL {row['dgl_first_ms']:8.1f} ms")
        del g
    return rows


__all__ = ["sweep", "measure_graph", "graph_specs"]
