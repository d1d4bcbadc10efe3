"""The report of the headline benchmark (``models.csv``, ``layers.csv``) and its plot.

Every figure is a ratio of times measured side by side in one process; a summary over graphs or
sizes is a geometric mean. A configuration whose correctness check failed, or that raised, is
listed and left out of every mean (its ratio is never counted, even where it looks good).
"""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

TASKS = {"train": "full-batch training epoch", "infer": "inference, new features each call",
         "minibatch": "mini-batch training epoch (neighbour sampler)"}
MODEL_ORDER = ["gcn", "gat", "sage", "gin", "sgc", "tagcn"]
LAYER_NAMES = {"gcn": "GraphConv", "sgc": "SGConv", "tagcn": "TAGConv", "gin": "GINConv",
               "sage": "SAGEConv", "gat": "GATConv"}
MODEL_NAMES = {"gcn": "GCN", "gat": "GAT", "sage": "GraphSAGE", "gin": "GIN", "sgc": "SGC",
               "tagcn": "TAGCN"}
# targets (DGL time / granii time)
LAYER_TARGETS = {"gcn": 1.6, "sgc": 1.6, "tagcn": 1.6, "gin": 1.3, "sage": 1.3, "gat": 8.0}
LAYER_FLOOR = 0.95
TASK_TARGETS = {"train": 1.8, "minibatch": 1.5}


