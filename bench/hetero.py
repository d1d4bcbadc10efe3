"""RGCN layer benchmark: DGL's RelGraphConv (presorted=False and True) against granii, and
granii's choice against every composition it can run (an oracle).

    python -m bench.hetero [--quick] [--am] [--one-way] [--budget S] [--threads N]
                           [--out results/hetero]

Graphs are *generated with the published statistics* of the RGCN benchmarks
(``granii.hetero_graphs``: AIFB, MUTAG, BGS; AM with ``--am``), each relation with its inverse
(``--one-way``: without), edges sorted by relation (``dgl.to_homogeneous``), so both of DGL's paths are valid. One
RelGraphConv layer, k_in = k_out = 16 (the paper's hidden size) and 64, regularizer none and
basis (B = 30, 40 for BGS and AM as published), self-loop, on learned node embeddings (the
nodes are featureless).

Modes: ``infer`` (no gradients, new features every call), ``train`` (forward and backward of
a step: gradients to the embeddings and weights). ``first`` is granii's first call on a new
graph (index built, machine rates measured once, decision) beside DGL's first call. Two torch
threads, warm-up calls, interleaved rounds (each round times every contender once), medians.
Regret = granii's median / the fastest contender measured (every composition and DGL).

BGS and AM run at k = 16 only, 3 rounds. On AM-sized graphs (1.7 M nodes, 12.8 M edges, 266
relations) only the compositions that fit the machine run (``hetero.not_runnable``: at 24 GiB,
W per (src, rel) or (dst, rel) pair; every node under every relation would take 26 GiB, the
bases-first ones 8-12 GiB), and DGL's training step takes minutes: ``--budget 5`` times every
contender slower than 5 s by its warm-up call alone, which bounds the run.
"""
import argparse
import copy
import csv
import json
import os
import statistics
import sys
import time

import torch
from dgl.nn.pytorch import RelGraphConv

from granii import granii, hetero, hetero_graphs
from .csvfile import write_csv

BASES = {"aifb": 30, "mutag": 30, "bgs": 40, "am": 40}


