"""Validation of this machine's learned cost models on the real graphs (never used in training).

Part 1, per (primitive, implementation): every primitive is timed on the graphs of
``granii.datasets`` at a few sizes (implementations side by side; GEMM on ``(N, k, n)`` with ``N``
each graph's node count) and compared with the learned and the analytical predictions:

    MAPE      mean |predicted - measured| / measured
    Spearman  rank correlation of predicted and measured seconds
    pairs     share of pairs of points whose order the prediction gets right (ties skipped)
    impl      share of (graph, primitive, sizes) where the predicted fastest implementation is
              the measured fastest one

Part 2, selection regret: DGL's ``GraphConv(k_in, k_out, norm="both")`` on every graph for
``(k_in, k_out)`` in ``{32, 256, 1024}^2``. Every candidate the selector can choose (each
promoted plan of the call's scenario, with every combination of kernel implementations) is timed
side by side, as a hidden layer: once-per-input values are recomputed on every call, as they are
when the input changes or needs a gradient, and ranking is done with the same assumption
(``input_grad=True``); once-per-graph steps are cached, so their implementation does not count.
``regret = time(choice of the model) / time(fastest candidate)``.

Writes ``results/costmodels/report.md``, ``primitives.csv``, ``regret.csv`` and the plots
``pred_vs_measured.png``, ``regret.png``. Usage: ``OMP_NUM_THREADS=2 python -m
scripts.validate_costmodels [--quick] [--models costmodels/<id>]``.

Part 3 (``selection``), plan choice of GraphConv, GIN, SAGE and GAT (4 heads), inference and
training, as hidden layers (``--modes infer train``, the default: new features at each call,
needing a gradient in training) or as first layers on fixed features (``infer-same
train-same``: the same tensor each call, no gradient, so work on the features alone is kept
between calls as granii keeps it, ``MODES``): ``--measure`` times every candidate of each
configuration side by side (wall clock and process CPU time; GAT's unfused plans only where edge
scores and softmax use one library) into ``selection_times.jsonl``; ``--report`` ranks the
candidates with each cost model
(this machine's, other machines' rescaled by the calibration, the roofline with calibrated and
with hand-set rates) and writes the regret tables ``selection_<threads>t.md``. Usage:
``python -m scripts.validate_costmodels selection --measure --report --threads 1
--transfer-from costmodels/<id> ...``.
"""
import argparse
import inspect
import itertools
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.csvfile import write_csv  # noqa: E402
from granii.runtime.bind import prepare# noqa: E402
from granii.runtime.state import new_state
from granii.runtime.variants import every_plan, leaf_vals_order
from granii.costmodel import PRICED_AS, AnalyticalCost  # noqa: E402
from granii.datasets import GRAPHS, load_graph  # noqa: E402
from granii.fingerprint import fingerprint_id, machine_fingerprint  # noqa: E402
from granii.graph import GraphInfo  # noqa: E402
from granii.learned import load, models_dir  # noqa: E402
from granii.plan import GRAPH, compile_plan, step_impls  # noqa: E402
from granii.select import rank, scenario  # noqa: E402
from granii.profiling import points as pts  # noqa: E402
from granii.profiling.harness import Probe  # noqa: E402
from granii.profiling.timing import fix_threads, side_by_side  # noqa: E402

SIZES = [32, 256, 1024]
HEADS = [1, 4]
MAX_CALL = 0.6          # seconds per round of a primitive point; larger ones are not timed


# -- statistics ------------------------------------------------------------------------------------
def mape(pred, meas):
    pred, meas = np.asarray(pred), np.asarray(meas)
    return float(np.mean(np.abs(pred - meas) / meas))


def spearman(pred, meas):
    from scipy.stats import spearmanr
    if len(pred) < 3 or len(set(pred)) < 2 or len(set(meas)) < 2:
        return float("nan")
    return float(spearmanr(pred, meas).statistic)


def pair_accuracy(pred, meas):
    """Share of pairs ``(i, j)`` with ``meas_i != meas_j`` ordered alike by ``pred``."""
    pred, meas = np.asarray(pred), np.asarray(meas)
    i, j = np.triu_indices(len(meas), 1)
    dm, dp = np.sign(meas[i] - meas[j]), np.sign(pred[i] - pred[j])
    keep = dm != 0
    return float(np.mean(dm[keep] == dp[keep])) if keep.any() else float("nan")


def geomean(xs):
    return float(math.exp(statistics.fmean(math.log(x) for x in xs))) if xs else float("nan")


# -- part 1: primitives ----------------------------------------------------------------------------
def time_point(fns, probe, wait):
    """``({impl: median seconds}, contended)`` of the callables timed side by side."""
    before, _ = probe.wait_quiet(wait)
    with torch.no_grad():
        res = side_by_side(fns, warmup=1, repeat=5, budget=0.5)
    after = probe.seconds()
    return {k: v[0] for k, v in res.items()}, max(before, after) > probe.threshold


