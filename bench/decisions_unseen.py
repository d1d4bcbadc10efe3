"""granii's decisions on graphs the project never saw, against the fastest plan and fixed rules.

    python -m bench.decisions_unseen [--quick] [--out results/decisions_unseen]

The cost models were trained on the profiler's corpus (``generators.corpus``: R-MAT, uniform,
2-D grid, road-like, community SBM, sampled subgraphs and blocks of those, Mycielski graphs) and
validated on the real graphs of ``data/``; the benchmarks run those real graphs and generated
R-MAT, uniform, road and Mycielski graphs (``bench/graphs.py``). The graphs here come from other
families (``UNSEEN_FAMILIES``), seeded, at the corpus's sizes (2k-60k nodes):

* ``knn``       k nearest neighbours of uniform points in the unit square (in-degree exactly k,
                out-degree varies), ids in a spatial order (banded) or shuffled;
* ``rgg``       random geometric graph: points closer than ``r`` joined (Poisson degrees,
                shuffled ids: no locality);
* ``swgrid``    Kleinberg's small world: a 2-D lattice plus ``q`` long-range in-edges per node
                at Manhattan distance ``d`` with ``P(d) ~ 1/d`` (directed);
* ``price``     Price's citation model: each new node cites ``m`` earlier ones, chosen in
                proportion to in-degree + 1 (heavy-tailed in-degree, out-degree ``m``, hubs at
                low ids);
* ``chunglu``   directed Chung-Lu: independent power-law in- and out-degree weights;
* ``kron3``     stochastic Kronecker graph with a 3 x 3 initiator (R-MAT's is 2 x 2);
* ``dcsbm``     degree-corrected block model: log-normal node weights, most edges in a block;
* ``ws``        Watts-Strogatz ring lattice with rewired edges.

``unseen_report`` checks each against the shipped graphs and the benchmark's generated ones
(node and edge counts, degree histogram) and its family against the corpus's.

For each (graph, layer, mode, sizes) the layer (``bench.models``: GraphConv, GINConv, SAGEConv,
GATConv with 4 heads) is built with fixed weights and runs on fixed features (the first layer
of a model, as ``bench.measure``), inference or training (forward, backward, Adam step).
Timed side by side in one process (``side_by_side``: every candidate once per round, in turn,
each timed call right after an untimed one of the same candidate, as a training loop calls it:
run after another candidate, identical work took up to twice as long; at least five rounds, so
that two rounds slowed by other processes do not move a median):

* ``dgl``, ``dgl#2``      DGL's layer, twice (their ratio is the run's noise);
* ``granii``              a copy after ``granii(copy, g, x)`` and calls until its measured
                          tie-break settled (``bench.decisions.Settling``, at most
                          ``SETTLE_CALLS``);
* ``granii-model``        a copy after ``granii(copy, g, x, tune=False)``: the cost model alone;
* every promoted plan run directly (``bench.measure.plan_candidates``) with the implementations
  selection picks for it, with the other implementation of each step that has one, and with
  those either granii copy settled on; inside granii's allocator scope, as the dispatcher runs
  a plan (DGL's layer runs as users run it, outside).

Regret of a rule = time of the candidate it picks / time of the fastest candidate (every plan
timed and DGL's layer). Rules: ``granii + tie-break`` (the plan or the original forward the
``granii`` copy settled on), ``granii, model only`` (the ``granii-model`` copy's plan), and fixed
rules fitted without the scored graph (leave one graph out): one plan per (layer, mode) and one
per (layer, mode, sizes), the lowest geometric-mean regret on the other graphs; and DGL's layer.
``granii (dispatcher)`` is the ``granii`` copy's own time over the fastest (its choice plus the
dispatcher's per-call work).

For the diagnosis each row records the tie-break's candidates (what it timed, what it dropped,
its medians), the cost model's prediction of each ranked plan, and whether the fastest plan was
among those the tie-break timed.

Besides granii's default cost model, the picks of the shipped models rescaled by a calibration
measured inside the run, unscaled, and rescaled by a calibration this machine cached while other
processes held the cores are scored on the same timings (``alternative_models``), and
``emulate`` replays other tie-break settings on the recorded rounds.

Writes ``times.csv`` (one row per candidate), ``regret.csv`` (one row per configuration) and
``report.md``. ``--quick``: three small graphs, two layers, two size pairs (a few minutes); the
full run (nine graphs, four layers, three size pairs, both modes: 216 configurations) took
15-17 minutes on a quiet 2-core machine. Run measurements under
``flock -x /tmp/granii-cpu.lock``. ``--calibrations`` only ranks (no timing): which picks a
contended calibration changes (``calibration_decisions.md``).
"""
import argparse
import copy
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    from granii.profiling import generators as gen
    from granii.profiling.timing import side_by_side
except ImportError:                     # the profiler before it moved into the package
    from profiler import generators as gen
    from profiler.timing import side_by_side

from bench import models as bench_models  # noqa: E402
from bench.csvfile import write_csv  # noqa: E402
from bench.decisions import Settling  # noqa: E402
from bench.graphs import generated as bench_generated, with_self_loops  # noqa: E402
from bench.load import OthersMeter  # noqa: E402
from bench.measure import Runner, plan_candidates, plan_key  # noqa: E402
from granii.select import EXPECTED_CALLS  # noqa: E402

SETTLE_CALLS = 40
# (margin, most plans) of ``select.trial_candidates`` whose candidate sets each row records, so
# other tie-break settings can be scored on the same timings (``emulate``)
TRIAL_SETS = ((1.3, 2), (1.5, 3), (2.0, 4))
DGL = "dgl-layer"
LAYERS = ("gcn", "gin", "sage", "gat4")
SIZES = ((32, 256), (256, 32), (64, 64))
QUICK_SIZES = ((32, 256), (256, 32))
QUICK_LAYERS = ("gcn", "sage")
MODES = ("inference", "training")


# -- graphs of families the corpus does not have --------------------------------------------------
def _points(n, rng, spatial):
    """``n`` uniform points of the unit square; ``spatial``: ids in row-major order of cells of
    about 4 points (neighbours get near ids), else in random order."""
    pts = rng.random((n, 2))
    if spatial:
        side = max(1, int(math.sqrt(n / 4)))
        cell = np.minimum((pts * side).astype(np.int64), side - 1)
        order = np.lexsort((pts[:, 0], cell[:, 0], cell[:, 1]))
        pts = pts[order]
    return pts


def knn(n, k, seed=0, spatial=True):
    """Each node receives an edge from each of its ``k`` nearest other points (directed)."""
    from scipy.spatial import cKDTree
    rng = np.random.default_rng(seed)
    pts = _points(n, rng, spatial)
    _, nbr = cKDTree(pts).query(pts, k + 1)
    v = np.repeat(np.arange(n, dtype=np.int64), k)
    u = nbr[:, 1:].reshape(-1).astype(np.int64)
    return gen.make_graph(u, v, n, undirected=False)


