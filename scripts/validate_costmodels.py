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
"""
import argparse
import csv
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

from granii.dispatch import leaf_vals_order, new_state, prepare  # noqa: E402
from granii.costmodel import AnalyticalCost  # noqa: E402
from granii.datasets import GRAPHS, load_graph  # noqa: E402
from granii.fingerprint import fingerprint_id, machine_fingerprint  # noqa: E402
from granii.graph import GraphInfo  # noqa: E402
from granii.learned import load, models_dir  # noqa: E402
from granii.plan import GRAPH, compile_plan, step_impls  # noqa: E402
from granii.select import rank, scenario  # noqa: E402
from profiler import points as pts  # noqa: E402
from profiler.harness import Probe  # noqa: E402
from profiler.timing import fix_threads, side_by_side  # noqa: E402

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
    time, so one implementation stands for all of them."""
    options = step_impls(step)
    return options[:1] if step.when == GRAPH else options


def _canonical(plan, impls):
    return tuple(_impl_options(s)[0] if s.when == GRAPH else i for s, i in zip(plan.steps, impls))


def _lead_args(fn, call):
    """The arguments a compiled plan takes before the leaf values (as ``granii.dispatch.run_plan``
    passes them): the graph's ``GraphInfo`` and, in newer plans, the module."""
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


def write_csv(path, rows):
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


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


def main(argv=None):
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


if __name__ == "__main__":
    sys.exit(main())