def primitive_rows(graphs, models, probe, wait, log):
    """One row per (graph, primitive, sizes, implementation): measured and predicted seconds."""
    rows = []
    prims = pts.registered(pts.GRAPH_PRIMS + pts.DENSE_PRIMS)
    dense_done = set()
    for name in graphs:
        g = load_graph(name)
        gi = GraphInfo(g)
        n = gi.num_dst
        t0 = time.perf_counter()
        for prim, impls in prims:
            if prim == "gemm":
                cells = [({"m": n, "k": k, "n": o}, None) for k in SIZES for o in SIZES]
            elif prim == "row_scale":
                cells = [({"n": n, "k": k}, None) for k in SIZES]
            elif prim == "head_gemm":
                cells = [({"m": n, "k": k, "heads": 4, "n": 4 * f}, None) for k in SIZES
                         for f in (8, 64)]
            elif prim == "spmm_heads":
                cells = [({"heads": 4, "k": k}, gi) for k in SIZES]
            elif prim == "gat_aggregate":
                cells = [({"heads": h, "k": h * f}, gi) for h in HEADS for f in (8, 64)]
            elif pts.MODEL_SIZES[prim][1] == ("heads",):
                cells = [({"heads": h}, gi) for h in HEADS]
            elif pts.MODEL_SIZES[prim][1] == ():
                cells = [({}, gi)]
            else:
                cells = [({"k": k}, gi) for k in SIZES]
            for sizes, graph in cells:
                shape = (gi.num_src, gi.num_dst, gi.num_edges) if graph is not None else (0, 0, 0)
                if pts.estimate(prim, sizes, *shape) * len(impls) > MAX_CALL:
                    continue
                dkey = (prim, tuple(sorted(sizes.items())))
                if graph is None and dkey in dense_done:
                    continue
                dense_done.add(dkey)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*is in beta")
                    meas, contended = time_point(pts.runners(prim, graph, sizes, impls), probe,
                                                 wait)
                dims = dict(sizes)
                if prim.startswith("spmm"):
                    dims["n"] = gi.num_dst
                for impl in impls:
                    rows.append({
                        "graph": name if graph is not None else "dense", "prim": prim,
                        "impl": impl, "sizes": ",".join(f"{k}={v}" for k, v in sizes.items()),
                        "measured": meas[impl], "contended": contended,
                        **{m: model.predict(prim, impl, gi, dims) for m, model in models.items()},
                    })
        log(f"  primitives on {name}: {time.perf_counter() - t0:.0f} s")
        del gi, g
    return rows


def primitive_table(rows, models):
    """Per (primitive, implementation): n and, per model, MAPE, Spearman, pairwise accuracy."""
    out = []
    for (prim, impl), grp in itertools.groupby(sorted(rows, key=lambda r: (r["prim"], r["impl"])),
                                               key=lambda r: (r["prim"], r["impl"])):
        grp = list(grp)
        meas = [r["measured"] for r in grp]
        entry = {"prim": prim, "impl": impl, "n": len(grp)}
        for m in models:
            pred = [r[m] for r in grp]
            entry[m] = (mape(pred, meas), spearman(pred, meas), pair_accuracy(pred, meas))
        out.append(entry)
    return out


def impl_choice(rows, models):
    """Per primitive with several implementations and per model: the share of points where the
    predicted fastest implementation is the measured fastest, and the geomean and worst of
    ``time(predicted fastest) / time(fastest)``."""
    cells = {}
    for r in rows:
        cells.setdefault((r["prim"], r["graph"], r["sizes"]), []).append(r)
    out = {}
    for (prim, _, _), grp in cells.items():
        if len(grp) < 2:
            continue
        best = min(r["measured"] for r in grp)
        for m in models:
            pick = min(grp, key=lambda r: (r[m], r["impl"]))
            out.setdefault((prim, m), []).append(pick["measured"] / best)
    return {k: (float(np.mean([x == 1.0 for x in v])), geomean(v), max(v), len(v))
            for k, v in out.items()}


# -- part 2: GraphConv regret ----------------------------------------------------------------------
def _state(layer):
    return new_state(layer)


def _impl_options(step):
    """Implementations to time for a step: once-per-graph steps are not part of the steady-state
    time, so one implementation stands for all of them. An implementation priced as another
    (``costmodel.PRICED_AS``) runs that other one on the dense random features timed here, so it
    is not timed twice."""
    options = [i for i in step_impls(step) if (step.prim, i) not in PRICED_AS] or step_impls(step)
    return options[:1] if step.when == GRAPH else options


def _canonical(plan, impls):
    """The timed candidate that stands for ``impls`` on ``plan`` (see ``_impl_options``)."""
    return tuple(_impl_options(s)[0] if s.when == GRAPH
                 else PRICED_AS.get((s.prim, i), (s.prim, i))[1] for s, i in zip(plan.steps, impls))


def timed_candidates(times, call):
    """``times`` (``{candidate key: seconds}``) without the keys ``candidates`` no longer makes
    (a run before an implementation was folded into another times both)."""
    keep = {_key_text(k) for k in candidates(call, pruned=True)} | {"dgl-layer"}
    return {k: v for k, v in times.items() if k in keep}