def _time(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _load():
    return os.getloadavg()[0]


def run_case(name, g, et, reg, k, mode, rounds, log, budget=float("inf")):
    torch.manual_seed(0)
    R = int(et.max()) + 1
    B = BASES[name] if reg == "basis" else None
    layer = RelGraphConv(k, k, R, reg, B, self_loop=True)
    emb = torch.nn.Parameter(torch.randn(g.num_nodes(), k) * 0.1)
    grad_out = torch.randn(g.num_nodes(), k)
    train = mode == "train"

    def call(fn):
        def f():
            if train:
                out = fn(emb)
                out.backward(grad_out)
                emb.grad = None
                layer.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    fn(emb + 0.0)                # a new feature tensor each call
        return f

    dgl_fwd = RelGraphConv.forward
    contenders = {
        "dgl presorted=False": call(lambda x: dgl_fwd(layer, g, x, et, presorted=False)),
        "dgl presorted=True": call(lambda x: dgl_fwd(layer, g, x, et, presorted=True)),
    }
    # first calls on a new graph object (nothing cached): DGL's, and granii's on a copy
    fresh = copy.deepcopy(layer)
    t_first_dgl = _time(call(lambda x: dgl_fwd(layer, copy.deepcopy(g), x, et, presorted=True)))
    g_new = copy.deepcopy(g)
    granii(fresh, g_new, emb.detach(), extra_args=(et,), inspect_now=False)
    t_first = _time(call(lambda x: fresh(g_new, x, et, presorted=True)))
    # steady state: granii wraps the layer itself (DGL's contenders call the class's forward)
    granii(layer, g, emb.detach(), extra_args=(et,), inspect_now=False)
    wrapped = layer
    contenders["granii"] = call(lambda x: wrapped(g, x, et, presorted=True))
    idx = hetero.relational_index(g, et, R)
    kept = hetero.runnable(hetero.plans_for(reg)[0], idx.sizes(), k, k, B or 1, reg)
    for plan in kept:
        contenders["plan " + hetero.plan_name(plan)] = call(
            lambda x, p=plan: hetero._rel_run(hetero.RelState("x", layer), p, idx, layer, g, x,
                                              et, None, True, (), {}))
    # settle granii's measured tie-break before timing it (its candidates take turns)
    settle = 0
    while settle < 16:
        contenders["granii"]()
        settle += 1
        st = wrapped.forward.state
        if st.tuned is not None:
            break
    # warm-up; a contender slower than the budget is timed by its warm-up call alone
    times = {c: [_time(f)] for c, f in contenders.items()}
    once = {c for c, ts in times.items() if ts[0] > budget}
    times = {c: (ts if c in once else []) for c, ts in times.items()}
    for r in range(rounds):
        for c, f in contenders.items():
            if c not in once:
                times[c].append(_time(f))
        log(f"    round {r + 1}/{rounds} done")
    med = {c: statistics.median(ts) for c, ts in times.items()}
    st = wrapped.forward.state
    chosen = st.last[3] if st.last else None
    chosen = "dgl (original forward)" if chosen == hetero.ORIGINAL else (
        hetero.plan_name(chosen) if chosen else "?")
    pick = hetero.plan_name(st.last[2][0][0]) if st.last and st.last[2] else ""
    granii.restore(layer)
    return med, chosen, pick, t_first, t_first_dgl, once


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="AIFB and MUTAG, k=16, 3 rounds")
    ap.add_argument("--am", action="store_true", help="include the AM-sized graph")
    ap.add_argument("--out", default="results/hetero")
    ap.add_argument("--datasets", help="comma-separated subset, e.g. bgs")
    ap.add_argument("--cases", help="only these regularizer:mode cases, e.g. basis:train")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds: a contender whose warm-up call takes longer is timed by that "
                         "call alone (it is then far from the fastest; bounds the AM-sized run)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--one-way", action="store_true",
                    help="graphs without inverse relations (then (src, rel) and (dst, rel) "
                         "pairs differ in number); rows named e.g. aifb-1way")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of other datasets already in the output")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    names = ["aifb", "mutag"] + ([] if a.quick else ["bgs"]) + (["am"] if a.am else [])
    if a.datasets:
        names = a.datasets.split(",")
    label = {n: n + ("-1way" if a.one_way else "") for n in names}
    ks = [16] if a.quick else [16, 64]
    log = lambda s: print(s, flush=True, file=sys.stderr)
    load0 = _load()
    log(f"load average (1 min) at start: {load0:.2f}")
    rows, runs = [], []
    if a.append and os.path.exists(os.path.join(a.out, "hetero.csv")):
        with open(os.path.join(a.out, "hetero.csv")) as f:
            rows = [r for r in csv.DictReader(f) if r["dataset"] not in label.values() or (
                a.cases and f"{r['regularizer']}:{r['mode']}" not in a.cases.split(","))]
        for r in rows:
            r.setdefault("timed_once", "")
            r.setdefault("model_pick", "")
            r.setdefault("dst_pairs_per_edge", r["src_pairs_per_edge"])   # inverse graphs
            for c in ("dgl_presorted_false_ms", "dgl_presorted_true_ms", "granii_ms",
                      "oracle_ms", "regret", "first_call_granii_ms", "first_call_dgl_ms"):
                r[c] = float(r[c])
        with open(os.path.join(a.out, "runs.json")) as f:
            runs = json.load(f) if a.cases else [
                x for x in json.load(f) if set(x["datasets"]) - set(label.values())]
    runs.append({"datasets": list(label.values()), "load_start": load0, "load_end": None,
                 "minutes": 0.0, "threads": a.threads,
                 "note": f"cases {a.cases}" if a.cases else ""})
    t_start = time.time()
    for name in names:
        hg = hetero_graphs.generate(name, seed=0, inverse=not a.one_way)
        g, et = hetero_graphs.relational(hg)
        s = hetero_graphs.stats(g, et)
        log(f"{name}: {s}")
        for k in ks:
            if name in ("bgs", "am") and k > 16:
                continue
            rounds = 3 if a.quick or name in ("bgs", "am") else 5
            for reg in (None, "basis"):
                for mode in ("infer", "train"):
                    if a.cases and f"{reg or 'none'}:{mode}" not in a.cases.split(","):
                        continue
                    log(f"  {name} k={k} {reg or 'none'} {mode} ({time.time() - t_start:.0f} s)")
                    med, chosen, pick, t_first, t_first_dgl, once = run_case(
                        name, g, et, reg, k, mode, rounds, log, a.budget)
                    best = min((c for c in med if c != "granii"), key=med.get)
                    rows.append({
                        "dataset": label[name], "nodes": s["nodes"], "edges": s["edges"],
                        "relations": s["relations"],
                        "src_pairs_per_edge": round(s["src_pairs_per_edge"], 3),
                        "dst_pairs_per_edge": round(s["dst_pairs_per_edge"], 3),
                        "regularizer": reg or "none", "k": k, "mode": mode,
                        "dgl_presorted_false_ms": med["dgl presorted=False"] * 1e3,
                        "dgl_presorted_true_ms": med["dgl presorted=True"] * 1e3,
                        "granii_ms": med["granii"] * 1e3, "granii_choice": chosen,
                        "model_pick": pick,
                        "oracle_ms": med[best] * 1e3, "oracle": best,
                        "regret": med["granii"] / med[best],
                        "first_call_granii_ms": t_first * 1e3,
                        "first_call_dgl_ms": t_first_dgl * 1e3,
                        "plans": ";".join(f"{c[5:]}={t * 1e3:.2f}" for c, t in med.items()
                                          if c.startswith("plan ")),
                        "timed_once": ";".join(sorted(once)),
                    })
                    runs[-1]["minutes"] = (time.time() - t_start) / 60
                    save(rows, a.out, runs)
                    log(f"    granii {med['granii'] * 1e3:.2f} ms ({chosen}); DGL "
                        f"{med['dgl presorted=False'] * 1e3:.2f} / "
                        f"{med['dgl presorted=True'] * 1e3:.2f} ms; oracle {best} "
                        f"{med[best] * 1e3:.2f} ms")
    load1 = _load()
    log(f"load average (1 min) at end: {load1:.2f}")
    runs[-1]["load_end"] = load1
    save(rows, a.out, runs)


