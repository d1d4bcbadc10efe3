"""``report.md`` and the plots, from the CSVs of a benchmark run (re-runnable on its own).

All speedups are ratios of times of the same configuration measured side by side; summaries are
geometric means over configurations. ``speedup`` without qualification is DGL's time over granii's
for 100 iterations with every first-call overhead included (``total100``); ``steady`` is the ratio
of the steady-state medians.
"""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from .measure import ITERATIONS
from .models import MODELS

MODES = ("inference", "training")
CONFIG = ["model", "graph", "k_in", "k_out", "mode"]


def geomean(xs):
    xs = [x for x in xs if x is not None and np.isfinite(x) and x > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def fmt(x, digits=2, suffix="x"):
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}{suffix}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def load_runs(path):
    df = pd.read_csv(path)
    for c in ("min_ms", "others_cores"):
        if c not in df:
            df[c] = np.nan
    for c in ("steady_ms", "min_ms", "first_ms", "total100_ms", "predicted_ms", "max_rel_err",
              "others_cores"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    df["plan_key"] = df["plan_key"].fillna("")
    df["status"] = df["status"].fillna("")
    return df


def configs(df):
    """One row per configuration: DGL, granii and PyG times, status, chosen and fastest plan."""
    out = []
    for key, grp in df.groupby(CONFIG, sort=False):
        by = {k: g.iloc[0] for k, g in grp.groupby("kind") if k != "plan"}
        d, gr, py = by.get("dgl"), by.get("granii"), by.get("pyg")
        plans = grp[(grp.kind == "plan") & grp.steady_ms.notna()]
        row = dict(zip(CONFIG, key), nodes=d.nodes, edges=d.edges, family=d.family,
                   dgl_ms=d.steady_ms, dgl_total=d.total100_ms, dgl_min=d.min_ms,
                   dgl_first=d.first_ms,
                   others=d.others_cores,
                   status=gr.status if gr is not None else "missing",
                   granii_ms=gr.steady_ms if gr is not None else np.nan,
                   granii_min=gr.min_ms if gr is not None else np.nan,
                   granii_total=gr.total100_ms if gr is not None else np.nan,
                   granii_first=gr.first_ms if gr is not None else np.nan,
                   check=gr.check if gr is not None else "",
                   chosen_key=gr.plan_key if gr is not None else "",
                   chosen_impls=gr.impls if gr is not None else "",
                   pyg_ms=py.steady_ms if py is not None else np.nan,
                   pyg_total=py.total100_ms if py is not None else np.nan)
        row["optimized"] = row["status"] == "ok"
        if len(plans):
            best_per_plan = plans.groupby("plan_key").steady_ms.min()
            row["plan_times"] = best_per_plan.to_dict()
            row["fastest_key"] = best_per_plan.idxmin()
            row["fastest_ms"] = best_per_plan.min()
            ch = plans[plans.chosen == 1]
            if not len(ch):
                ch = plans[(plans.plan_key == row["chosen_key"]) & (plans.impl_tag == "select")]
            row["chosen_ms"] = ch.steady_ms.iloc[0] if len(ch) else np.nan
            row["chosen_plan_best_ms"] = best_per_plan.get(row["chosen_key"], np.nan)
            row["fastest_eligible"] = _eligible(plans, row["fastest_key"], key[2], key[3])
        else:
            row.update(plan_times={}, fastest_key="", fastest_ms=np.nan, chosen_ms=np.nan,
                       chosen_plan_best_ms=np.nan, fastest_eligible=np.nan)
        row["speedup"] = row["dgl_total"] / row["granii_total"]
        row["steady"] = row["dgl_ms"] / row["granii_ms"]
        row["steady_min"] = row["dgl_min"] / row["granii_min"]
        out.append(row)
    return pd.DataFrame(out)


def _noise_note(cf):
    o = cf.others.dropna()
    if not len(o):
        return ""
    return (f"Other processes used a median of {o.median():.2f} cores (max {o.max():.2f}) of the "
            f"{_cores()} while configurations were timed.")


def _cores():
    import os
    return os.cpu_count()


def _eligible(plans, key, k_in, k_out):
    """Whether plan ``key`` is promoted for this configuration's size scenario (granii's
    selection only ranks those); NaN when the CSV does not say."""
    if "scenarios" not in plans:
        return np.nan
    scen = plans[plans.plan_key == key].scenarios.dropna()
    if not len(scen):
        return np.nan
    want = ">=" if k_in >= k_out else "<"
    return want in str(scen.iloc[0]).split("/")


def short(key):
    """The primitive sequence of a plan key (the trees are in the CSV)."""
    return key.split(" | ")[0] if isinstance(key, str) else ""


def write_configs(cf, hf, path):
    """``configs.csv``: one row per configuration with the derived figures of the report."""
    keep = CONFIG + ["family", "nodes", "edges", "status", "check", "dgl_ms", "granii_ms",
                     "pyg_ms", "dgl_first", "granii_first", "dgl_total", "granii_total",
                     "speedup", "steady", "steady_min", "chosen_key", "chosen_impls",
                     "chosen_ms", "fastest_key", "fastest_ms", "fastest_eligible", "others"]
    df = cf[keep].copy()
    df["regret"] = df.chosen_ms / df.fastest_ms
    for name in ("config", "graph", "static"):
        df[f"{name}_heuristic_ms"] = hf[f"{name}_ms"].reindex(df.index)
    df.round(4).to_csv(path, index=False)


# -- tables ----------------------------------------------------------------------------------------
def table_iii(cf):
    rows = []
    opt = cf[cf.optimized]
    for model in list(dict.fromkeys(cf.model)):
        cells = [MODELS[model].label if model in MODELS else model]
        for mode in MODES:
            sub = opt[(opt.model == model) & (opt["mode"] == mode)]
            allc = cf[(cf.model == model) & (cf["mode"] == mode)]
            if not len(sub):
                cells += ["not optimized", "-", "-", "-"]
                continue
            cells += _iii_cells(sub) + [f"{len(sub)}/{len(allc)}"]
        rows.append(cells)
    cells = ["**all optimized**"]
    for mode in MODES:
        sub = opt[opt["mode"] == mode]
        cells += _iii_cells(sub) + [str(len(sub))]
    rows.append(cells)
    rows.append(["**both modes**"] + _iii_cells(opt) + [str(len(opt))] + [""] * 4)
    return table(["model", "inference: 100 it.", "steady", "steady (min)", "configs",
                  "training: 100 it.", "steady", "steady (min)", "configs"], rows)


def _iii_cells(sub):
    return [f"**{fmt(geomean(sub.speedup))}**", fmt(geomean(sub.steady)),
            fmt(geomean(sub.steady_min))]


def table_pyg(cf):
    if cf.pyg_ms.isna().all():
        return None
    rows = []
    for model in list(dict.fromkeys(cf.model)):
        cells = [model]
        for mode in MODES:
            sub = cf[(cf.model == model) & (cf["mode"] == mode) & cf.pyg_ms.notna()]
            opt = sub[sub.optimized]
            cells += [fmt(geomean(sub.pyg_ms / sub.dgl_ms)),
                      fmt(geomean(opt.pyg_total / opt.granii_total)) if len(opt) else "-"]
        rows.append(cells)
    return table(["model", "inference: PyG time / DGL time", "inference: PyG / granii (100 it.)",
                  "training: PyG / DGL", "training: PyG / granii (100 it.)"], rows)


def heuristics(cf):
    """Per configuration, the steady time of the plan each single-factor heuristic picks.

    config: per (model, mode, k_in, k_out), the plan with the best geometric-mean slowdown
    against the fastest plan across graphs; graph: per (model, mode, graph) across sizes;
    static: per (model, mode) across everything. Only plans measured in every configuration of
    the group compete. In-sample: each heuristic is fitted on the configurations it is scored on.
    """
    cf = cf[cf.optimized & cf.fastest_ms.notna()].copy()
    for name, keys in (("config", ["model", "mode", "k_in", "k_out"]),
                       ("graph", ["model", "mode", "graph"]), ("static", ["model", "mode"])):
        cf[f"{name}_ms"] = np.nan
        cf[f"{name}_key"] = ""
        for _, grp in cf.groupby(keys):
            common = set.intersection(*(set(p) for p in grp.plan_times))
            if not common:
                continue
            score = {k: np.mean([math.log(p[k] / f) for p, f in zip(grp.plan_times, grp.fastest_ms)])
                     for k in common}
            pick = min(sorted(score), key=score.get)
            cf.loc[grp.index, f"{name}_ms"] = [p[pick] for p in grp.plan_times]
            cf.loc[grp.index, f"{name}_key"] = pick
    return cf


def table_vi(hf):
    rows = []
    groups = [(m, mode) for m in dict.fromkeys(hf.model) for mode in MODES]
    for model, mode in groups + [("all", mode) for mode in MODES] + [("all", "both")]:
        sub = hf
        if model != "all":
            sub = sub[sub.model == model]
        if mode != "both":
            sub = sub[sub["mode"] == mode]
        if not len(sub):
            continue
        d = sub.dgl_ms
        regret = sub.chosen_ms / sub.fastest_ms
        worst = sub.loc[regret.idxmax()] if regret.notna().any() else None
        rows.append([f"**{model}**" if model == "all" else model, mode, len(sub),
                     fmt(geomean(d / sub.fastest_ms)), fmt(geomean(d / sub.chosen_ms)),
                     fmt(geomean(d / sub.chosen_plan_best_ms)),
                     fmt(geomean(d / sub.config_ms)), fmt(geomean(d / sub.graph_ms)),
                     fmt(geomean(d / sub.static_ms)), fmt(geomean(regret)),
                     fmt(regret.max()) + (f" ({worst.graph} {worst.k_in}->{worst.k_out})"
                                          if worst is not None else "")])
    return table(["model", "mode", "configs", "optimum", "granii's choice",
                  "granii's plan, best impl", "config only", "graph only", "static",
                  "regret geomean", "regret worst"], rows)


def slower_list(cf):
    sub = cf[cf.optimized & (cf.speedup < 1)].sort_values("speedup")
    rows = [[r.model, r.graph, f"{r.k_in}->{r.k_out}", r["mode"], fmt(r.speedup), fmt(r.steady),
             f"{r.dgl_ms:.2f}", f"{r.granii_ms:.2f}", f"{r.granii_first:.0f}",
             short(r.chosen_key), short(r.fastest_key), f"{r.fastest_ms:.2f}",
             f"{r.others:.2f}"]
            for _, r in sub.iterrows()]
    return table(["model", "graph", "sizes", "mode", "speedup (100 it.)", "steady",
                  "DGL ms", "granii ms", "granii first call ms", "chosen plan",
                  "fastest plan", "fastest ms", "other processes (cores)"], rows), len(sub)


def not_optimized(cf):
    sub = cf[~cf.optimized]
    rows = []
    for (model, status), grp in sub.groupby(["model", "status"]):
        rows.append([model, len(grp), status.replace("|", "/")])
    return table(["model", "configs", "reason"], rows) if rows else None


def checks(cf):
    opt = cf[cf.optimized]
    rows = []
    for mode in MODES:
        sub = opt[opt["mode"] == mode]
        rows.append([mode, int((sub.check == "pass").sum()), int((sub.check == "FAIL").sum())])
    fails = opt[opt.check == "FAIL"]
    return table(["mode", "pass", "fail"], rows), fails


# -- plots -----------------------------------------------------------------------------------------
def plot_speedups(cf, out):
    """One PNG per model: speedup (100 iterations, overhead included) per graph and sizes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    times_fmt = FuncFormatter(lambda v, _: f"{v:.3g}x")
    files = []
    for model in dict.fromkeys(cf.model):
        sub = cf[(cf.model == model) & cf.optimized]
        if not len(sub):
            continue
        graphs = list(dict.fromkeys(sub.graph))
        cols = min(4, len(graphs))
        rws = math.ceil(len(graphs) / cols)
        fig, axes = plt.subplots(rws, cols, figsize=(4.2 * cols, 3.2 * rws), squeeze=False)
        for ax, gname in zip(axes.flat, graphs):
            gs = sub[sub.graph == gname]
            pairs = sorted(set(zip(gs.k_in, gs.k_out)), key=lambda p: (p[0] >= p[1], p))
            xs = np.arange(len(pairs))
            for j, mode in enumerate(MODES):
                vals = [gs[(gs.k_in == a) & (gs.k_out == b) & (gs["mode"] == mode)].speedup
                        for a, b in pairs]
                vals = [v.iloc[0] if len(v) else np.nan for v in vals]
                ax.bar(xs + (j - 0.5) * 0.4, vals, width=0.4, label=mode,
                       color=("tab:blue", "tab:orange")[j])
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(times_fmt)
            ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
            ax.yaxis.set_minor_formatter(times_fmt)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{a}\u2192{b}" for a, b in pairs], rotation=60, fontsize=7)
            ax.set_title(f"{gname} ({int(gs.edges.iloc[0]):,} edges)", fontsize=9)
            ax.tick_params(axis="y", which="both", labelsize=7)
        for ax in list(axes.flat)[len(graphs):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        axes.flat[0].set_ylabel("speedup over DGL", fontsize=8)
        fig.suptitle(f"{MODELS[model].label if model in MODELS else model}: granii over DGL, "
                     f"{ITERATIONS} iterations incl. first-call overhead (bars: k_in\u2192k_out)",
                     fontsize=10)
        fig.tight_layout()
        name = f"speedup_{model}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        files.append(name)
    return files


def plot_overhead(ov, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for fam, mark in (("rmat", "o"), ("uniform", "s")):
        s = ov[ov.family == fam].sort_values("edges")
        if not len(s):
            continue
        ax.plot(s.edges, s.features_ms, marker=mark, label=f"featurize ({fam})")
        ax.plot(s.edges, s.select_ms, marker=mark, ls="--", label=f"select ({fam})")
        ax.plot(s.edges, (s.granii_first_ms - s.dgl_first_ms).clip(lower=1e-3), marker=mark,
                ls=":", label=f"first call minus DGL's ({fam})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("edges")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    ax.set_title("granii's decision overhead vs graph size (GCN 32->128)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=90)
    plt.close(fig)
    return "overhead.png"


# -- the report ------------------------------------------------------------------------------------
def headline(cf, hf):
    """The figures a reader wants first, as a dict (also printed by the benchmark)."""
    opt = cf[cf.optimized]
    h = {}
    for mode in MODES:
        sub = opt[opt["mode"] == mode]
        h[f"speedup_{mode}"] = geomean(sub.speedup)
        h[f"steady_{mode}"] = geomean(sub.steady)
    h["speedup_all"] = geomean(opt.speedup)
    for model in dict.fromkeys(opt.model):
        for mode in MODES:
            sub = opt[(opt.model == model) & (opt["mode"] == mode)]
            h[f"{model}_{mode}"] = geomean(sub.speedup)
    if len(hf):
        regret = hf.chosen_ms / hf.fastest_ms
        h["regret_geomean"] = geomean(regret)
        h["regret_worst"] = float(regret.max())
    if len(opt):
        worst = opt.loc[opt.speedup.idxmin()]
        h["slowest"] = (f"{worst.model} {worst.graph} {worst.k_in}->{worst.k_out} {worst['mode']}: "
                        f"{worst.speedup:.2f}x")
        extra = opt.granii_first - cf.loc[opt.index, "dgl_first"]
        big = opt.loc[extra.idxmax()]
        h["largest_first_call_overhead"] = (
            f"{big.model} {big.graph} {big.k_in}->{big.k_out} {big['mode']}: granii's first call "
            f"{big.granii_first:.0f} ms vs DGL's {big.dgl_first:.0f} ms "
            f"(+{extra.max() / big.dgl_ms:.1f} DGL iterations)")
    h["configs_optimized"] = int(len(opt))
    h["configs_total"] = int(len(cf))
    return h


def write(out, command="", name="report.md"):
    """Write ``out/<name>`` (and PNGs) from the CSVs of the earlier suite in ``out`` (``runs.csv``
    and the optional parts); returns the headline dict."""
    out = Path(out)
    runs = out / "runs.csv"
    machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
    md = ["# granii benchmark on this machine\n"]
    md.append(_machine_section(machine, command))
    md.append(METHOD)
    h = {}
    if runs.exists():
        df = load_runs(runs)
        cf = configs(df)
        hf = heuristics(cf)
        h = headline(cf, hf)
        write_configs(cf, hf, out / "configs.csv")
        md.append(_summary(h, cf, machine))
        md.append(_coverage(cf))
        md.append("## Speedup over DGL per model (Table III analogue)\n\n"
                  f"Geometric mean over configurations (graphs x sizes) of DGL's time over granii's "
                  f"for {ITERATIONS} iterations, first-call overheads included (bold); `steady` "
                  "compares the steady-state medians only, `steady (min)` the fastest rounds (a "
                  "check against preemption noise). `configs`: optimized / measured. "
                  + _noise_note(cf) + "\n\n")
        md.append(table_iii(cf))
        pyg = table_pyg(cf)
        if pyg:
            md.append("\n### PyG beside DGL and granii\n\nGeometric means of time ratios "
                      "(above 1: PyG is slower). PyG layers run on `edge_index` without compiled "
                      "extensions (torch scatter).\n\n" + pyg)
        elif machine.get("pyg"):
            md.append(f"\nPyG column: {machine['pyg']}\n")
        files = plot_speedups(cf, out)
        md.append("\n## Speedup per graph and sizes (Figure 8 analogue)\n\n"
                  "Bars: granii over DGL for 100 iterations with first-call overhead, per "
                  "k_in\u2192k_out; log scale, the line is 1.\n\n")
        md += [f"![{f}]({f})\n\n" for f in files]
        md.append("## Plan selection against the measured optimum and single-factor heuristics "
                  "(Table VI analogue)\n\n"
                  "Geometric-mean steady-state speedup over DGL of: the fastest promoted plan "
                  "(optimum, each plan with its best measured kernel implementations), granii's "
                  "choice (plan and implementations as selected, run by the same harness), "
                  "granii's plan with its best implementations, and the plan picked by knowing only "
                  "the sizes (`config only`: best on average across graphs for each (k_in, k_out)), "
                  "only the graph (`graph only`: best on average across sizes) or nothing "
                  "(`static`). The heuristics are fitted on the same measurements they are scored "
                  "on, so they are optimistic. Regret: chosen plan's time / fastest plan's time.\n\n")
        md.append(table_vi(hf))
        slow, n_slow = slower_list(cf)
        md.append(f"\n## Configurations where granii is slower than DGL ({n_slow})\n\n"
                  "Speedup below 1 for 100 iterations with overheads. `chosen` is granii's plan, "
                  "`fastest` the fastest promoted plan measured.\n\n")
        md.append(slow if n_slow else "None.\n")
        ctab, fails = checks(cf)
        md.append("\n## Correctness\n\nOnce per configuration: outputs (inference) or outputs and "
                  "every parameter gradient (training) of the granii copy against DGL's layer, "
                  "`assert_close(rtol=1e-4, atol=1e-4 x max|ref|)`.\n\n" + ctab)
        if len(fails):
            md.append("\nFailures:\n\n" + table(
                ["model", "graph", "sizes", "mode"],
                [[r.model, r.graph, f"{r.k_in}->{r.k_out}", r["mode"]] for _, r in fails.iterrows()]))
        nop = not_optimized(cf)
        if nop:
            md.append("\n## Not optimized\n\nLayers granii ran with DGL's own forward (recorded, "
                      "timed as DGL and PyG only):\n\n" + nop)
    md.append(_e2e_section(out))
    md.append(_overhead_section(out))
    md.append(_memory_section(out))
    (out / name).write_text("".join(md))
    return h


METHOD = """
## How it is measured

* Each configuration is one layer (model, graph, k_in, k_out) in inference (forward under
  `no_grad`) or training (forward, backward of `(out * R).sum()`, Adam step). Features are a fixed
  random N x k_in tensor that needs no gradient (a first layer): granii may reuse work that
  depends only on the graph and the features across iterations.
* OpenMP threads sleep at barriers (`OMP_WAIT_POLICY=PASSIVE`, set by the suite unless given):
  with the default spinning, any other busy process on the 2 cores makes 2-thread runs of both
  DGL and granii many times slower, and the comparison meaningless.
* DGL's layer, the granii copy of it (`copy.deepcopy` + `granii(layer, g, x)`, same weights), PyG's
  layer and every promoted plan of the layer run side by side in one process, 2 threads, one
  round per candidate in turn; one warm-up round, then the median of the rounds (at least 3; at
  most 15, 7 with `--quick`; fewer once the rounds after the third exceed the configuration's time
  budget, 0.5 s, 0.25 s with `--quick`). On graphs of more than 5 M edges only DGL and granii
  are timed (no plans, no PyG: minutes per configuration on two cores), so they count in the
  speedups but not in the regret.
* `100 it.` = first call + 99 x steady median. The first call is measured once, on a fresh copy of
  the layer and a fresh copy of the graph: for granii it holds `granii(...)` itself (frontend,
  featurize, select, compile, once-per-graph precompute) and, in training, the first step.
"""


def _summary(h, cf, machine):
    if not h.get("configs_total"):
        return ""
    left = machine.get("configs_left_for_time")
    lines = [
        "## Summary\n",
        f"* {h['configs_optimized']} of {h['configs_total']} layer configurations optimized by "
        "granii" + (f"; {left} more were planned but left out for the time budget" if left else ""),
        f"* speedup over DGL, 100 iterations with all overheads, geometric mean: inference "
        f"**{fmt(h['speedup_inference'])}**, training **{fmt(h['speedup_training'])}**, both "
        f"**{fmt(h['speedup_all'])}** (steady state only: {fmt(h['steady_inference'])} / "
        f"{fmt(h['steady_training'])})",
    ]
    if "regret_geomean" in h:
        lines.append(f"* selection regret (chosen plan / fastest plan, steady): geometric mean "
                     f"{fmt(h['regret_geomean'])}, worst {fmt(h['regret_worst'])}")
    opt = cf[cf.optimized]
    elig = opt.fastest_eligible.dropna() if "fastest_eligible" in opt else []
    if len(elig):
        outside = opt[opt.fastest_eligible == False]  # noqa: E712 - NaN means unknown
        per_mode = ", ".join(f"{m} {int((outside['mode'] == m).sum())}" for m in MODES)
        lines.append(f"* the fastest plan was one granii does not consider for the size scenario "
                     f"(promoted only for the other k_in vs k_out case) in {len(outside)} of "
                     f"{len(elig)} configurations ({per_mode})")
    lines.append(f"* slower than DGL: {int((opt.speedup < 1).sum())} configurations; slowest "
                 f"{h.get('slowest', '-')}")
    if "largest_first_call_overhead" in h:
        lines.append(f"* largest first-call overhead: {h['largest_first_call_overhead']}")
    return "\n".join(lines) + "\n\n"


def _coverage(cf):
    rows = []
    for gname, grp in cf.groupby("graph", sort=False):
        pairs = sorted(set(zip(grp.k_in, grp.k_out)), key=lambda p: (p[0] >= p[1], p))
        rows.append([gname, grp.family.iloc[0], f"{int(grp.nodes.max()):,}",
                     f"{int(grp.edges.max()):,}", len(grp),
                     ", ".join(f"{a}\u2192{b}" for a, b in pairs)])
    return ("## Graphs and sizes measured\n\n" + table(
        ["graph", "family", "nodes", "edges (with loops)", "configurations", "k_in\u2192k_out"],
        rows) + "\n")


def _machine_section(m, command):
    if not m:
        return ""
    omp = m.get("omp") or {}
    lines = [f"* CPU: {m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB; torch "
             f"threads: {m.get('threads')}; OMP_WAIT_POLICY={omp.get('OMP_WAIT_POLICY')}",
             f"* date: {m.get('date')}; duration: {m.get('duration_min', '?')} min; "
             f"1-min load average at start {m.get('load_start')}, at end {m.get('load_end')}",
             "* versions: " + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items()),
             f"* granii: commit {m.get('commit')}; cost model: {m.get('cost_model')}",
             f"* command: `{command or m.get('command', '')}`"]
    return "\n".join(lines) + "\n"


def _csv(out, name):
    """``out/name`` as a DataFrame, or None when that part of the suite did not run."""
    path = out / name
    return pd.read_csv(path) if path.exists() else None


def _e2e_section(out):
    e = _csv(out, "e2e.csv")
    if e is None:
        return ""
    rows = []
    for _, r in e.iterrows():
        rows.append([r.model, r.dataset, f"{r.forward_ms_dgl:.2f}", f"{r.forward_ms_granii:.2f}",
                     fmt(r.forward_ms_dgl / r.forward_ms_granii), f"{r.train_ms_dgl:.2f}",
                     f"{r.train_ms_granii:.2f}", fmt(r.train_ms_dgl / r.train_ms_granii),
                     f"{r.granii_call_ms:.0f}", f"{r.test_acc_dgl:.3f}", f"{r.test_acc_granii:.3f}",
                     f"{r.max_logit_diff:.1e}",
                     f"{r.test_pred_agree:.3f}" if "test_pred_agree" in r else "-",
                     r.status if r.status != "ok" else r.chosen])
    return ("\n## End to end: 2-layer GCN and GAT on Cora and CiteSeer (Table IV analogue)\n\n"
            "GCN: GraphConv(F, 16, relu) -> GraphConv(16, C); GAT: GATConv(F, 8 x 8 heads, elu) -> "
            "GATConv(64, C). No dropout; Adam lr 0.01, weight decay 5e-4; the same initial weights; "
            f"{int(e.epochs.iloc[0])} epochs alternating DGL and granii epoch by epoch. Times are "
            "medians (ms); `granii() ms` is the one-off call; accuracy on the test split after the "
            "same training.\n\n"
            + table(["model", "dataset", "forward DGL", "forward granii", "speedup",
                     "epoch DGL", "epoch granii", "speedup", "granii() ms", "test acc DGL",
                     "test acc granii", "max logit diff", "same prediction", "plans / status"],
                    rows))


def _overhead_section(out):
    ov = _csv(out, "overhead.csv")
    if ov is None:
        return ""
    png = plot_overhead(ov, out)
    rows = [[r.graph, f"{int(r.edges):,}", f"{r.prepare_ms:.1f}", f"{r.index_ms:.1f}",
             f"{r.features_ms:.1f}", f"{r.select_ms:.2f}", f"{r.compile_ms:.2f}",
             f"{r.granii_first_ms:.1f}", f"{r.dgl_first_ms:.1f}", f"{r.dgl_steady_ms:.1f}",
             f"{(r.granii_first_ms - r.dgl_first_ms) / r.dgl_steady_ms:.1f}"]
            for _, r in ov.iterrows()]
    return ("\n## Overheads vs graph size\n\n"
            f"GCN 32->128 with cost model `{ov.cost_model.iloc[0]}`; medians (ms) on fresh graphs. "
            "`prepare`: frontend to plans and binding; `index`: CSR and degrees; `featurize`: graph "
            "features; `select`: ranking the plans; `compile`: the chosen plan's code; `first "
            "call`: all of it with the first forward, against DGL's first forward. Last column: the "
            "extra first-call time in DGL steady iterations.\n\n"
            + table(["graph", "edges", "prepare", "index", "featurize", "select", "compile",
                     "granii first call", "DGL first call", "DGL steady", "extra / steady"], rows)
            + f"\n![overhead]({png})\n")


def _memory_section(out):
    m = _csv(out, "memory.csv")
    if m is None:
        return ""
    rows = []
    for key, grp in m.groupby(["model", "graph", "k_in", "k_out", "mode"], sort=False):
        by = {r.candidate: r for _, r in grp.iterrows()}
        d, g = by.get("dgl"), by.get("granii")

        def cell(r):
            if r is None:
                return "-"
            return f"{r.extra_mb:.0f}" if r.status == "ok" else str(r.status)[:60]
        ratio = (g.extra_mb / d.extra_mb if d is not None and g is not None and g.status == "ok"
                 and d.extra_mb > 0 else np.nan)
        rows.append([key[0], key[1], f"{key[2]}->{key[3]}", key[4], cell(d), cell(g), fmt(ratio)])
    return ("\n## Peak memory\n\nExtra peak resident memory (MB) over the resident memory just "
            "before running 3 iterations (for granii: `granii(...)` and 3 iterations), RSS sampled "
            "every 0.5 ms. One process per (model, graph, sizes) with granii and its cost models "
            "loaded first; each candidate gets a fresh graph object and layer, and the memory of the "
            "previous one is returned to the system before its baseline. granii's includes its "
            "once-per-graph structures. A few MB are noise.\n\n"
            + table(["model", "graph", "sizes", "mode", "DGL MB", "granii MB", "granii / DGL"],
                    rows))


__all__ = ["write", "configs", "heuristics", "headline", "geomean"]