def _lead_args(fn, call):
    """The arguments a compiled plan takes before the leaf values (as
    ``granii.runtime.variants.run_plan`` passes them): the graph's ``GraphInfo`` and, in newer
    plans, the module."""
    names = list(inspect.signature(fn).parameters)
    return [call.gi] + ([call.module] if len(names) > 1 and names[1] == "module" else [])


def _drop_inputs(gi):
    for k in [k for k in gi.cache if isinstance(k, tuple) and k and k[0] == "input"]:
        del gi.cache[k]


def regret_rows(graphs, models, probe, wait, log, sizes=SIZES):
    from dgl.nn import GraphConv
    rows = []
    for name in graphs:
        g = load_graph(name)
        t0 = time.perf_counter()
        for k_in, k_out in itertools.product(sizes, sizes):
            torch.manual_seed(0)
            layer = GraphConv(k_in, k_out, norm="both", allow_zero_in_degree=True)
            feat = torch.randn(g.num_nodes(), k_in)
            with torch.no_grad():
                call = prepare(_state(layer), layer, (g, feat), {})
            if isinstance(call, str):
                raise RuntimeError(f"granii: GraphConv not optimized: {call}")
            choices = {m: rank(call.compiled.plans, call.gi, call.symbols, model, training=False,
                               input_grad=True)[0] for m, model in models.items()}
            scen = scenario(call.symbols)
            fns = {}
            for plan in call.compiled.plans:
                if scen is not None and scen not in plan.scenarios:
                    continue
                for impls in itertools.product(*(_impl_options(s) for s in plan.steps)):
                    fn, _ = compile_plan(plan, impls)
                    args = _lead_args(fn, call) + [call.leaf_vals[v] for v in leaf_vals_order(plan)]

                    def run(fn=fn, args=args, gi=call.gi):
                        _drop_inputs(gi)
                        return fn(*args)
                    fns[(plan.index, impls)] = run
            before, _ = probe.wait_quiet(wait)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is in beta")
                res = side_by_side(fns, warmup=1, repeat=5, budget=1.0)
            contended = max(before, probe.seconds()) > probe.threshold
            times = {k: v[0] for k, v in res.items()}
            best_key = min(times, key=times.get)
            row = {"graph": name, "k_in": k_in, "k_out": k_out, "candidates": len(times),
                   "best": _label(call, best_key), "best_s": times[best_key],
                   "contended": contended}
            for m, c in choices.items():
                key = (c.plan.index, _canonical(c.plan, c.impls))
                row[f"{m}_choice"] = _label(call, key)
                row[f"{m}_regret"] = times[key] / times[best_key]
            rows.append(row)
        log(f"  GraphConv on {name}: {time.perf_counter() - t0:.0f} s")
    return rows


def _label(call, key):
    index, impls = key
    plan = next(p for p in call.compiled.plans if p.index == index)
    parts = [f"{s.prim}:{i}" for s, i in zip(plan.steps, impls) if s.prim not in ("add", "apply")]
    return f"[{index}] " + " -> ".join(parts)