def save(rows, out, runs):
    """Write the CSV and the report (after every case, so a stopped run keeps its results)."""
    os.makedirs(out, exist_ok=True)
    write_csv(os.path.join(out, "hetero.csv"), rows)
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump(runs, f, indent=1)
    write_md(rows, os.path.join(out, "hetero.md"), runs)


def oracle(r):
    """``(ms, name)``: the fastest of DGL's two paths and every composition timed."""
    cands = {f"plan {k}": float(v) for k, v in
             (item.rsplit("=", 1) for item in r["plans"].split(";") if item)}
    cands["dgl presorted=False"] = r["dgl_presorted_false_ms"]
    cands["dgl presorted=True"] = r["dgl_presorted_true_ms"]
    best = min(cands, key=cands.get)
    return cands[best], best, cands


def choice_regret(r):
    """The kept composition's own time (DGL's, if the original forward was kept) / the
    oracle's."""
    ms, _, cands = oracle(r)
    mine = cands.get("plan " + r["granii_choice"])
    if mine is None:
        mine = r["dgl_presorted_true_ms"] if r["granii_choice"].startswith("dgl") \
            else r["granii_ms"]
    return mine / ms


def pick_regret(r):
    """The cost models' first-ranked composition (before the measured tie-break) / the oracle,
    or ``None`` when the row does not name it."""
    ms, _, cands = oracle(r)
    mine = cands.get("plan " + r.get("model_pick", ""))
    return None if mine is None else mine / ms