def rgg(n, degree, seed=0, spatial=False):
    """Random geometric graph: points closer than ``r = sqrt(degree / (pi n))`` joined, so the
    expected degree is ``degree`` (less at the border); undirected."""
    from scipy.spatial import cKDTree
    rng = np.random.default_rng(seed)
    pts = _points(n, rng, spatial)
    pairs = cKDTree(pts).query_pairs(math.sqrt(degree / (math.pi * n)), output_type="ndarray")
    return gen.make_graph(pairs[:, 0], pairs[:, 1], n, undirected=True)


def swgrid(rows, cols, q=1, seed=0):
    """Kleinberg's small world: the undirected 4-neighbour lattice plus, into each node, ``q``
    edges from nodes at Manhattan distance ``d`` drawn with ``P(d) ~ 1/d`` (``d >= 2``), in a
    uniformly drawn direction, wrapping around the border."""
    rng = np.random.default_rng(seed)
    lattice = gen.grid2d(rows, cols)
    u0, v0 = (t.numpy() for t in lattice.edges())
    n = rows * cols
    v = np.repeat(np.arange(n, dtype=np.int64), q)
    dmax = rows + cols
    d = np.floor(np.exp(rng.random(len(v)) * math.log(dmax / 2)) * 2).astype(np.int64)
    dx = rng.integers(-d, d + 1)
    dy = (d - np.abs(dx)) * rng.choice([-1, 1], len(v))
    r = (v // cols + dy) % rows
    c = (v % cols + dx) % cols
    u = r * cols + c
    return gen.make_graph(np.concatenate([u0, u]), np.concatenate([v0, v]), n)


def price(n, m, seed=0, a=1.0):
    """Price's model: node ``t`` (``t >= m``) sends edges to ``m`` earlier nodes, each chosen in
    proportion to its in-degree + ``a``: with probability ``m / (m + a)`` the target of a
    uniformly drawn earlier edge, else a uniformly drawn earlier node (duplicates dropped)."""
    import random
    rnd = random.Random(seed)
    targets, us = [], []
    copy_p = m / (m + a)
    for t in range(m, n):
        for _ in range(m):
            if targets and rnd.random() < copy_p:
                targets.append(targets[rnd.randrange(len(targets))])
            else:
                targets.append(rnd.randrange(t))
            us.append(t)
    return gen.make_graph(np.array(us), np.array(targets), n)


def chunglu(n, degree, gamma_in=2.2, gamma_out=2.8, seed=0):
    """Directed Chung-Lu: ``n degree`` edges, each source drawn in proportion to a power-law
    out-weight ``w_i ~ (i + 1)^(-1 / (gamma_out - 1))`` and each destination to an in-weight of
    exponent ``gamma_in``, over two independent random orders of the nodes."""
    rng = np.random.default_rng(seed)
    e = int(n * degree)

    def weights(gamma):
        w = (np.arange(n) + 1.0) ** (-1.0 / (gamma - 1.0))
        return (w / w.sum())[rng.permutation(n)]
    u = rng.choice(n, e, p=weights(gamma_out))
    v = rng.choice(n, e, p=weights(gamma_in))
    return gen.make_graph(u, v, n)


KRON3 = ((0.45, 0.15, 0.05), (0.15, 0.10, 0.03), (0.05, 0.02, 0.00))


def kron3(scale, edge_factor, seed=0, initiator=KRON3):
    """Stochastic Kronecker graph on ``3**scale`` nodes: each of ``edge_factor n`` edges picks a
    cell of the 3 x 3 initiator (normalised) at every level; undirected, ids permuted."""
    p = np.asarray(initiator, dtype=np.float64).reshape(-1)
    p = p / p.sum()
    n = 3 ** scale
    m = int(edge_factor * n)
    rng = np.random.default_rng(seed)
    u = np.zeros(m, dtype=np.int64)
    v = np.zeros(m, dtype=np.int64)
    for _ in range(scale):
        cell = rng.choice(9, m, p=p)
        u = u * 3 + cell // 3
        v = v * 3 + cell % 3
    perm = rng.permutation(n)
    return gen.make_graph(perm[u], perm[v], n, undirected=True)


def dcsbm(n, blocks, degree, mix=0.85, sigma=1.0, seed=0):
    """Degree-corrected block model: node weights ``theta ~ LogNormal(0, sigma)``, blocks of
    Dirichlet(2) sizes (ids by block); ``n degree / 2`` undirected edges, each from a node drawn
    in proportion to ``theta``, to a node drawn likewise within its block (probability ``mix``)
    or among all nodes."""
    rng = np.random.default_rng(seed)
    sizes = np.maximum(2, (rng.dirichlet(np.full(blocks, 2.0)) * n).astype(np.int64))
    sizes[-1] = max(2, n - sizes[:-1].sum())
    n = int(sizes.sum())
    block = np.repeat(np.arange(blocks), sizes)
    theta = rng.lognormal(0.0, sigma, n)
    cum = np.cumsum(theta)
    lo = np.concatenate([[0.0], cum])[np.cumsum(sizes) - sizes]
    hi = cum[np.cumsum(sizes) - 1]
    e = int(n * degree / 2)
    u = np.minimum(np.searchsorted(cum, rng.random(e) * cum[-1]), n - 1)
    inside = rng.random(e) < mix
    b = block[u]
    x = np.where(inside, lo[b] + rng.random(e) * (hi[b] - lo[b]), rng.random(e) * cum[-1])
    v = np.minimum(np.searchsorted(cum, x), n - 1)
    return gen.make_graph(u, v, n, undirected=True)


def ws(n, k, p, seed=0):
    """Watts-Strogatz: each node joined to its ``k / 2`` next nodes on a ring, each such edge's
    far end moved to a uniformly drawn node with probability ``p``; undirected."""
    rng = np.random.default_rng(seed)
    u = np.repeat(np.arange(n, dtype=np.int64), k // 2)
    v = (u + np.tile(np.arange(1, k // 2 + 1), n)) % n
    move = rng.random(len(v)) < p
    v[move] = rng.integers(0, n, int(move.sum()))
    return gen.make_graph(u, v, n, undirected=True)


UNSEEN_FAMILIES = {"knn": knn, "rgg": rgg, "swgrid": swgrid, "price": price, "chunglu": chunglu,
                   "kron3": kron3, "dcsbm": dcsbm, "ws": ws}


@dataclass
class Spec:
    name: str
    family: str
    factory: object


def unseen_graphs(quick=False):
    """The study's graphs, small to large (``quick``: three of them)."""
    specs = [
        Spec("knn-2.5k", "knn", partial(knn, 2500, 6, seed=11)),
        Spec("ws-4k", "ws", partial(ws, 4000, 10, 0.1, seed=12)),
        Spec("price-12k", "price", partial(price, 12000, 4, seed=13)),
        Spec("rgg-12k", "rgg", partial(rgg, 12000, 14, seed=14)),
        Spec("dcsbm-15k", "dcsbm", partial(dcsbm, 15000, 40, 12, seed=15)),
        Spec("kron3-s9", "kron3", partial(kron3, 9, 5, seed=16)),
        Spec("knn-20k", "knn", partial(knn, 20000, 10, seed=17, spatial=False)),
        Spec("swgrid-25k", "swgrid", partial(swgrid, 160, 160, 2, seed=18)),
        Spec("chunglu-30k", "chunglu", partial(chunglu, 30000, 8, seed=19)),
    ]
    return [s for s in specs if s.name in ("knn-2.5k", "ws-4k", "price-12k")] if quick else specs


def _signature(g):
    """``(nodes, edges, in-degree histogram)`` of a graph."""
    deg = g.in_degrees().numpy()
    return g.num_nodes(), g.num_edges(), tuple(np.bincount(deg).tolist())


def known_graphs(with_real=True):
    """``{name: signature}`` of the shipped graphs (with and without a self-loop on every node)
    and the benchmark's generated ones (named only: 100k nodes and more, never this size)."""
    from granii.datasets import GRAPHS, load_graph
    known = {}
    if with_real:
        for name in GRAPHS:
            g = load_graph(name)
            known[name] = _signature(g)
            known[name + " +loops"] = _signature(with_self_loops(g))
    known.update({s.name: (None, None, None) for s in bench_generated()})
    return known


def unseen_report(specs, graphs, known):
    """Lines saying each graph is none of the ``known`` ones (same node and edge counts, or the
    same in-degree histogram) and its family none of the corpus's: ``(lines, clashes)``."""
    clashes = []
    for s, g in zip(specs, graphs):
        sig = _signature(g)
        for name, other in known.items():
            if other[:2] == sig[:2] or other[2] == sig[2]:
                clashes.append((s.name, name))
    families = {s.family for s in specs}
    lines = [f"- corpus families (`generators.FAMILIES`): {', '.join(sorted(gen.FAMILIES))}; "
             f"families here: {', '.join(sorted(families))}; shared: "
             f"{', '.join(sorted(set(gen.FAMILIES) & families)) or 'none'}",
             f"- compared with {len([k for k in known if not k.endswith('+loops')])} shipped "
             "and benchmark graphs (node and edge counts, in-degree histogram, with and without "
             f"self-loops): {len(clashes)} match" + (f" ({clashes})" if clashes else "")]
    return lines, clashes


def study_graph(spec, model):
    g = spec.factory()
    return with_self_loops(g) if bench_models.MODELS[model].self_loops else g


# -- one configuration ----------------------------------------------------------------------------
def _state(layer):
    from granii.runtime.dispatch import layer_states
    states = layer_states(layer)
    return states[0] if states else None


def _per_graph(state):
    return [d for per in list(state.decisions.values()) for d in list(per.values())]


def settle(runner, layer, most=SETTLE_CALLS):
    """Call until the layer's tie-break stopped moving (twice in a row) or ``most`` calls; the
    trials seen (``Trial`` objects) and the calls made."""
    from granii.runtime.tiebreak import Trial
    settled, trials, calls, quiet = Settling(layer), {}, 0, 0
    while calls < most:
        runner()
        calls += 1
        st = _state(layer)
        for d in _per_graph(st) if st else ():
            if isinstance(d, Trial):
                trials[id(d)] = d
        quiet = quiet + 1 if settled() else 0
        if quiet >= 2:
            break
    return list(trials.values()), calls


def kept(layer):
    """``(plan index or None for the original forward, impls, label)`` of what the layer ran on
    its last call, or None (not optimized)."""
    from granii.runtime.state import ORIGINAL
    st = _state(layer)
    if st is None or st.fallback or st.forward_run is None:
        return None
    _, label, fn, _ = st.forward_run
    if fn is None:
        return (None, None, ORIGINAL)
    for d in _per_graph(st):
        if isinstance(d, tuple) and len(d) > 3 and d[1] is fn:
            return (_index(d[0]), tuple(d[3]), label)
    for d in _per_graph(st):                         # a trial still open: its candidates
        for c in getattr(d, "candidates", []) + getattr(d, "dropped", []):
            if c[1] is fn:
                return (_index(c[0]), tuple(c[3]), label)
    return None


# implementations that run another one's code on the study's features: ``gemm/native`` reads
# only the nonzeros of a mostly-zero X and is torch's GEMM after a sample of X's rows otherwise
# (``kernels.sparse_rows``); the features here are normal draws and their aggregates, dense
SAME_CODE = {("gemm", "native"): "torch"}


def steady_work(plan, impls):
    """What a plan runs on every call once the work on the graph and on the fixed features is
    kept: ``(primitive, implementation, signature)`` of its every-call steps (``SAME_CODE``
    names an implementation by the code it runs). Candidates with the same steady work differ
    only in work done once, so their steady times differ by noise: measured side by side, six
    GCN plans that run one GEMM per call took 1.7-2.3 ms each on one graph, ordered by which
    candidate ran before them (what that left in the caches and the allocator), and all 2.2 ms
    in shuffled rounds with glibc's trimming off."""
    from granii.plan import EVERY
    return repr(tuple((s.prim, SAME_CODE.get((s.prim, i), i), s.sig)
                      for s, i in zip(plan.steps, impls) if s.when == EVERY and s.prim != "apply"))


# calibrations this machine cached while other processes held the cores (seconds): before
# ``calibration`` checked for contention, and after it checked the small call only
CONTENDED_CALIBRATION = {"gemm": 25.13e-3, "small": 23.99e-3, "sparse": 58.96e-3,
                         "stream": 30.32e-3}
CONTENDED_QUIET_SMALL = {"gemm": 29.30e-3, "small": 0.42e-3, "sparse": 92.18e-3,
                         "stream": 50.78e-3}


def alternative_models():
    """Cost models whose picks are scored on the same timings besides granii's default:
    ``calibrated here`` the shipped models rescaled by a calibration measured now, inside this
    run (under the CPU lock: a quiet machine), ``unscaled`` the shipped models as trained (no
    calibration) and ``contended calibration`` rescaled by ``CONTENDED_CALIBRATION``. ``({}, {})`` when this machine has models of its own; else
    ``(models, the calibration measured)``."""
    from granii import calibration, learned
    from granii.fingerprint import machine_fingerprint
    fp = machine_fingerprint()
    if (learned.models_dir() / learned.fingerprint_id(fp)).is_dir():
        return {}, {}
    times = calibration.measure()
    out = {}
    for label, here in (("calibrated here", {"times": times}), ("unscaled", {"times": {}}),
                        ("contended calibration", {"times": CONTENDED_CALIBRATION})):
        models = learned.foreign_models(learned.models_dir(), fp)
        if models:
            out[label] = learned.transferred(models, learned._Lazy(lambda here=here: here))
    return out, times


def _index(label):
    """The plan index of a decision's label ``[i]`` or ``[i] impl/..``."""
    return label.split(" ")[0][1:-1]


def _key(plans, index, impls):
    if index is None:
        return DGL
    plan = next(p for p in plans if str(p.index) == str(index))
    return f"{plan_key(plan)} | {','.join(impls)}"


def measure_config(spec, g, model, k_in, k_out, training, cost_model, repeat=5, budget=2.0,
                   seed=0, alternatives=None):
    """One configuration: ``(row, times)`` (see the module doc). ``row`` is None when granii did
    not optimize the layer."""
    from granii import granii as optimize
    torch.manual_seed(seed + 1)
    x = torch.randn(g.num_nodes(), k_in)
    layer = bench_models.build(model, k_in, k_out, seed)
    if training:
        layer.train()
    else:
        layer.eval()
    with torch.no_grad():
        out_shape = layer(g, x).shape
    torch.manual_seed(seed + 2)
    out_grad = torch.randn(out_shape)
    fns = {"dgl": Runner(lambda: layer(g, x), layer.parameters(), out_grad, training),
           "dgl#2": Runner(lambda: layer(g, x), layer.parameters(), out_grad, training)}

    tuned, untuned = copy.deepcopy(layer), copy.deepcopy(layer)
    t0 = time.perf_counter()
    optimize(tuned, g, x, cost_model=cost_model)
    run_tuned = Runner(lambda: tuned(g, x), tuned.parameters(), out_grad, training)
    trials, calls = settle(run_tuned, tuned)
    optimize(untuned, g, x, cost_model=cost_model, tune=False)
    run_untuned = Runner(lambda: untuned(g, x), untuned.parameters(), out_grad, training)
    for _ in range(2):
        run_untuned()
    decide_s = time.perf_counter() - t0
    k_tuned, k_model = kept(tuned), kept(untuned)
    if k_tuned is None or k_model is None:
        st = _state(tuned)
        return None, {"reason": getattr(st, "fallback", None) or "granii found no layer"}
    fns["granii"], fns["granii-model"] = run_tuned, run_untuned

    st = _state(tuned)
    plan_layer = copy.deepcopy(layer)
    plans = {}
    for chosen in (k_tuned, k_model):
        mark = None if chosen[0] is None else (SimpleNamespace(index=_plan_index(st, chosen[0])),
                                                chosen[1])
        for plan, impls, tag, _, fn in plan_candidates(plan_layer, g, x, training, cost_model,
                                                       st, mark, pooled=True):
            plans.setdefault(_key([plan], plan.index, impls), (plan, impls, tag, fn))
    for key, (plan, impls, tag, fn) in plans.items():
        fns[key] = Runner(fn, plan_layer.parameters(), out_grad, training)
    all_plans = [p for p, *_ in plans.values()]

    with OthersMeter() as others, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is in beta")
        res = side_by_side(fns, warmup=1, repeat=repeat, budget=budget, lead=1, least=5)
    t = {k: v[0] for k, v in res.items()}
    t_min = {k: min(v[1]) for k, v in res.items()}

    times = {DGL: min(t["dgl"], t["dgl#2"])}
    times.update({k: t[k] for k in plans})
    key_tuned = _key(all_plans, k_tuned[0], k_tuned[1])
    key_model = _key(all_plans, k_model[0], k_model[1])
    fastest = min(times, key=times.get)

    # the tie-break: what it timed, dropped, measured; the cost model's ranking
    trial_keys, trial_med = [], {}
    for tr in trials[-1:]:
        for c in tr.candidates + tr.dropped:
            k = DGL if c[1] is None else _key(all_plans, _index(c[0]), c[3])
            trial_keys.append(k)
        for label, med in tr.medians().items():
            c = next(c for c in tr.candidates + tr.dropped if c[0] == label)
            k = DGL if c[1] is None else _key(all_plans, _index(c[0]), c[3])
            trial_med[k] = med
    predicted, trial_sets = {}, {}
    if st.last is not None:
        from granii.select import trial_candidates
        for c in st.last[1]:
            predicted[_key(all_plans, c.plan.index, c.impls)] = c.cost
        for margin, most in TRIAL_SETS:
            trial_sets[f"{margin}/{most}"] = [_key(all_plans, c.plan.index, c.impls) for c in
                                              trial_candidates(st.last[1], margin, most)]
    samples = {k: v[1] for k, v in res.items()}
    samples[DGL] = samples["dgl"] + samples["dgl#2"]
    others_picks = {}
    if alternatives:
        from granii.runtime.bind import prepare
        from granii.select import rank, trial_candidates
        with torch.set_grad_enabled(training):
            call = prepare(st, plan_layer, (g, x), {})
        for label, alt in alternatives.items():
            ranking = rank(call.compiled.plans, call.gi, call.symbols, alt, call.training,
                           call.input_grad, EXPECTED_CALLS, call.input_repeats)
            others_picks[label] = {
                "pick": _key(all_plans, ranking[0].plan.index, ranking[0].impls),
                "1.3/2": [_key(all_plans, c.plan.index, c.impls)
                          for c in trial_candidates(ranking, 1.3, 2)]}
    row = dict(graph=spec.name, family=spec.family, nodes=g.num_nodes(), edges=g.num_edges(),
               model=model, k_in=k_in, k_out=k_out,
               mode="training" if training else "inference",
               candidates=len(times), fastest=fastest, fastest_ms=times[fastest] * 1e3,
               dgl_ms=times[DGL] * 1e3, noise=max(t["dgl"], t["dgl#2"]) / min(t["dgl"], t["dgl#2"]),
               granii_ms=t["granii"] * 1e3, granii_model_ms=t["granii-model"] * 1e3,
               tuned=key_tuned, model_pick=key_model,
               tuned_ms=times.get(key_tuned, float("nan")) * 1e3,
               model_ms=times.get(key_model, float("nan")) * 1e3,
               trial=" || ".join(trial_keys), fastest_in_trial=fastest in trial_keys,
               trial_ratio=_trial_ratio(trial_med, times),
               settle_calls=calls, decide_s=decide_s, others_cores=others.cores,
               trial_sets=json.dumps(trial_sets), alternatives=json.dumps(others_picks))
    detail = [dict(graph=spec.name, model=model, k_in=k_in, k_out=k_out, mode=row["mode"],
                   candidate=k, steady_ms=t[k] * 1e3 if k in t else times[k] * 1e3,
                   min_ms=(t_min[k] if k in t_min else min(t_min["dgl"], t_min["dgl#2"])) * 1e3,
                   predicted_ms=predicted.get(k, float("nan")) * 1e3,
                   trial_ms=trial_med.get(k, float("nan")) * 1e3,
                   tag=plans[k][2] if k in plans else "", in_trial=k in trial_keys,
                   steady=steady_work(*plans[k][:2]) if k in plans else DGL,
                   tuned=k == key_tuned, model_pick=k == key_model,
                   samples_ms=";".join(f"{x * 1e3:.4f}" for x in samples[k]))
              for k in times]
    detail += [dict(graph=spec.name, model=model, k_in=k_in, k_out=k_out, mode=row["mode"],
                    candidate=k, steady_ms=t[k] * 1e3, min_ms=t_min[k] * 1e3)
               for k in ("granii", "granii-model", "dgl", "dgl#2")]
    return row, detail


def _plan_index(state, label_index):
    """The index object of the plan whose label index is ``label_index`` (a str)."""
    for variants in state.compiled.values():
        for c in variants if isinstance(variants, list) else [variants]:
            for p in getattr(c, "plans", ()):
                if str(p.index) == label_index:
                    return p.index
    return label_index


def _trial_ratio(trial_med, times):
    """How the tie-break's medians ordered its candidates against the side-by-side times:
    ``(its pick's steady time / its fastest candidate's steady time)``."""
    timed = [k for k in trial_med if k in times]
    if len(timed) < 2:
        return float("nan")
    pick = min(timed, key=trial_med.get)
    return times[pick] / min(times[k] for k in timed)


# -- what the calibration changes (no timing) -----------------------------------------------------
def calibration_decisions(specs, graphs, calibrations, layers=LAYERS, sizes=SIZES, modes=MODES):
    """For each configuration, the plan the shipped (foreign) models rank first when rescaled by
    each of ``calibrations`` (``{label: reference times}``; ``{}``: unscaled). Ranks only: no
    timing, so it runs anywhere. Rows ``(graph, model, k_in, k_out, mode, {label: pick})``."""
    from granii import learned
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.fingerprint import machine_fingerprint
    from granii.select import rank, trial_candidates
    fp = machine_fingerprint()
    models = {}
    for label, times in calibrations.items():
        found = learned.foreign_models(learned.models_dir(), fp)
        models[label] = learned.transferred(found, learned._Lazy(lambda t=times: {"times": t}))
    rows = []
    for spec, base in zip(specs, graphs):
        for model in layers:
            g = with_self_loops(base) if bench_models.MODELS[model].self_loops else base
            for (k_in, k_out) in sizes:
                for mode in modes:
                    training = mode == "training"
                    x = torch.randn(g.num_nodes(), k_in)
                    layer = bench_models.build(model, k_in, k_out).train(training)
                    st = new_state(layer)
                    with torch.set_grad_enabled(training):
                        prepare(st, layer, (g, x), {})
                        call = prepare(st, layer, (g, x), {})      # the features came back
                    picks = {}
                    for label, m in models.items():
                        ranking = rank(call.compiled.plans, call.gi, call.symbols, m,
                                       call.training, call.input_grad, EXPECTED_CALLS,
                                       call.input_repeats)
                        name = lambda c: f"{c.plan.composition()} [{','.join(c.impls)}]"
                        picks[label] = name(ranking[0])
                        picks[f"{label}: tie-break"] = " || ".join(
                            name(c) for c in trial_candidates(ranking))
                    rows.append(dict(graph=spec.name, model=model, k_in=k_in, k_out=k_out,
                                     mode=mode, **picks))
    return rows


def calibration_lines(rows, labels):
    """Per (layer, mode): configurations whose pick under each calibration differs from the
    first's."""
    first = labels[0]
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["mode"]), []).append(r)
    lines = ["| layer | mode | n | " + " | ".join(
        f"pick differs: {lb} | {first}'s pick outside {lb}'s tie-break | {lb}'s pick outside "
        f"{first}'s tie-break" for lb in labels[1:]) + " |",
        "|---|---|---:|" + "---:|---:|---:|" * (len(labels) - 1)]
    for key, rs in sorted(groups.items()) + [(("**all**", ""), rows)]:
        cells = []
        for lb in labels[1:]:
            cells += [sum(r[lb] != r[first] for r in rs),
                      sum(r[first] not in r[f"{lb}: tie-break"].split(" || ") for r in rs),
                      sum(r[lb] not in r[f"{first}: tie-break"].split(" || ") for r in rs)]
        lines.append(f"| {key[0]} | {key[1]} | {len(rs)} | " + " | ".join(map(str, cells)) + " |")
    return lines


# -- the cost model's error per primitive on these graphs -----------------------------------------
PRIM_KS = (32, 256)
PRIMS = ("spmm", "spmm_norm", "spmm_weighted", "spmm_mean", "gat_aggregate")


def primitive_rows(specs, graphs, cost_model, ks=PRIM_KS, phases=("forward", "train")):
    """Per graph, primitive, implementation, width and phase: measured seconds (implementations
    side by side, median of the rounds) and the cost model's prediction (``select._predict``, as
    selection prices a step). GEMM on ``(N, k_in, k_out)`` for the study's size pairs."""
    from granii.graph import GraphInfo
    from granii.profiling import points as pts
    from granii.select import _predict
    out = []
    prims = dict(pts.registered(list(PRIMS) + ["gemm"]))
    for spec, g in zip(specs, graphs):
        gi = GraphInfo(with_self_loops(g))
        cells = [(p, {"k": k}) for p in PRIMS if p in prims and p != "gat_aggregate"
                 for k in ks]
        cells += [("gat_aggregate", {"heads": 4, "k": k}) for k in ks if "gat_aggregate" in prims]
        cells += [("gemm", {"m": gi.num_dst, "k": a, "n": b}) for a, b in SIZES]
        for prim, sizes in cells:
            graph = None if prim == "gemm" else gi
            for phase in phases:
                if phase == "train" and not pts.has_phase(prim, phase):
                    continue
                fns = pts.runners(prim, graph, sizes, prims[prim], phase)
                with torch.no_grad() if phase == "forward" else torch.enable_grad():
                    res = side_by_side(fns, warmup=1, repeat=5, budget=0.5)
                dims = dict(sizes, n=gi.num_dst) if prim != "gemm" else dict(sizes)
                if prim == "gat_aggregate":
                    dims = dict(sizes)
                for impl, (med, _) in res.items():
                    pred = _predict(cost_model, prim, impl, gi, dims, sizes.get("heads", 1),
                                    phase)
                    out.append(dict(graph=spec.name, prim=prim, impl=impl, phase=phase,
                                    sizes=",".join(f"{k}={v}" for k, v in sizes.items()),
                                    measured_ms=med * 1e3,
                                    predicted_ms=pred * 1e3 if pred else float("nan")))
    return out


def primitive_lines(prows):
    """Per (primitive, implementation, phase): geomean and range of measured / predicted, and
    how often the predicted fastest implementation of a cell was the fastest measured."""
    groups, cells = {}, {}
    for r in prows:
        if r["predicted_ms"] == r["predicted_ms"]:
            groups.setdefault((r["prim"], r["impl"], r["phase"]), []).append(
                r["measured_ms"] / r["predicted_ms"])
        cells.setdefault((r["graph"], r["prim"], r["phase"], r["sizes"]), []).append(r)
    right = {}
    for (graph, prim, phase, _), rs in cells.items():
        rs = [r for r in rs if r["predicted_ms"] == r["predicted_ms"]]
        if len(rs) > 1:
            pick = min(rs, key=lambda r: r["predicted_ms"])
            best = min(r["measured_ms"] for r in rs)
            right.setdefault((prim, phase), []).append(pick["measured_ms"] / best)
    lines = ["| primitive | impl | phase | n | measured / predicted, geomean | min | max |",
             "|---|---|---|---:|---:|---:|---:|"]
    for (prim, impl, phase), v in sorted(groups.items()):
        lines.append(f"| {prim} | {impl} | {phase} | {len(v)} | {geomean(v):.2f} | {min(v):.2f} "
                     f"| {max(v):.2f} |")
    lines += ["", "| primitive | phase | cells | predicted fastest implementation was the fastest "
              "| its time / fastest, geomean / worst |", "|---|---|---:|---:|---:|"]
    for (prim, phase), v in sorted(right.items()):
        lines.append(f"| {prim} | {phase} | {len(v)} | {sum(x == 1.0 for x in v)}/{len(v)} | "
                     f"{geomean(v):.3f} / {max(v):.2f} |")
    return lines


# -- scoring --------------------------------------------------------------------------------------
RULES = ("granii + tie-break", "granii, model only", "granii (dispatcher)", "fixed per layer",
         "fixed per sizes", "DGL layer")


def geomean(xs):
    xs = [x for x in xs if x == x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def fit(rows):
    """The candidate key (not DGL's layer) with the lowest geometric-mean regret over ``rows``
    (each with ``t``: ``{key: seconds}``); a key not timed on a row counts as its slowest."""
    if not rows:
        return None
    keys = sorted(set().union(*(r["t"] for r in rows)) - {DGL})
    return min(keys, key=lambda k: geomean([_time(r, k) / min(r["t"].values()) for r in rows]))


def _time(row, key):
    return row["t"].get(key, max(row["t"].values()))


def score(rows, details):
    """Each configuration's regret under every rule (``RULES``). Candidates of one configuration
    with the same steady work (``steady_work``) are one candidate measured several times: each
    gets the median of all their rounds together (else the fastest would be the luckiest copy,
    and a mean would be the unluckiest copy's: one copy slowed 4x by the machine moved a mean
    of eight copies by 1.7x); without recorded rounds, the median of their times."""
    by, work, rounds = {}, {}, {}
    for d in details:
        if d.get("predicted_ms", None) is not None and d["candidate"] not in (
                "granii", "granii-model", "dgl", "dgl#2"):
            cfg = (d["graph"], d["model"], d["k_in"], d["k_out"], d["mode"])
            by.setdefault(cfg, {})[d["candidate"]] = d["steady_ms"]
            work.setdefault(cfg, {}).setdefault(d.get("steady") or d["candidate"], []).append(
                d["candidate"])
            rounds[cfg, d["candidate"]] = ([float(v) for v in d["samples_ms"].split(";")]
                                           if d.get("samples_ms") else [d["steady_ms"]])
    for cfg, groups in work.items():
        t = by[cfg]
        for keys in (k for k in groups.values() if len(k) > 1):
            pooled = statistics.median(v for k in keys for v in rounds[cfg, k])
            t.update({k: pooled for k in keys})
    for r in rows:
        r["t"] = by[(r["graph"], r["model"], r["k_in"], r["k_out"], r["mode"])]
    out = []
    for r in rows:
        others = [o for o in rows if o["graph"] != r["graph"] and o["model"] == r["model"]
                  and o["mode"] == r["mode"]]
        same = [o for o in others if (o["k_in"], o["k_out"]) == (r["k_in"], r["k_out"])]
        best = min(r["t"].values())
        per_layer, per_sizes = fit(others), fit(same)
        rec = {k: r[k] for k in ("graph", "family", "nodes", "edges", "model", "k_in", "k_out",
                                 "mode", "fastest", "tuned", "model_pick", "fastest_in_trial",
                                 "trial_ratio", "noise", "settle_calls", "others_cores")}
        rec.update({
            "granii + tie-break": _time(r, r["tuned"]) / best,
            "granii, model only": _time(r, r["model_pick"]) / best,
            "granii (dispatcher)": r["granii_ms"] / best,
            "fixed per layer": _time(r, per_layer) / best if per_layer else float("nan"),
            "fixed per sizes": _time(r, per_sizes) / best if per_sizes else float("nan"),
            "DGL layer": r["t"][DGL] / best,
            "fixed_per_layer_pick": per_layer, "fixed_per_sizes_pick": per_sizes,
            "fastest": min(r["t"], key=r["t"].get), "fastest_ms": best,
            "fastest_in_trial": any(r["t"].get(k) == best for k in r["trial"].split(" || "))})
        for label, alt in json.loads(r.get("alternatives") or "{}").items():
            rec[f"model only, {label}"] = _time(r, alt["pick"]) / best
        out.append(rec)
    return out


EMULATED = (("1.3/2", "median", 3), ("1.3/2", "min", 3), ("1.5/3", "median", 3),
            ("1.5/3", "min", 3), ("2.0/4", "min", 3),
            ("calibrated here: 1.3/2", "median", 3), ("unscaled: 1.3/2", "median", 3),
            ("contended calibration: 1.3/2", "median", 3))


def emulate(rows, details, sets=EMULATED, margin=0.05):
    """``{(set, statistic, calls): [regret per configuration]}``: the tie-break replayed on the
    study's own rounds: the candidates ``select.trial_candidates`` gives with that (margin, most
    plans) and DGL's layer, each judged by the statistic of its first ``calls`` rounds. As
    ``Trial.winner`` does, a plan replaces the set's first (the model's pick) only when
    ``margin`` faster and its statistic below the first's fastest round, and it is kept over
    DGL's layer only when ``margin`` faster. Regret against the fastest candidate (copies of
    one steady work merged, ``score``). The rounds it judges by are among those the steady
    times are the median of, so it flatters every setting alike."""
    samples = {}
    for d in details:
        if d.get("samples_ms"):
            cfg = (d["graph"], d["model"], d["k_in"], d["k_out"], d["mode"])
            samples.setdefault(cfg, {})[d["candidate"]] = [float(x) for x in
                                                           d["samples_ms"].split(";")]
    stat = {"median": lambda v: sorted(v)[len(v) // 2], "min": min}
    out = {}
    for r in rows:
        cfg = (r["graph"], r["model"], r["k_in"], r["k_out"], r["mode"])
        sets_here = json.loads(r["trial_sets"])
        for label, alt in json.loads(r.get("alternatives") or "{}").items():
            sets_here[f"{label}: 1.3/2"] = alt["1.3/2"]
        for name, how, calls in sets:
            if name not in sets_here:
                continue
            plans = [k for k in sets_here.get(name, []) if k in samples[cfg]]
            rounds = {k: samples[cfg][k][:calls] for k in plans + [DGL]}
            judged = {k: stat[how](v) for k, v in rounds.items()}
            pick = min(judged, key=judged.get)
            first = plans[0] if plans else None
            if pick not in (first, DGL) and (judged[pick] > (1 - margin) * judged[first]
                                             or judged[pick] >= min(rounds[first])):
                pick = first
            if judged[pick] > (1 - margin) * judged[DGL]:
                pick = DGL
            out.setdefault((name, how, calls), []).append(
                (r["model"], r["mode"], _time(r, pick) / min(r["t"].values())))
    return out


def emulate_lines(emulated):
    groups = sorted({(m, mode) for v in emulated.values() for m, mode, _ in v})
    lines = ["| candidates (margin / most plans) | judged by | " +
             " | ".join(f"{m} {mode}" for m, mode in groups) + " | all |",
             "|---|---|" + "---:|" * (len(groups) + 1)]
    for (name, how, calls), v in emulated.items():
        cells = [v2 for v2 in (geomean([x for m, mode, x in v if (m, mode) == g]) for g in groups)]
        worst = [max(x for m, mode, x in v if (m, mode) == g) for g in groups]
        lines.append(f"| {name} | {how} of {calls} | " + " | ".join(
            f"{c:.3f} / {w:.2f}" for c, w in zip(cells, worst)) +
            f" | {geomean([x for *_, x in v]):.3f} / {max(x for *_, x in v):.2f} |")
    return lines


def _short(key):
    """A candidate key without its association trees: ``composition | impls``."""
    if key == DGL or not key:
        return key or ""
    parts = key.split(" | ")
    return f"{parts[0]} [{parts[-1]}]"


def summary_lines(recs):
    rules = RULES + tuple(sorted({k for e in recs for k in e if k.startswith("model only, ")}))
    groups = {}
    for e in recs:
        groups.setdefault((e["model"], e["mode"]), []).append(e)
    lines = ["| layer | mode | n | " + " | ".join(f"{r} geomean / worst" for r in rules)
             + " | best fixed rule | tie-break / best fixed | fastest in tie-break |",
             "|---|---|---:|" + "---:|" * len(rules) + "---|---:|---:|"]
    for (model, mode), es in sorted(groups.items()) + [(("**all**", ""), recs)]:
        cells = []
        for rule in rules:
            v = [e[rule] for e in es if e.get(rule, math.nan) == e.get(rule, math.nan)]
            cells.append(f"{geomean(v):.3f} / {max(v):.2f}" if v else "-")
        fixed = {r: geomean([e[r] for e in es]) for r in RULES[3:]}
        best_fixed = min(fixed, key=fixed.get)
        ratio = geomean([e["granii + tie-break"] for e in es]) / fixed[best_fixed]
        lines.append(f"| {model} | {mode} | {len(es)} | " + " | ".join(cells) +
                     f" | {best_fixed} | {ratio:.3f} | "
                     f"{sum(bool(e['fastest_in_trial']) for e in es)}/{len(es)} |")
    return lines


def worst_lines(recs, n=12):
    lines = ["| graph | layer | sizes | mode | granii + tie-break | model only | fixed per sizes | "
             "granii kept | fastest | fastest in tie-break |",
             "|---|---|---|---|---:|---:|---:|---|---|---|"]
    for e in sorted(recs, key=lambda e: -e["granii + tie-break"])[:n]:
        lines.append(f"| {e['graph']} | {e['model']} | {e['k_in']}→{e['k_out']} | {e['mode']} | "
                     f"{e['granii + tie-break']:.2f} | {e['granii, model only']:.2f} | "
                     f"{e['fixed per sizes']:.2f} | {_short(e['tuned'])} | {_short(e['fastest'])}"
                     f" | {'yes' if e['fastest_in_trial'] else 'no'} |")
    return lines


def write_report(out, recs, rows, details, notes, extra=()):
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "regret.csv", recs)
    write_csv(out / "times.csv", details)
    noise = sorted(r["noise"] for r in rows)
    lines = ["# granii's decisions on graphs it never saw", "",
             *notes, "",
             "Regret = time of the rule's pick / time of the fastest of every promoted plan (each "
             "with the implementations selection picks, the other implementation of each step "
             "that has one, and those granii kept) and DGL's layer, timed side by side on fixed "
             "features (steady state, median of the rounds). Candidates whose every-call work "
             "is the same (they differ in work kept between calls: on the graph, or on the fixed "
             "features) count as one, timed as the mean of their copies. Fixed rules are fitted "
             "on the other "
             "graphs (leave one graph out). `granii (dispatcher)` is the granii copy's own "
             "time, dispatcher included. DGL's layer was timed twice per configuration: the "
             f"two differed by up to {noise[int(0.9 * (len(noise) - 1))]:.2f}x in 90% of "
             f"configurations (median {noise[len(noise) // 2]:.2f}x): the run's noise.", "",
             *summary_lines(recs), "", "### Worst configurations of granii + tie-break", "",
             *worst_lines(recs), "", "### Tie-break settings replayed on these timings", "",
             "`emulate`: each setting's candidates and DGL's layer judged on the study's own "
             "rounds (geomean / worst regret). The first row is granii's setting.", "",
             *emulate_lines(emulate(rows, details)), *extra, ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return lines


# -- main -----------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three small graphs, GCN and SAGE, "
                    "32->256 and 256->32 (a few minutes)")
    ap.add_argument("--graphs", nargs="+", help="names of unseen_graphs() to run")
    ap.add_argument("--layers", nargs="+", choices=list(bench_models.MODELS))
    ap.add_argument("--sizes", nargs="+", help="k_in,k_out pairs")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of rounds per config")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-alternatives", dest="alternatives", action="store_false",
                    help="score granii's default cost model only")
    ap.add_argument("--calibrations", action="store_true",
                    help="only rank (no timing): the shipped models picks under contended "
                    "cached calibration and unscaled (calibration_decisions.csv/.md)")
    ap.add_argument("--primitives", action="store_true",
                    help="also time each graph primitive and GEMM against the cost model")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "decisions_unseen")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from granii.learned import default_cost_model
    cost_model = default_cost_model()
    specs = unseen_graphs(args.quick)
    if args.graphs:
        specs = [s for s in unseen_graphs() if s.name in args.graphs]
    layers = args.layers or (QUICK_LAYERS if args.quick else LAYERS)
    sizes = ([tuple(int(v) for v in s.split(",")) for s in args.sizes] if args.sizes
             else QUICK_SIZES if args.quick else SIZES)
    t_start = time.perf_counter()
    if args.calibrations:
        return calibrations_main(args, specs, layers, sizes)
    alternatives, here_times = alternative_models() if args.alternatives else ({}, {})
    graphs = [s.factory() for s in specs]
    check, clashes = unseen_report(specs, graphs, known_graphs())
    print("\n".join(check), flush=True)
    rows, details, skipped = [], [], []
    for spec, base in zip(specs, graphs):
        for model in layers:
            g = with_self_loops(base) if bench_models.MODELS[model].self_loops else base
            for (k_in, k_out) in sizes:
                for mode in args.modes:
                    t0 = time.perf_counter()
                    row, detail = measure_config(spec, g, model, k_in, k_out,
                                                 mode == "training", cost_model,
                                                 repeat=args.repeat, budget=args.budget,
                                                 alternatives=alternatives)
                    if row is None:
                        skipped.append((spec.name, model, k_in, k_out, mode, detail["reason"]))
                        continue
                    rows.append(row)
                    details += detail
                    best = row["fastest_ms"]
                    print(f"{spec.name:12s} {model:5s} {k_in:4d}->{k_out:<4d} {mode:9s} "
                          f"tuned {row['tuned_ms'] / best:.2f} model {row['model_ms'] / best:.2f}"
                          f" dgl {row['dgl_ms'] / best:.2f}  ({time.perf_counter() - t0:.1f} s)",
                          flush=True)
    recs = score(rows, details)
    notes = [f"Generated by `python -m bench.decisions_unseen{' --quick' if args.quick else ''}` "
             f"in {(time.perf_counter() - t_start) / 60:.1f} min, {args.threads} threads, cost "
             f"model: {getattr(cost_model, 'name', type(cost_model).__name__)}; "
             f"{len(recs)} configurations on {len(specs)} graphs: "
             + ", ".join(f"{s.name} ({g.num_nodes()} nodes, {g.num_edges()} edges)"
                         for s, g in zip(specs, graphs)) + ".", "", *check]
    if alternatives:
        cal = getattr(cost_model, "transfer", None)
        notes += ["", "Calibrations (reference seconds, `granii.calibration`): the one granii "
                  "used (cached on this machine): " + (", ".join(
                      f"{k} {v * 1e3:.2f} ms" for k, v in cal.here_times.items()) if cal else
                      "none") + "; measured inside this run: " + ", ".join(
                      f"{k} {v * 1e3:.2f} ms" for k, v in here_times.items()) +
                  "; the models' own machine: " + (", ".join(
                      f"{k} {v * 1e3:.2f} ms" for k, v in cal.model_times.items()) if cal
                      else "-") + ". `model only, <model>`: the plan that model ranks first, "
                  "scored on the same timings."]
    if skipped:
        notes += ["", f"Not optimized: {skipped}"]
    extra = []
    args.out.mkdir(parents=True, exist_ok=True)
    if args.primitives:
        prows = primitive_rows(specs, graphs, cost_model)
        write_csv(args.out / "primitives.csv", prows)
        extra = ["", "### The cost model per primitive on these graphs", "",
                 "Each primitive timed alone (implementations side by side, median of 5 rounds) "
                 "on each graph (with a self-loop on every node) at k = "
                 + ", ".join(map(str, PRIM_KS)) + "; GEMM at (N, k_in, k_out) for the study's "
                 "size pairs (`primitives.csv`).", "", *primitive_lines(prows)]
    lines = write_report(args.out, recs, rows, details, notes, extra)
    print("\n".join(lines), flush=True)
    return 0


def calibrations_main(args, specs, layers, sizes):
    """``--calibrations``: the picks under the two calibrations this machine cached while
    other processes held the cores against the unscaled models (what granii uses now when the
    machine is busy while it calibrates)."""
    cals = {"unscaled": {}, "contended": CONTENDED_CALIBRATION,
            "contended, small call quiet": CONTENDED_QUIET_SMALL}
    graphs = [s.factory() for s in specs]
    rows = calibration_decisions(specs, graphs, cals, layers, sizes)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "calibration_decisions.csv", rows)
    lines = ["# Plan picks under a calibration measured under load", "",
             f"Generated by `python -m bench.decisions_unseen --calibrations` (ranking only, no "
             f"timing). The shipped models (another machine's) rank the promoted plans of each "
             f"configuration of the study (fixed features, {len(rows)} configurations), rescaled "
             "by two calibrations this machine cached while other processes held the cores "
             "(`granii.calibration`; `contended`: " + ", ".join(
                 f"{k} {v * 1e3:.2f} ms" for k, v in CONTENDED_CALIBRATION.items()) +
             "; `contended, small call quiet`: " + ", ".join(
                 f"{k} {v * 1e3:.2f} ms" for k, v in CONTENDED_QUIET_SMALL.items()) +
             ") and unscaled (what granii now uses when its calibration is contended). The "
             "models' own reference times are " + ", ".join(
                 f"{k} {v * 1e3:.2f} ms" for k, v in _reference_times().items()) + ".", "",
             *calibration_lines(rows, list(cals)), "",
             "A tie-break times its candidates (`select.trial_candidates`) and DGL's layer on the "
             "first calls: a pick outside the other calibration's candidates is one its "
             "tie-break cannot recover.", ""]
    (args.out / "calibration_decisions.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _reference_times():
    from granii import learned
    from granii.fingerprint import machine_fingerprint
    found = learned.foreign_models(learned.models_dir(), machine_fingerprint())
    return learned.model_calibration(found[0]) if found else {}


if __name__ == "__main__":
    sys.exit(main())