# -- report ----------------------------------------------------------------------------------------
def _f(x, fmt):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def plot_predictions(rows, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["prim"], r["impl"]) for r in rows})
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(keys) / cols), cols, figsize=(4 * cols,
                             3.6 * math.ceil(len(keys) / cols)), squeeze=False)
    styles = {"learned": ("tab:blue", "o"), "analytical": ("tab:gray", "x")}
    for ax, key in zip(axes.flat, keys):
        grp = [r for r in rows if (r["prim"], r["impl"]) == key]
        meas = np.array([r["measured"] for r in grp])
        for m in models:
            color, marker = styles.get(m, ("tab:red", "."))
            ax.scatter(meas, [r[m] for r in grp], s=14, c=color, marker=marker, label=m, alpha=0.8)
        lo = min(meas.min(), *(min(r[m] for r in grp) for m in models)) / 1.5
        hi = max(meas.max(), *(max(r[m] for r in grp) for m in models)) * 1.5
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{key[0]} / {key[1]}", fontsize=10)
        ax.set_xlabel("measured s")
        ax.set_ylabel("predicted s")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_regret(rows, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    x = np.arange(len(graphs))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(graphs)), 4))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        vals = [geomean([r[f"{m}_regret"] for r in rows if r["graph"] == g]) for g in graphs]
        worst = [max(r[f"{m}_regret"] for r in rows if r["graph"] == g) for g in graphs]
        ax.bar(x + i * width, vals, width, label=f"{m} (geomean)")
        ax.scatter(x + i * width, worst, marker="v", color="k", s=18,
                   label="worst" if i == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + width * (len(models) - 1) / 2)
    ax.set_xticklabels(graphs, rotation=30, ha="right")
    ax.set_ylabel("time(chosen) / time(fastest)")
    ax.set_title("GraphConv selection regret over (k_in, k_out) in {32, 256, 1024}^2")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(path, info, prim_table, choice, regret, models):
    lines = ["# Cost-model validation on the real graphs", "",
             f"Machine `{info['fid']}`: {info['cpu']}, {info['threads']} threads; models "
             f"`{info['models']}` ({info['trained']} training points, {info['created']}). "
             f"Graphs: {', '.join(info['graphs'])} (none used in training). Runtime "
             f"{info['seconds'] / 60:.1f} min. Generated by `scripts/validate_costmodels.py`.", "",
             f"Measurements taken while other processes held the cores (contention probe above "
             f"threshold): {info['contended_prims']} of {info['n_prims']} primitive points, "
             f"{info['contended_regret']} of {len(regret)} GraphConv configurations.", "",
             "## Per primitive and implementation", "",
             "MAPE = mean |pred - meas| / meas; Spearman rank correlation; pairs = share of point "
             "pairs ordered right.", "",
             "| primitive | impl | n | " + " | ".join(
                 f"{m} MAPE | {m} Spearman | {m} pairs" for m in models) + " |",
             "|---|---|---:|" + "---:|---:|---:|" * len(models)]
    for e in prim_table:
        cells = []
        for m in models:
            a, s, p = e[m]
            cells += [_f(a, ".0%"), _f(s, ".3f"), _f(p, ".0%")]
        lines.append(f"| {e['prim']} | {e['impl']} | {e['n']} | " + " | ".join(cells) + " |")
    lines += ["", "Implementation choice per primitive: share of (graph, sizes) where the predicted "
              "fastest implementation is the fastest measured, and time(predicted) / time(fastest) "
              "(the analytical model prices all implementations alike, so it picks the first).", "",
              "| primitive | points | " + " | ".join(
                  f"{m} right | {m} geomean | {m} worst" for m in models) + " |",
              "|---|---:|" + "---:|---:|---:|" * len(models)]
    for prim in sorted({p for p, _ in choice}):
        cells, n = [], 0
        for m in models:
            right, gm, worst, n = choice[(prim, m)]
            cells += [f"{right:.0%}", f"{gm:.3f}", f"{worst:.2f}"]
        lines.append(f"| {prim} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "![predicted vs measured](pred_vs_measured.png)", "",
              "## Selection regret: GraphConv(norm=both)", "",
              "Each configuration times every candidate (plans of the call's scenario x kernel "
              "implementations) side by side as a hidden layer; regret = time(chosen) / "
              "time(fastest).", "",
              "| graph | " + " | ".join(f"{m} geomean | {m} worst" for m in models) + " |",
              "|---|" + "---:|---:|" * len(models)]
    for g in dict.fromkeys(r["graph"] for r in regret):
        rs = [r for r in regret if r["graph"] == g]
        cells = []
        for m in models:
            v = [r[f"{m}_regret"] for r in rs]
            cells += [f"{geomean(v):.3f}", f"{max(v):.2f}"]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    cells = []
    for m in models:
        v = [r[f"{m}_regret"] for r in regret]
        cells += [f"**{geomean(v):.3f}**", f"**{max(v):.2f}**"]
    lines.append("| **all** | " + " | ".join(cells) + " |")
    lines += ["", "![regret](regret.png)", "", "Worst configurations of the learned model:", "",
              "| graph | k_in | k_out | regret | chosen | fastest |", "|---|---:|---:|---:|---|---|"]
    for r in sorted(regret, key=lambda r: -r["learned_regret"])[:8] if "learned" in models else []:
        lines.append(f"| {r['graph']} | {r['k_in']} | {r['k_out']} | {r['learned_regret']:.2f} | "
                     f"{r['learned_choice']} | {r['best']} |")
    Path(path).write_text("\n".join(lines) + "\n")