def geomean(xs):
    xs = [float(x) for x in xs if x is not None and np.isfinite(x) and x > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def fmt(x, digits=2, suffix="x"):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "-"
    return "-" if not np.isfinite(x) else f"{x:.{digits}f}{suffix}"


def ms(x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "-"
    if not np.isfinite(x):
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _read(path):
    if not Path(path).exists() or Path(path).stat().st_size == 0:
        return None
    df = pd.read_csv(path)
    for c in ("check", "status", "restricted_check"):
        if c not in df:
            df[c] = ""
        df[c] = df[c].fillna("").astype(str)
    return df


def valid(df):
    """Rows that ran and passed their correctness check."""
    return df[(df.status == "ok") & (df.check == "pass")]


# Configurations users do not run: SGC exists to compute A^k X once (``cached=True``); on new
# features each call it runs uncached, which DGL's example never does (10.6x of a 3.17x
# inference headline came from it). Reported apart, never in the headline.
NOT_AS_USERS_RUN = {("infer", "sgc"): "SGC uncached on new features each call",
                    ("new", "sgc"): "SGConv uncached on new features each call"}


def as_users_run(df):
    """Boolean mask of the rows whose configuration users run (``NOT_AS_USERS_RUN``)."""
    col = "task" if "task" in df else "features"
    return ~pd.Series([(a, m) in NOT_AS_USERS_RUN for a, m in zip(df[col], df.model)],
                      index=df.index, dtype=bool)


def valid_restricted(df):
    ok = valid(df)
    return ok[ok.restricted_check == "pass"] if "restricted_check" in ok else ok.iloc[0:0]


def failures(df, what):
    bad = df[(df.status != "ok") | (df.check != "pass")]
    out = []
    for _, r in bad.iterrows():
        where = ", ".join(str(r[c]) for c in what if c in r and str(r[c]) != "nan")
        reason = r.status if r.status != "ok" else (
            f"check {r.check}: max relative error {_sci(r.get('max_rel_err'))} "
            f"({r.get('check_where', 'output')})")
        out.append(f"* {where}: {reason}")
    if "restricted_check" in df:
        ok = df[(df.status == "ok") & (df.check == "pass") & (df.restricted_check == "FAIL")]
        for _, r in ok.iterrows():
            where = ", ".join(str(r[c]) for c in what if c in r and str(r[c]) != "nan")
            out.append(f"* {where}, restricted copy only (left out of the joint gain): max "
                       f"relative error {_sci(r.get('restricted_max_rel_err'))}")
    return out


def _sci(x):
    try:
        return f"{float(x):.1e}"
    except (TypeError, ValueError):
        return "-"


# -- models -----------------------------------------------------------------------------------------
def models_summary(df):
    """``{task: {model: geomean speedup}}`` per task, valid rows only, with ``all`` over the
    configurations users run and ``all_with_others`` over every configuration."""
    ok = valid(df)
    users = ok[as_users_run(ok)]
    out = {}
    for task in TASKS:
        sub = ok[ok.task == task]
        if sub.empty:
            continue
        per = {m: geomean(g.speedup) for m, g in sub.groupby("model")}
        per["all"] = geomean(users[users.task == task].speedup)
        per["all_with_others"] = geomean(sub.speedup)
        out[task] = per
    return out


def headline_table(df):
    s = models_summary(df)
    tasks = [t for t in TASKS if t in s]
    models = [m for m in MODEL_ORDER if any(m in s[t] for t in tasks)]
    rows = []
    for m in models:
        cells = []
        for t in tasks:
            sub = df[(df.task == t) & (df.model == m)]
            n_ok = len(valid(sub))
            if not len(sub):
                cells.append("-")
            elif (t, m) in NOT_AS_USERS_RUN:
                cells.append(f"({fmt(s[t].get(m))}, not as users run it)")
            else:
                cells.append(f"**{fmt(s[t].get(m))}** ({n_ok}/{len(sub)})")
        rows.append([MODEL_NAMES.get(m, m)] + cells)
    rows.append(["**all, as users run them (geomean)**"]
                + [f"**{fmt(s[t]['all'])}**" for t in tasks])
    rows.append(["all, with the configurations users do not run"]
                + [fmt(s[t]["all_with_others"]) for t in tasks])
    rows.append(["target"] + [fmt(TASK_TARGETS[t]) if t in TASK_TARGETS else "-" for t in tasks])
    return table(["model"] + [TASKS[t] for t in tasks], rows)


def task_detail(df, task):
    sub = df[df.task == task]
    if sub.empty:
        return ""
    rows = []
    for _, r in sub.iterrows():
        bad = r.status != "ok" or r.check != "pass"
        first = f"{ms(r.get('dgl_first_ms'))} / {ms(r.get('granii_first_ms'))}"
        warm = f"{ms(r.get('dgl_first_warm_ms'))} / {ms(r.get('granii_first_warm_ms'))}"
        if str(r.get("first_call", "")) == "warm process":
            first += " (warm)"
        row = [MODEL_NAMES.get(r.model, r.model), r.graph, ms(r.get("dgl_ms")),
               ms(r.get("granii_ms")), first, warm]
        if task == "minibatch":
            row += [f"{ms(r.get('dgl_sampling_ms'))}", fmt(r.get("speedup_model")),
                    ms(r.get("skeleton_ms")), fmt(r.get("ceiling")), fmt(r.get("ceiling_src"))]
        row += [("~~" + fmt(r.speedup) + "~~ FAIL") if bad else f"**{fmt(r.speedup)}**",
                fmt(r.get("speedup_steady")), fmt(r.get("joint_gain")),
                f"{int(r.rounds) if r.get('rounds') == r.get('rounds') else '-'}",
                str(r.get("optimized", "-"))]
        rows.append(row)
    unit = {"train": "epoch ms", "infer": "call ms", "minibatch": "epoch ms"}[task]
    total = {"train": "200 epochs", "infer": "100 calls", "minibatch": "10 epochs"}[task]
    header = ["model", "graph", f"DGL {unit}", f"granii {unit}",
              "first DGL / granii ms, fresh process", "in the benchmark's process"]
    if task == "minibatch":
        header += ["sampling ms", "without sampling", "skeleton epoch ms",
                   "family ceiling (plans on torch's GEMM)", "family ceiling, projecting sources"]
    header += [f"speedup ({total})", "steady", "joint gain", "rounds", "layers optimized"]
    return table(header, rows)


def joint_table(models_df, layers_df):
    rows = []
    if models_df is not None:
        ok = valid_restricted(models_df)
        for m in [m for m in MODEL_ORDER if m in set(ok.model)]:
            cells = []
            for t in TASKS:
                sub = ok[(ok.model == m) & (ok.task == t)]
                cells.append(fmt(geomean(sub.joint_gain)) if len(sub) else "-")
            rows.append([f"{MODEL_NAMES.get(m, m)} ({LAYER_NAMES[m]})"] + cells)
    header = ["model (layer)"] + [TASKS[t] for t in TASKS]
    names = {f"{MODEL_NAMES.get(m, m)} ({LAYER_NAMES[m]})": m for m in MODEL_ORDER}
    if layers_df is not None:
        ok = valid_restricted(layers_df[layers_df.features == "new"])
        header.append("single layer, new features")
        by = {m: geomean(g.joint_gain) for m, g in ok.groupby("model")}
        for r in rows:
            r.append(fmt(by.get(names.get(r[0]))))
    header.append("configurations where granii chose a native kernel")
    for r in rows:
        m, used, n = names.get(r[0]), 0, 0
        for d in (models_df, layers_df):
            if d is not None and "granii" in d:
                sub = valid(d[d.model == m])
                n += len(sub)
                used += int(sub.granii.fillna("").astype(str).str.contains("native").sum())
        r.append(f"{used}/{n}")
    return table(header, rows) if rows else ""


# -- single layers ----------------------------------------------------------------------------------
def _col(df, name, old=None):
    """Column ``name`` (or, in a CSV of older code, ``old``) as floats; NaN where absent."""
    for c in (name, old):
        if c and c in df:
            return pd.to_numeric(df[c], errors="coerce")
    return pd.Series(np.nan, index=df.index)


def layers_summary(df):
    ok = valid(df)
    out = {}
    for m, g in ok.groupby("model"):
        d = {}
        for f in ("new", "same"):
            s = g[g.features == f]
            d[f] = geomean(s.speedup)
            d[f"{f}_worst"] = float(s.speedup.min()) if len(s) else float("nan")
            d[f"{f}_n"] = len(s)
        s = g[g.features == "new"]
        d["family_ceiling"] = geomean(_col(s, "family_ceiling", "ceiling"))
        d["beats_family"] = int((_col(s, "granii_ms") < _col(s, "family_floor_ms",
                                                             "floor_ms")).sum())
        d["bound_ceiling"] = geomean(_col(s, "bound_ceiling"))
        d["steady"] = geomean(s.speedup_steady)
        out[m] = d
    return out


def layers_table(df):
    s = layers_summary(df)
    rows = []
    for m in [m for m in MODEL_ORDER if m in s]:
        d, t = s[m], LAYER_TARGETS.get(m)
        apart = ("new", m) in NOT_AS_USERS_RUN
        meets = ("yes" if d["new"] >= t and d["new_worst"] >= LAYER_FLOOR else "no") if t else "-"
        n_all = len(df[(df.model == m) & (df.features == "new")])
        below = valid(df[(df.model == m) & (df.features == "new")]).speedup < LAYER_FLOOR
        new_cell = f"({fmt(d['new'])}, not as users run it)" if apart else f"**{fmt(d['new'])}**"
        rows.append([LAYER_NAMES[m], new_cell, fmt(d["new_worst"]), int(below.sum()),
                     fmt(d["same"]), fmt(d["same_worst"]),
                     fmt(d["same"] / d["new"]) if d["new"] > 0 else "-",
                     f"{d['new_n']}/{n_all}", fmt(t), "-" if apart else meets,
                     fmt(d["family_ceiling"]), f"{d['beats_family']}/{d['new_n']}",
                     fmt(d["bound_ceiling"])])
    ok = valid(df)
    users = ok[as_users_run(ok)]
    new, same = users[users.features == "new"], users[users.features == "same"]
    rows.append(["**all, as users run them**", f"**{fmt(geomean(new.speedup))}**",
                 fmt(new.speedup.min() if len(new) else float("nan")),
                 int((new.speedup < LAYER_FLOOR).sum()),
                 fmt(geomean(same.speedup)), fmt(same.speedup.min() if len(same) else np.nan),
                 "", f"{len(new)}", f"floor {fmt(LAYER_FLOOR)}", "",
                 fmt(geomean(_col(new, "family_ceiling", "ceiling"))),
                 f"{sum(d['beats_family'] for d in s.values())}/"
                 f"{len(ok[ok.features == 'new'])}",
                 fmt(geomean(_col(new, "bound_ceiling")))])
    every = ok[ok.features == "new"]
    rows.append(["all, with the configurations users do not run",
                 fmt(geomean(every.speedup)), "", "", fmt(geomean(ok[ok.features == "same"]
                                                                  .speedup)),
                 "", "", f"{len(every)}", "", "", "", "", ""])
    return table(["layer", "new features (100 calls)", "worst", f"below {LAYER_FLOOR}x",
                  "same features again", "worst", "what reuse adds", "configs", "target (new)",
                  "met", "family ceiling (DGL / least work of granii's plans)",
                  "granii's steady time below that family floor",
                  "bound ceiling (DGL / true lower bound)"], rows)


def with_bounds(df, out):
    """``bound_ms`` and ``bound_ceiling`` of each row with its work (``bound_bytes``,
    ``bound_macs``) from the run's best rates (``machine.json``, ``bench.bounds.best_of``)."""
    from .bounds import bound_seconds
    p = Path(out) / "machine.json"
    if df is None or "bound_bytes" not in df or not p.exists():
        return df
    rates = json.loads(p.read_text()).get("rates")
    if not rates:
        return df
    df = df.copy()
    nb, macs = (pd.to_numeric(df[c], errors="coerce") for c in ("bound_bytes", "bound_macs"))
    df["bound_ms"] = [bound_seconds(rates, b, m) * 1e3 if np.isfinite(b) and np.isfinite(m)
                      else np.nan for b, m in zip(nb, macs)]
    df["bound_ceiling"] = _col(df, "dgl_ms") / df.bound_ms
    return df


def check_bounds(df, what="layers"):
    """Raise ``AssertionError`` when a measured time beats its row's true lower bound
    (``bound_ms``, ``bench.bounds``): that is a harness bug, never a fast plan. Every candidate's
    fastest round is checked. Returns the number of rows checked."""
    if df is None or "bound_ms" not in df:
        return 0
    bound = pd.to_numeric(df.bound_ms, errors="coerce")
    n, bad = 0, []
    for col in [c for c in df.columns if c.endswith("_min_ms")]:
        t = pd.to_numeric(df[col], errors="coerce")
        has = bound.notna() & t.notna()
        n = max(n, int(has.sum()))
        for i in df.index[has & (t < bound)]:
            r = df.loc[i]
            bad.append(f"{r.model} {r.graph} {r.k_in}->{r.k_out} {r.features}: {col} "
                       f"{t[i]:.4f} ms < bound {bound[i]:.4f} ms")
    assert not bad, (f"{len(bad)} measured time(s) below the true lower bound of their {what} "
                     "row: a harness bug (bench/bounds.py or the timing), not a fast plan:\n  "
                     + "\n  ".join(bad))
    return n


def ablation_table(models_df, layers_df):
    """Steady-time ratios of ``bench.ablation`` per part (geomeans over valid rows)."""
    cols = ["pool_gain_dgl", "plan_gain_pooled", "plan_gain_unpooled", "pool_gain_granii"]
    parts = []
    if models_df is not None:
        ok = valid(models_df)
        parts += [(TASKS[t], ok[ok.task == t]) for t in ("train", "infer")]
    if layers_df is not None:
        ok = valid(layers_df)
        parts.append(("single layers, new features", ok[ok.features == "new"]))
    rows = []
    for name, sub in parts:
        if not len(sub) or "pool_gain_granii" not in sub:
            continue
        vals = {c: geomean(_col(sub, c)) for c in cols}
        if not np.isfinite(vals["pool_gain_granii"]):
            continue
        total = geomean(_col(sub, "speedup_steady"))
        rows.append([name, fmt(total)] + [fmt(vals[c]) for c in cols]
                    + [_share(vals["pool_gain_granii"], total)])
    if not rows:
        return ""
    return table(["part", "DGL / granii (steady)", "DGL / DGL with the pool",
                  "DGL with the pool / granii (plan and kernels)",
                  "DGL / granii without the pool (plan and kernels)",
                  "granii without the pool / granii", "the pool's share of granii's gain"], rows)


def _share(pool, total):
    """``log(pool) / log(total)``: the part of the (log) gain the pool accounts for."""
    if not (np.isfinite(pool) and np.isfinite(total)) or total <= 1:
        return "-"
    return f"{100 * np.log(pool) / np.log(total):.0f}%"


def passive_table(layers_df, passive_df):
    """The PASSIVE row: single layers of the first level under ``OMP_WAIT_POLICY=PASSIVE``
    beside the same configurations of the main run (variable unset)."""
    if layers_df is None or passive_df is None:
        return ""
    key = ["model", "graph", "k_in", "k_out", "features"]
    a, b = valid(layers_df), valid(passive_df)
    both = a.merge(b, on=key, suffixes=("", "_passive"))
    both = both[both.features == "new"]
    if both.empty or "speedup_warm" not in both or "speedup_warm_passive" not in both:
        return ""
    rows = []
    for m, g in both.groupby("model"):
        rows.append([LAYER_NAMES.get(m, m), str(len(g)), fmt(geomean(g.speedup_warm)),
                     fmt(geomean(g.speedup_warm_passive)), fmt(g.speedup_warm.min()),
                     fmt(g.speedup_warm_passive.min()),
                     fmt(geomean(_col(g, "dgl_ms") / _col(g, "dgl_ms_passive"))),
                     fmt(geomean(_col(g, "granii_ms") / _col(g, "granii_ms_passive")))])
    rows.append(["**all**", str(len(both)), f"**{fmt(geomean(both.speedup_warm))}**",
                 f"**{fmt(geomean(both.speedup_warm_passive))}**", fmt(both.speedup_warm.min()),
                 fmt(both.speedup_warm_passive.min()),
                 fmt(geomean(_col(both, "dgl_ms") / _col(both, "dgl_ms_passive"))),
                 fmt(geomean(_col(both, "granii_ms") / _col(both, "granii_ms_passive")))])
    return table(["layer", "configs", "speedup, variable unset",
                  "speedup, PASSIVE", "worst, unset", "worst, PASSIVE",
                  "DGL steady: unset / PASSIVE", "granii steady: unset / PASSIVE"], rows)


def layers_grid(df):
    """Per layer and graph, the ratio at each size: ``new / same``."""
    sizes = sorted({(int(a), int(b)) for a, b in zip(df.k_in, df.k_out)})
    rows = []
    for (m, gname), g in df.groupby(["model", "graph"], sort=False):
        cells = []
        for ki, ko in sizes:
            c = []
            for f in ("new", "same"):
                r = g[(g.k_in == ki) & (g.k_out == ko) & (g.features == f)]
                if r.empty:
                    c.append("-")
                else:
                    r = r.iloc[0]
                    bad = r.status != "ok" or r.check != "pass"
                    c.append("FAIL" if bad else fmt(r.speedup, 2, ""))
            cells.append(" / ".join(c))
        rows.append([LAYER_NAMES.get(m, m), gname] + cells)
    return table(["layer", "graph"] + [f"{a}→{b}" for a, b in sizes], rows)


# -- plot -------------------------------------------------------------------------------------------
def plot(models_df, layers_df, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    panels = (models_df is not None) + (layers_df is not None)
    if not panels:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax_i = 0
    if models_df is not None:
        ax = axes[0][ax_i]
        ax_i += 1
        s = models_summary(models_df)
        tasks = [t for t in TASKS if t in s]
        models = [m for m in MODEL_ORDER if any(m in s[t] for t in tasks)]
        w = 0.8 / max(len(tasks), 1)
        for j, t in enumerate(tasks):
            vals = [s[t].get(m, np.nan) for m in models]
            ax.bar(np.arange(len(models)) + j * w, vals, w, label=TASKS[t])
        ax.set_xticks(np.arange(len(models)) + w * (len(tasks) - 1) / 2)
        ax.set_xticklabels([MODEL_NAMES.get(m, m) for m in models])
        ax.axhline(1.0, color="black", lw=0.8)
        for t, target in TASK_TARGETS.items():
            if t in tasks:
                ax.axhline(target, color=f"C{tasks.index(t)}", lw=0.8, ls="--")
        ax.set_ylabel("DGL time / granii time (geomean over graphs)")
        ax.set_title("DGL's example models")
        ax.legend(fontsize=7)
    if layers_df is not None:
        ax = axes[0][ax_i]
        s = layers_summary(layers_df)
        ms_ = [m for m in MODEL_ORDER if m in s]
        x = np.arange(len(ms_))
        ax.bar(x - 0.2, [s[m]["new"] for m in ms_], 0.4, label="new features each call")
        ax.bar(x + 0.2, [s[m]["same"] for m in ms_], 0.4, label="same features again")
        ax.scatter(x - 0.2, [LAYER_TARGETS[m] for m in ms_], marker="_", s=300, color="red",
                   label="target (new features)", zorder=3)
        ax.set_xticks(x)
        ax.set_xticklabels([LAYER_NAMES[m] for m in ms_])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks([0.5, 1, 1.5, 2, 3, 5, 8, 12])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("DGL time / granii time, 100 calls (geomean)")
        ax.set_title("Single layers")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out) / "headline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _noise_line(df, col, names):
    """Geomeans of the steady ratios of medians and of fastest rounds: where they differ much,
    other processes disturbed the rounds."""
    ok = valid(df)
    if "speedup_min" not in ok:
        return ""
    cells = [f"{names[k]} {fmt(geomean(g.speedup_steady))} / {fmt(geomean(g.speedup_min))}"
             for k, g in ok.groupby(col) if k in names]
    return ("\nSteady state only, ratio of medians / ratio of the fastest rounds (a check against "
            "preemption by other processes): " + "; ".join(cells) + ".\n")


def _rates_line(out):
    p = Path(out) / "machine.json"
    try:
        r = json.loads(p.read_text())["rates"]
    except (OSError, KeyError, ValueError):
        return "rates not recorded"
    bw = [float(v) for v in r["bandwidth"].values()]
    return (f"GEMM {float(r['gemm_macs']) / 1e9:.1f} G multiply-adds/s, streaming "
            f"{min(bw) / 1e9:.1f} GB/s (256 MiB) to {max(bw) / 1e9:.1f} GB/s (in cache)")


# -- the report -------------------------------------------------------------------------------------
def _others(*dfs):
    vals = [v for d in dfs if d is not None and "others_cores" in d
            for v in pd.to_numeric(d.others_cores, errors="coerce") if np.isfinite(v)]
    return (float(np.median(vals)), float(np.max(vals))) if vals else (float("nan"),) * 2


def machine_lines(out):
    p = Path(out) / "machine.json"
    if not p.exists():
        return ""
    m = json.loads(p.read_text())
    v = m.get("versions", {})
    lines = [f"* CPU: {m.get('cpu')}, {m.get('cores')} cores; torch threads: {m.get('threads')}; "
             "OMP_WAIT_POLICY=" + ((m.get('omp') or {}).get('OMP_WAIT_POLICY')
                                   or "unset (as in a user's process)"),
             f"* date: {m.get('date')}; duration: {m.get('duration_min', '?')} min; 1-min load "
             f"average at start {m.get('load_start')}, at end {m.get('load_end', '?')}",
             f"* versions: " + ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "dgl") if k in v),
             f"* granii: commit {m.get('commit')}; cost model: {m.get('cost_model')}; native "
             f"kernels: {m.get('native', '?')}",
             f"* command: `{m.get('command', '')}`"]
    if m.get("note"):
        lines.append(f"* note: {m['note']}")
    return "\n".join(lines) + "\n"