def write_md(rows, path, runs):
    lines = [
        "# RGCN layer: DGL's RelGraphConv vs granii",
        "",
        "Graphs **generated with the published statistics** of the RGCN benchmarks (Schlichtkrull",
        "et al. 2018: entities, edges, relations; node-type counts assumed; each relation with its",
        "inverse), by `granii/hetero_graphs.py` -- not the real datasets. One RelGraphConv layer",
        "(k_in = k_out = k, self-loop), learned node embeddings as input. `python -m bench.hetero`;",
        "2 torch threads unless a run says otherwise, medians of interleaved rounds (contenders",
        "of one round run side by side). A load average above about 0.5 at start or end means",
        "other work shared the two cores: times are then inflated and noisy.",
        "Runs (1-minute load average at start and end):",
    ] + [f"- {', '.join(r['datasets'])}: {r['minutes']:.1f} min, load {r['load_start']:.2f} -> "
         + (f"{r['load_end']:.2f}" if r["load_end"] is not None else "(stopped)")
         + (f", {r['threads']} threads" if r.get("threads", 2) != 2 else "")
         + (f" ({r['note']})" if r.get("note") else "") for r in runs] + [
        "",
        "`infer`: no gradients, new features every call. `train`: forward + backward. Times in ms.",
        "oracle = the fastest of DGL's two paths and every composition granii can run, each timed",
        "as a contender of its own. first call = a new graph's first call (granii: index, rates, decision).",
        "",
        "choice regret = the composition granii kept, timed as a contender of its own (no",
        "dispatcher), / the fastest contender: the regret of the choice alone, as Hector reports",
        "it. The wrapped call's regret also carries the dispatcher and the noise of its own rounds.",
        "model's pick = the composition the cost models rank first, before the measured",
        "tie-break (which times it, the next one when predicted within 1.3x, and in inference",
        "DGL's forward, on the first calls).",
        "",
        "| graph | (src, rel) / (dst, rel) pairs per edge | W | k | mode | DGL presorted=False | DGL presorted=True | granii | "
        "granii's choice | oracle | choice regret | model's pick regret | wrapped call regret | "
        "vs best DGL | first call granii / DGL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    choice_regrets = []
    for r in rows:
        best_dgl = min(r["dgl_presorted_false_ms"], r["dgl_presorted_true_ms"])
        cr = choice_regret(r)
        choice_regrets.append(cr)
        r["oracle_ms"], r["oracle"], _ = oracle(r)
        r["regret"] = r["granii_ms"] / r["oracle_ms"]
        lines.append(
            f"| {r['dataset']} (N={r['nodes']}, E={r['edges']}, R={r['relations']}) | "
            f"{r['src_pairs_per_edge']} / {r['dst_pairs_per_edge']} | {r['regularizer']} | {r['k']} | {r['mode']} | "
            f"{r['dgl_presorted_false_ms']:.2f} | {r['dgl_presorted_true_ms']:.2f} | "
            f"{r['granii_ms']:.2f} | {r['granii_choice']} | {r['oracle_ms']:.2f} ({r['oracle']}) | "
            f"{cr:.2f}x | {_x(pick_regret(r))} | {r['regret']:.2f}x | "
            f"{best_dgl / r['granii_ms']:.2f}x | "
            f"{r['first_call_granii_ms']:.0f} / {r['first_call_dgl_ms']:.0f} |")
    once = [f"{r['dataset']} {r['regularizer']} {r['mode']}: {r['timed_once']}"
            for r in rows if r.get("timed_once")]
    if once:
        lines += ["", "Timed by their warm-up call alone (slower than the run's `--budget`, so far",
                  "from the fastest): " + "; ".join(once) + "."]
    regrets = [r["regret"] for r in rows]
    picks = [x for x in map(pick_regret, rows) if x is not None]
    if picks:
        lines += ["", f"Model's pick regret: median {statistics.median(picks):.2f}x, worst "
                  f"{max(picks):.2f}x over {len(picks)} cases."]
    if regrets:
        lines += ["", f"Choice regret: median {statistics.median(choice_regrets):.2f}x, worst "
                  f"{max(choice_regrets):.2f}x; wrapped call: median "
                  f"{statistics.median(regrets):.2f}x, worst {max(regrets):.2f}x; over "
                  f"{len(regrets)} cases."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


if __name__ == "__main__":
    main()