def heldout_markdown(manifest):
    """Held-out accuracy of every model of a folder (from its manifest: a quarter of the graphs,
    or of the dense grid's rows, left out of a fit on the rest)."""
    lines = ["| model | phase | points | graphs | held-out MAPE | held-out Spearman | train MAPE |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for key, e in sorted(manifest["models"].items()):
        prim, _, rest = key.partition("/")
        impl, _, phase = rest.partition("/")
        v = e.get("validation") or {}
        lines.append(f"| {prim}/{impl} | {phase or 'forward'} | {e['points']} | {e['graphs']} | "
                     f"{_f(v.get('mape'), '.0%')} | {_f(v.get('spearman'), '.3f')} | "
                     f"{_f(e['train']['mape'], '.0%')} |")
    return lines


def selection_models(threads, here_dir, foreign_dirs):
    """The cost models compared at ``threads``: this machine's own (when they exist for this
    thread count), each foreign folder rescaled by this machine's calibration, the calibrated
    and the bare analytical model. Returns ``({label: model}, notes)``."""
    from granii import calibration, learned
    fp = machine_fingerprint(threads)
    here_cal = calibration.this_machine(fp)
    lazy = learned._Lazy(lambda: here_cal)
    models, notes = {}, []
    own = models_dir() / fingerprint_id(fp) if here_dir is None else here_dir
    try:
        models["here"] = load(own, fp)
        notes.append(f"here: {own.name}, trained on this machine at {threads} threads")
    except Exception as e:           # noqa: BLE001 - reported, the others still compared
        notes.append(f"here: none at {threads} threads ({str(e)[:120]})")
    for d in foreign_dirs:
        m = load(d, check=False)
        fid = m.manifest["fingerprint_id"]
        theirs = m.manifest["fingerprint"]
        label = f"from_{fid}"
        learned.transferred([m], lazy)
        models[label] = m
        src = "its own models' predictions of the reference calls"
        notes.append(f"{label}: models of {theirs.get('cpu_model')} at {theirs.get('threads')} "
                     f"threads, rescaled by this machine's calibration (theirs: {src}); ratios "
                     + ", ".join(f"{k} {v:.2f}" for k, v in m.transfer.summary().items() if v))
    models["analytical_cal"] = AnalyticalCost(name="analytical (calibrated)",
                                              **calibration.analytical_rates(here_cal["times"]))
    models["analytical"] = AnalyticalCost()
    notes.append("analytical_cal: the roofline with this machine's calibrated rates; analytical: "
                 "the roofline with its hand-set rates")
    notes.append(f"calibration at {threads} threads: " + ", ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in here_cal["times"].items()))
    return models, notes


def selection_main(args):
    """Part 3: measure the candidates of four layers (``--measure``) and/or write the regret
    report of every model (``--report``)."""
    import json
    threads = fix_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / "selection_times.jsonl"
    log = lambda msg: print(msg, flush=True)
    if args.measure:
        probe = Probe()
        log(f"granii: timing the candidates of {', '.join(LAYERS)} at {threads} threads")
        sizes = [tuple(int(x) for x in s.split(",")) for s in args.sizes] if args.sizes \
            else LAYER_SIZES
        measure_layers(args.graphs or LAYER_GRAPHS, args.layers, sizes, args.modes, probe,
                       args.wait, log, path, threads, repeat=args.repeat)
    if not args.report:
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = list({(r["layer"], r["graph"], r["k_in"], r["k_out"], r["mode"]): r
                 for r in rows if r["threads"] == threads}.values())
    foreign = [p for p in args.transfer_from]
    models, notes = selection_models(threads, args.models, foreign)
    contended = sum(r["contended"] for r in rows)
    lines = []
    for metric, what in (("min_times", "fastest round, wall clock"),
                         ("cpu_times", "least process CPU time of a round"),
                         ("times", "median round, wall clock")):
        choices = layer_choices(rows, models, metric)
        write_csv(out / f"selection_{threads}t_{metric}.csv", choices)
        lines += regret_markdown(
            choices, models, f"{threads} thread{'s' if threads > 1 else ''}: {what}",
            f"{len(rows)} configurations ({contended} timed while the contention probe was "
            "above its threshold). regret = time(chosen candidate) / time(fastest candidate), "
            "candidates timed side by side in turn.") + [""]
    lines += [f"- {n}" for n in notes]
    (out / f"selection_{threads}t.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 0


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "selection":
        ap = argparse.ArgumentParser(prog="validate_costmodels selection")
        ap.add_argument("--measure", action="store_true")
        ap.add_argument("--report", action="store_true")
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--graphs", nargs="+", type=study_graph_name,
                        help="shipped graphs; <graph>/block<i> for block i of a neighbour "
                             "sampler on it")
        ap.add_argument("--modes", nargs="+", default=["infer", "train"], choices=list(MODES),
                        help="infer/train: a hidden layer (new features at each call); "
                        "infer-same/train-same: a first layer on fixed features")
        ap.add_argument("--repeat", type=int, default=3,
                        help="rounds of every candidate per configuration (default 3)")
        ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
        ap.add_argument("--sizes", nargs="+", help="k_in,k_out pairs (default: "
                        + " ".join(f"{a},{b}" for a, b in LAYER_SIZES) + ")")
        ap.add_argument("--models", type=Path, help="this machine's model folder")
        ap.add_argument("--transfer-from", nargs="*", type=Path, default=[],
                        help="model folders of other machines to use with the calibration")
        ap.add_argument("--out", type=Path, default=ROOT / "results" / "costmodels")
        ap.add_argument("--wait", type=float, default=2.0)
        return selection_main(ap.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, help="model folder (default: this machine's)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "costmodels")
    ap.add_argument("--graphs", nargs="+", default=GRAPHS, choices=GRAPHS)
    ap.add_argument("--quick", action="store_true", help="two small graphs, for a smoke run")
    ap.add_argument("--wait", type=float, default=10.0,
                    help="seconds to wait for a contended machine before each measurement")
    args = ap.parse_args(argv)
    threads = fix_threads(2)
    fp = machine_fingerprint(threads)
    path = args.models or models_dir() / fingerprint_id(fp)
    learned = load(path, fp)
    models = {"learned": learned, "analytical": AnalyticalCost()}
    graphs = ["cora", "us-power-grid"] if args.quick else args.graphs
    args.out.mkdir(parents=True, exist_ok=True)
    probe = Probe()
    t0 = time.perf_counter()
    log = lambda msg: print(msg, flush=True)
    log(f"granii: validating {path} on {', '.join(graphs)}")
    prows = primitive_rows(graphs, models, probe, args.wait, log)
    rrows = regret_rows(graphs, models, probe, args.wait, log)
    table = primitive_table(prows, models)
    choice = impl_choice(prows, models)
    write_csv(args.out / "primitives.csv", prows)
    write_csv(args.out / "regret.csv", rrows)
    plot_predictions(prows, models, args.out / "pred_vs_measured.png")
    plot_regret(rrows, models, args.out / "regret.png")
    info = {"fid": fingerprint_id(fp), "cpu": fp["cpu_model"], "threads": threads,
            "models": str(Path(path).resolve().relative_to(ROOT)) if Path(path).resolve()
            .is_relative_to(ROOT) else str(path),
            "trained": learned.manifest.get("training_points"),
            "created": learned.manifest.get("created"), "graphs": graphs,
            "seconds": time.perf_counter() - t0,
            "contended_prims": sum(r["contended"] for r in prows), "n_prims": len(prows),
            "contended_regret": sum(r["contended"] for r in rrows)}
    report(args.out / "report.md", info, table, choice, rrows, models)
    for m in models:
        v = [r[f"{m}_regret"] for r in rrows]
        log(f"  {m:<10} regret geomean {geomean(v):.3f}  worst {max(v):.2f}")
    log(f"granii: report in {args.out / 'report.md'} ({info['seconds'] / 60:.1f} min)")
    return 0



# -- part 3: selection regret of four layers, models of this machine against transferred ones -----
LAYERS = ("GraphConv", "GIN", "SAGE", "GAT")
LAYER_SIZES = ((32, 256), (256, 32), (256, 256))
LAYER_GRAPHS = ("cora", "citeseer", "pubmed", "us-power-grid", "wing-mesh", "github-social")


BLOCK_SEEDS, BLOCK_FANOUT = 1024, 10


def study_graph(name):
    """A graph of the selection study: a shipped graph by name, or ``<graph>/block<i>``: block
    ``i`` of a one-hop neighbour sampler on it (``BLOCK_FANOUT`` in-edges of each of
    ``BLOCK_SEEDS`` seeds, the seeds of batch ``i`` of a fixed shuffle), as DGL's sampling
    examples feed a layer. The same name gives the same block."""
    import dgl
    i = block_index(name)
    g = load_graph(base_graph(name))
    if i is None:
        return g
    order = torch.randperm(g.num_nodes(), generator=torch.Generator().manual_seed(0))
    seeds = order[i * BLOCK_SEEDS:(i + 1) * BLOCK_SEEDS]
    # DGL's sampler draws, and ``to_block`` numbers the sources, in parallel threads: neither is
    # repeatable, and the numbering changes the graph's locality features. Both are done here.
    u, v = g.in_edges(seeds)
    key = torch.rand(len(v), generator=torch.Generator().manual_seed(i + 1))
    order = torch.argsort(v.double() + key.double() * 0.5)        # by destination, shuffled
    v_sorted = v[order]
    first = torch.searchsorted(v_sorted, v_sorted)                # where each group starts
    keep = order[torch.arange(len(v)) - first < BLOCK_FANOUT]
    u, v = u[keep], v[keep]
    others = torch.unique(u)
    src = torch.cat([seeds, others[~torch.isin(others, seeds)]])   # destinations first
    local = torch.full((g.num_nodes(),), -1, dtype=torch.long)
    local[src] = torch.arange(len(src))
    block = dgl.create_block((local[u], local[v]), num_src_nodes=len(src),
                             num_dst_nodes=len(seeds))
    block.srcdata[dgl.NID], block.dstdata[dgl.NID] = src, seeds
    return block


def base_graph(name):
    """The shipped graph a study graph comes from (``pubmed`` for ``pubmed/block1``)."""
    return name.partition("/")[0]


def block_index(name):
    """``i`` of ``<graph>/block<i>``, ``None`` for a whole graph."""
    part = name.partition("/")[2]
    if not part:
        return None
    if not part.startswith("block") or not part[5:].isdigit():
        raise ValueError(f"granii: {name!r}: expected <graph> or <graph>/block<i>")
    return int(part[5:])


def study_graph_name(name):
    """``name`` if the study knows it (argparse ``type``)."""
    if base_graph(name) not in GRAPHS:
        raise argparse.ArgumentTypeError(f"unknown graph {name!r}: one of {', '.join(GRAPHS)}, "
                                         "optionally followed by /block<i>")
    return name


def make_layer(name, k_in, k_out):
    """DGL's layer ``name`` from ``k_in`` to ``k_out`` features (GAT: 4 heads of ``k_out / 4``)."""
    from dgl.nn import GATConv, GINConv, GraphConv, SAGEConv
    torch.manual_seed(0)
    if name == "GraphConv":
        return GraphConv(k_in, k_out, norm="both", allow_zero_in_degree=True)
    if name == "GIN":
        return GINConv(torch.nn.Linear(k_in, k_out), "sum")
    if name == "SAGE":
        return SAGEConv(k_in, k_out, "mean")
    if name == "GAT":
        return GATConv(k_in, k_out // 4, 4, allow_zero_in_degree=True)
    raise ValueError(name)


# mode: (training, the features need a gradient, the same features come back at each call)
MODES = {"infer": (False, False, False), "train": (True, True, False),
         "infer-same": (False, False, True), "train-same": (True, False, True)}


def mode_flags(mode):
    """``rank``'s ``training``, ``input_grad`` and ``input_repeats`` for a study mode: ``infer``
    and ``train`` time a hidden layer (new features at each call; in training they need a
    gradient), ``infer-same`` and ``train-same`` a first layer on fixed features (the same tensor
    every call, no gradient: work on the features alone is done once and reused)."""
    training, input_grad, repeats = MODES[mode]
    return {"training": training, "input_grad": input_grad, "input_repeats": repeats}


def prepared(layer, g, k_in, mode):
    """The bound call of ``layer`` in ``mode`` (``MODES``): training mode or eval, features
    needing a gradient or not."""
    feat = torch.randn(g.num_src_nodes(), k_in, generator=torch.Generator().manual_seed(1))
    training, input_grad, _ = MODES[mode]
    if training:
        layer.train()
        feat.requires_grad_(input_grad)
        with torch.enable_grad():
            call = prepare(_state(layer), layer, (g, feat), {})
    else:
        layer.eval()
        with torch.no_grad():
            call = prepare(_state(layer), layer, (g, feat), {})
    if isinstance(call, str):
        raise RuntimeError(f"granii: {type(layer).__name__} not optimized: {call}")
    return call, feat


def candidates(call, pruned=False):
    """``{(plan index, implementations): plan, impls}`` the selector chooses among (the plans of
    the call's scenario, every combination of kernel implementations of their every-call steps).
    ``pruned``: every plan of every enumerated tree, of any scenario, pruned or not (what the
    oracle of the regret is taken over)."""
    scen = scenario(call.symbols)
    out = {}
    plans = every_plan(call.compiled) if pruned else call.compiled.plans
    for plan in plans:
        if not pruned and scen is not None and scen not in plan.scenarios:
            continue
        for impls in itertools.product(*(_impl_options(s) for s in plan.steps)):
            out[(plan.index, impls)] = (plan, impls)
    return out


def _grad_targets(layer, feat):
    """What a timed training call differentiates: the features when they need a gradient, and
    the layer's trainable parameters."""
    return ([feat] if feat.requires_grad else []) + [p for p in layer.parameters()
                                                     if p.requires_grad]


def candidate_fns(call, layer, feat, mode):
    """``{candidate key: one call}`` (forward, and in training the backward to every gradient
    needed). With new features at each call the work kept per input is dropped before each call;
    with the same features it is kept, as granii keeps it."""
    fns = {}
    training, _, repeats = MODES[mode]
    wrt = _grad_targets(layer, feat)
    drop = (lambda gi: None) if repeats else _drop_inputs
    for key, (plan, impls) in candidates(call, pruned=True).items():
        fn, _ = compile_plan(plan, impls)
        args = _lead_args(fn, call) + [call.leaf_vals[v] for v in leaf_vals_order(plan)]
        if training:
            with torch.enable_grad():
                dy = torch.randn_like(fn(*args))

            def run(fn=fn, args=args, dy=dy, gi=call.gi):
                drop(gi)
                with torch.enable_grad():
                    out = fn(*args)
                    return torch.autograd.grad(out, wrt, dy, allow_unused=True)
        else:
            def run(fn=fn, args=args, gi=call.gi):
                drop(gi)
                with torch.no_grad():
                    return fn(*args)
        fns[key] = run
    return fns


def _key_text(key):
    index, impls = key
    return f"{index}|{','.join(impls)}"


def two_clocks(fns, repeat=3):
    """``({name: wall seconds per round}, {name: process CPU seconds per round})``, the
    candidates run in turn each round. With other processes on the cores the wall time holds
    waits for a core; the CPU time of a one-thread run does not (it is the work alone)."""
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    return wall, cpu


def ranked_first(call, mode, most=4):
    """The keys of the candidates this machine's cost model ranks first (granii's choice and its
    tie-break's), so a subset of the candidates still times what granii picks."""
    from granii.learned import default_cost_model
    ranking = rank(call.compiled.plans, call.gi, call.symbols, default_cost_model(),
                   **mode_flags(mode))
    return {(c.plan.index, _canonical(c.plan, c.impls)) for c in ranking[:most]}


def gat_subset(cands):
    """GAT's candidates worth timing when all are too many: every fused one, and the unfused ones
    whose edge scores and softmax use one library (any aggregation)."""
    keep = []
    for key, (plan, impls) in cands.items():
        edge = {i for st, i in zip(plan.steps, impls) if st.prim in ("sddmm_add", "edge_softmax")}
        if len(edge) <= 1:
            keep.append(key)
    return keep


def measure_layers(graphs, layers, sizes, modes, probe, wait, log, out_path, threads, repeat=3):
    """Time every candidate of every configuration side by side; one JSON line per configuration
    (appended to ``out_path``) with ``{candidate: median seconds}`` and DGL's own layer."""
    import json
    done = set()
    if out_path.is_file():
        for line in out_path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            done.add((r["layer"], r["graph"], r["k_in"], r["k_out"], r["mode"], r["threads"]))
    for gname in graphs:
        g = study_graph(gname)
        for lname, (k_in, k_out), mode in itertools.product(layers, sizes, modes):
            if (lname, gname, k_in, k_out, mode, threads) in done:
                continue
            t0 = time.perf_counter()
            layer = make_layer(lname, k_in, k_out)
            call, feat = prepared(layer, g, k_in, mode)
            fns = candidate_fns(call, layer, feat, mode)
            if lname == "GAT":
                keep = set(gat_subset(candidates(call, pruned=True))) | ranked_first(call, mode)
                fns = {k: fns[k] for k in keep if k in fns}
            fns = {_key_text(k): f for k, f in fns.items()}
            wrt = _grad_targets(layer, feat)
            if MODES[mode][0]:
                with torch.enable_grad():
                    dy = torch.randn_like(layer(g, feat).reshape(g.num_dst_nodes(), -1))

                def dgl_run(layer=layer, feat=feat, dy=dy):
                    with torch.enable_grad():
                        out = layer(g, feat).reshape(g.num_dst_nodes(), -1)
                        return torch.autograd.grad(out, wrt, dy, allow_unused=True)
            else:
                def dgl_run(layer=layer, feat=feat):
                    with torch.no_grad():
                        return layer(g, feat)
            fns["dgl-layer"] = dgl_run
            failed = {}
            for k, fn in list(fns.items()):
                try:
                    fn()
                except (RuntimeError, ValueError, TypeError) as e:
                    failed[k] = f"{type(e).__name__}: {str(e)[:120]}"
                    del fns[k]
            before, _ = probe.wait_quiet(wait)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is in beta")
                wall, cpu = two_clocks(fns, repeat=repeat)
            contended = max(before, probe.seconds()) > probe.threshold
            row = {"layer": lname, "graph": gname, "k_in": k_in, "k_out": k_out, "mode": mode,
                   "threads": threads, "contended": contended, "repeat": repeat,
                   "times": {k: statistics.median(v) for k, v in wall.items()},
                   "min_times": {k: min(v) for k, v in wall.items()},
                   "cpu_times": {k: min(v) for k, v in cpu.items()}, "failed": failed}
            with open(out_path, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
            log(f"  {lname} {gname} {k_in}->{k_out} {mode}: {len(fns)} candidates "
                f"({len(failed)} failed), "
                f"{time.perf_counter() - t0:.0f} s{' (contended)' if contended else ''}")


def layer_choices(rows, models, metric="min_times"):
    """Per measured configuration and model: the candidate the model ranks first, and its regret
    ``time(chosen) / time(fastest candidate)`` by ``metric`` (``times``: median wall time of the
    rounds, ``min_times``: fastest round, ``cpu_times``: least process CPU time). A choice that
    was not timed (outside GAT's timed subset, or failing) has regret NaN."""
    out = []
    graphs = {}
    for r in rows:
        if r["graph"] not in graphs:
            graphs[r["graph"]] = load_graph(r["graph"])
        g = graphs[r["graph"]]
        layer = make_layer(r["layer"], r["k_in"], r["k_out"])
        call, _ = prepared(layer, g, r["k_in"], r["mode"])
        times = {k: v for k, v in timed_candidates(r[metric], call).items() if k != "dgl-layer"}
        best = min(times, key=times.get)
        entry = {k: r[k] for k in ("layer", "graph", "k_in", "k_out", "mode", "threads",
                                   "contended")}
        entry.update(best=best, best_s=times[best], dgl_s=r[metric].get("dgl-layer"))
        for m, model in models.items():
            c = rank(call.compiled.plans, call.gi, call.symbols, model,
                     **mode_flags(r["mode"]))[0]
            key = _key_text((c.plan.index, _canonical(c.plan, c.impls)))
            entry[f"{m}_choice"] = key
            entry[f"{m}_regret"] = times[key] / times[best] if key in times else float("nan")
        out.append(entry)
    return out


def regret_summary(choices, models, by=("layer", "mode")):
    """``{group: {model: (geomean, worst, n)}}`` of the regrets, grouped by ``by``."""
    groups = {}
    for e in choices:
        groups.setdefault(tuple(e[b] for b in by), []).append(e)
    out = {}
    for key, es in sorted(groups.items()):
        out[key] = {}
        for m in models:
            v = [e[f"{m}_regret"] for e in es if not math.isnan(e[f"{m}_regret"])]
            out[key][m] = (geomean(v), max(v) if v else float("nan"), len(v))
    return out


def regret_markdown(choices, models, title, note):
    summ = regret_summary(choices, models)
    lines = [f"### {title}", "", note, "",
             "| layer | mode | n | " + " | ".join(f"{m} geomean | {m} worst" for m in models)
             + " |", "|---|---|---:|" + "---:|---:|" * len(models)]
    for (layer, mode), cells in summ.items():
        n = max(c[2] for c in cells.values())
        lines.append(f"| {layer} | {mode} | {n} | " + " | ".join(
            f"{cells[m][0]:.3f} | {cells[m][1]:.2f}" for m in models) + " |")
    allv = {m: [e[f"{m}_regret"] for e in choices if not math.isnan(e[f"{m}_regret"])]
            for m in models}
    lines.append(f"| **all** | | {len(choices)} | " + " | ".join(
        f"**{geomean(allv[m]):.3f}** | **{max(allv[m]):.2f}**" for m in models) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