HOW = """\
## How it is measured

* Models are DGL's examples in their own shapes (`bench/examples.py`): dropout where the example has
  it, `GATConv` with 8 heads, GraphSAGE with the mean aggregator, 2 layers where the example has 2
  (GIN: its 4 GIN layers, whose sum-pooling readout granii leaves to DGL). Graphs: Cora and
  CiteSeer with their Planetoid features, labels and split; PubMed and GitHub (the largest graph
  shipped, 37,700 nodes and 615,706 edges with loops) with random features (500 and 128 wide) and
  labels. One self-loop per node everywhere.
* DGL's model and the same model after `granii(model, g, x)` (`copy.deepcopy` of one model built
  with a fixed seed: the same weights) run side by side in one process, 2 torch threads, one
  round per candidate in turn; each has its own copy of the graph. Ratios are DGL's time over
  granii's.
* Environment: as a user's process has it: 2 torch threads, `OMP_WAIT_POLICY` unset (the
  `PASSIVE` section is the exception, in a child process of its own).
* Totals count every call: the first call, every call measured after it (granii's first calls
  include its measured tie-break, where candidate plans and the layer's own forward take turns),
  and the steady median for calls not measured. `steady` compares the medians of the rounds after
  granii has settled (the same rounds for both).
* First calls are timed in a fresh process (`bench/fresh.py`): a process that has imported torch,
  DGL, granii and the benchmark's modules and done nothing else (no tensor operation, no OpenMP
  region) forks one child per candidate and configuration; the child first copies every page it
  shares with that process (a forked child otherwise pays a copy at its first write to each page,
  which a process started on its own never pays: 3-6 ms more of DGL's first calls and 12-15 ms of
  granii's on Cora, 2 layers), then loads the graph, builds the
  model with the benchmark's seeds and times DGL's first forward, or `granii(model, g, x)` with
  its default cost model (loaded by that call) plus the first forward. Nothing the child filled
  (parse, enumeration, calibration and cost-model caches, torch's and DGL's lazy state)
  survives it. The first call timed in the benchmark's own process, after its correctness checks
  had warmed those caches, is kept as `*_first_warm_ms` (the `in the benchmark's process`
  column). For single layers the fresh first call on new features stands for both rows.
* Full-batch training: forward in train mode (dropout on), cross-entropy on the training nodes,
  backward, Adam step; total of 200 epochs (DGL's examples run 200). SGC trains with
  `SGConv(cached=True)` as DGL's example does, so DGL's own reuse is in its time.
* Inference: `model.eval()`, `torch.no_grad()`, and each call on a feature tensor no earlier call
  saw (made outside the timer): nothing that depends on features can be reused, as in every hidden
  layer. Total of 100 calls; granii's first call includes `granii(model, g, x0)` on other
  features. Up to 99 calls are timed, fewer on the larger graphs (a time budget per
  configuration, extended until granii has settled). SGC runs uncached here (DGL's cache would
  return stale results on new features).
* Mini-batch training: `dgl.dataloading.NeighborSampler` + `DataLoader` (batch 1024, shuffled, 4,096
  seed nodes per epoch), the blocks of each batch used once; one epoch per round, sampling
  included (`without sampling` subtracts the time spent in the loader); the first epoch of each
  candidate is timed apart. granii ranks the plans on the first block; the best predicted ones and
  DGL's forward then take turns on the next blocks of the same sampler configuration (forward and
  backward timed, divided by each block's size) and the fastest serves the later blocks. With 4
  batches per epoch these turns span granii's first 3-4 epochs: rounds go on until they have ended
  and 3 rounds are steady. `speedup (10 epochs)`: per epoch of a 10-epoch run (DGL's sampling
  examples train 10), first epochs included: the first, the measured ones, the steady epoch for
  the rest; `steady`: the epochs after the turns.
  `skeleton`: the same epoch with each graph layer reduced to its dense products on the
  destination rows (`bench/skeleton.py`: no aggregation, no attention; sampling, feature gather,
  dropout, loss and optimizer as they are), timed in the same rounds; `family ceiling` = DGL's
  epoch over it: a ceiling of the plans that run their products on torch's GEMM at the speed
  measured there, not a bound on every algorithm. For GAT, `family ceiling, projecting sources`
  is DGL's epoch over a skeleton that projects every source row, as DGL's layer and every GAT
  plan but the per-head ones do.
* Single layers: one layer in inference at `(k_in, k_out)` from {32, 128, 512}; `new features`
  as above, `same features again` passes one tensor every call (granii may keep work on it; for
  SGConv DGL's column is `SGConv(cached=True)` with the same weights). 100 calls, first call
  (with `granii(...)`) included. Run last, level by level of sizes, until the run's time is spent.
  When a configuration's time cap ends the shared rounds before granii's tie-break has settled
  (slow DGL layers get few rounds), granii's copies go on alone until it has (`alone_rounds` in
  `layers.csv`), so the calls of the tie-break do not stand for the later calls in the 100-call
  total; then every candidate runs five more rounds side by side, and these are the steady
  rounds of all.
* Joint gain: the time of a copy whose selection may not use the project's own (`native`) kernels
  (composition chosen among DGL's and torch's kernels only) over granii's time with every kernel,
  both totals with the first call timed in the benchmark's process.
* Correctness: models before timing, on copies: outputs and, in training, the gradient of every
  parameter after one seeded forward and backward (the same dropout masks), and eval outputs on
  new features; single layers after timing, on the very copies timed (a new tensor, and the same
  tensor again). A configuration passes when every difference is within 1e-3 of the largest
  value; a training comparison that fails is made again with the ReLUs between layers replaced
  by GELU (`bench/check.py`: in float32 a value that rounding moves across zero flips a ReLU's
  derivative; a wrong plan still differs under GELU), and passes if that one does. One that
  fails is listed above and left out of every mean.
* The earlier suite (every promoted plan of a layer timed against the chosen one, PyG, overheads
  against graph size) runs with `--parts sweep,overhead,e2e` and writes `sweep.md`; its last
  full results are in the history of this folder (commit cda4efd).
"""


def write(out, command=""):
    """Write ``report.md`` and ``headline.png`` in ``out``; returns the headline figures."""
    out = Path(out)
    models_df = _read(out / "models.csv")
    layers_df = _read(out / "layers.csv")
    passive_df = _read(out / "passive" / "layers.csv")
    layers_df = with_bounds(layers_df, out)
    n_bounds = check_bounds(layers_df)
    png = plot(models_df, layers_df, out)
    md = ["# granii benchmark: DGL's example models as users run them\n\n", machine_lines(out)]
    med, mx = _others(models_df, layers_df)
    if np.isfinite(med):
        md.append(f"* other processes used a median of {med:.2f} cores (max {mx:.2f}) of the 2 "
                  "while configurations were timed\n")
    h = {}
    if models_df is not None:
        s = models_summary(models_df)
        h.update({f"models_{t}": s[t]["all"] for t in s})
        fresh = (models_df.get("first_call", pd.Series(dtype=str)).astype(str)
                 == "fresh process").sum()
        md.append("\n## Headline: DGL time / granii time\n\nGeometric mean over the graphs of "
                  "each model (configurations that passed the correctness check / measured). "
                  "Training: 200 epochs, the first included; inference: 100 calls on new "
                  "features, the first included; mini-batch: per epoch of a 10-epoch run, the first "
                  "included, sampling included. First calls (DGL's first forward; granii's "
                  "`granii(...)` with its default cost model plus its first forward) are timed "
                  f"each in a fresh process ({fresh} of {len(models_df)} configurations; the "
                  "others say `(warm)`). The `all` row counts the configurations as users run "
                  "them; SGC on new features each call (uncached) is shown in brackets and counted "
                  "only in the row below it.\n\n")
        md.append(headline_table(models_df))
        md.append(_noise_line(models_df, "task", TASKS))
        if png:
            md.append(f"\n![headline]({png})\n")
        for task in TASKS:
            d = task_detail(models_df, task)
            if d:
                md.append(f"\n### {TASKS[task][0].upper() + TASKS[task][1:]}\n\n"
                          "Times are medians (ms); `joint gain` is the restricted copy's time over "
                          "granii's (see below).\n\n" + d)
    if layers_df is not None:
        s = layers_summary(layers_df)
        new = valid(layers_df)[valid(layers_df).features == "new"]
        h["layers_new"] = geomean(new.speedup)
        h["layers_new_worst"] = float(new.speedup.min()) if len(new) else float("nan")
        md.append("\n## Single layers: new features each call vs the same features again\n\n"
                  "DGL time / granii time for 100 calls (first call, in a fresh process, "
                  "included), geometric mean over graphs and sizes; `what reuse adds` is the "
                  "ratio of the two columns. SGConv on new features (uncached) is not how users "
                  "run SGC: bracketed, and counted only in the last row.\n\n"
                  "Two ceilings. `family ceiling`: DGL's steady time over the least work of the "
                  "plans granii enumerates, timed in the same rounds (`X W` plus `a` unweighted "
                  "sums over the in-edges at width `min(k_in, k_out)`, `(c, a)` = (2, 1) for "
                  "SAGEConv, (3, 2) for TAGConv(k=2), (1, 2) for SGConv(k=2), (1, 1) for the "
                  "others; `bench/single.py`). It bounds that family at the speed its kernels "
                  "had when timed, not what a plan can do: the next column counts the "
                  "configurations where granii's own steady time was below it. `bound "
                  "ceiling`: DGL's steady time over a true lower bound, the bytes any correct "
                  "algorithm moves (features and indices read once, the result written once) and "
                  "the multiply-adds it must do, at this machine's best measured streaming and "
                  "GEMM rates (`bench/bounds.py`, measured once per run: "
                  + _rates_line(out) + f"). Every candidate's fastest round in {n_bounds} rows "
                  "was checked against it when this report was written; one below it stops the "
                  "report (a harness bug).\n\n")
        md.append(layers_table(layers_df))
        md.append(_noise_line(layers_df, "features", {"new": "new features",
                                                      "same": "same features"}))
        md.append("\nPer configuration (`new / same`):\n\n" + layers_grid(layers_df))
    pt = passive_table(layers_df, passive_df)
    if pt:
        md.append("\n## OMP_WAIT_POLICY=PASSIVE (an extra row; users do not set it)\n\n"
                  "The headline runs with `OMP_WAIT_POLICY` unset, as a user's process has it "
                  "(the OpenMP runtime's workers spin a while after each parallel region). The "
                  "single layers of the first size level ran again in a child process with "
                  "`OMP_WAIT_POLICY=PASSIVE` (workers sleep at once; waking them costs tens of "
                  "microseconds), `passive/`. Speedups of 100 calls with the first call timed in "
                  "the benchmark's process in both runs (the child does not time fresh "
                  "processes), so the two columns compare like with like.\n\n" + pt)
    at = ablation_table(models_df, layers_df)
    if at:
        md.append("\n## The allocator's share\n\ngranii serves large tensors made inside its "
                  "scope from a caching allocator (`granii/kernels/pool.py`), which also serves "
                  "DGL's forward when the tie-break runs it. Two more candidates in the same "
                  "rounds (`bench/ablation.py`): DGL with the same pool around each call (training: "
                  "the whole step), and granii with pooling off. Steady times, geometric means; "
                  "the share is `log(pool's gain to granii) / log(DGL / granii)`.\n\n" + at)
    jt = joint_table(models_df, layers_df)
    if jt:
        md.append("\n## Joint selection vs selection among DGL's and torch's kernels only\n\n"
                  "Time of the copy restricted to DGL's and torch's kernels over granii's time "
                  "(above 1: choosing the composition together with the project's own kernels "
                  "gains that much), geometric mean over graphs (and sizes).\n\n" + jt)
    fails = []
    if models_df is not None:
        fails += failures(models_df, ["model", "graph", "task"])
    if layers_df is not None:
        fails += failures(layers_df, ["model", "graph", "k_in", "k_out", "features"])
    md.append(f"\n## Correctness\n\n{len(fails)} configuration(s) failed their check or raised "
              "and are left out of every mean" + (":\n\n" + "\n".join(fails) + "\n" if fails
                                                   else ".\n"))
    fb = {}
    for d in (models_df, layers_df):
        if d is not None and "fallbacks" in d:
            for _, r in d[d.fallbacks.fillna("").astype(str) != ""].iterrows():
                for reason in str(r.fallbacks).split(" | "):
                    fb.setdefault(reason, []).append(
                        f"{r.model} {r.graph} {r.get('task', r.get('features', ''))}")
    if fb:
        md.append("\nLayers that ran DGL's own forward (the configuration is still measured and "
                  "counted):\n\n" + "\n".join(f"* {reason}: {', '.join(where)}"
                                               for reason, where in fb.items()) + "\n")
    md.append("\n" + HOW)
    (out / "report.md").write_text("".join(md))
    return h


__all__ = ["write", "models_summary", "layers_summary", "geomean", "valid"]
