"""granii's per-input choice against fixed rules fitted on other graphs (leave one graph out).

    python -m scripts.selection_rules [--threads 2] [--metric min_times]

Reads the candidate timings of ``python -m scripts.validate_costmodels selection --measure``
(``results/costmodels/selection_times.jsonl``: for each layer, graph, size pair and mode, every
candidate plan with every kernel implementation, pruned plans included, and DGL's own layer, timed
side by side). For each configuration the *oracle* is the fastest of all of them, and

    regret(rule) = time(plan the rule picks) / time(oracle)

Rules, each fitted without the graph it is scored on (leave one graph out):

* ``granii``      the plan granii's cost model ranks first for this input (no fitting);
* ``granii + trial`` what granii keeps after its measured tie-break on the first calls
                  (``select.trial_candidates`` and DGL's own layer take turns, the fastest stays),
                  emulated with this configuration's timings: in training these are forward +
                  backward, while granii times the forward only, so this column is the tie-break
                  as if it saw the whole step;
* ``per model``   one plan per (layer, mode): the lowest geometric-mean regret on the other graphs;
* ``per sizes``   one plan per (layer, mode, k_in, k_out), fitted the same way;
* ``nearest graph`` the plan fastest on the other graph closest in edge count (same layer, mode, sizes);
* ``DGL layer``   DGL's own layer, always.

Sampled blocks (``<graph>/block<i>``, see ``validate_costmodels.study_graph``) are scored as
granii runs on them: ``granii`` is the plan ranked on the first block of that graph (same layer,
sizes and mode), ``granii + trial`` the winner of its tie-break timed on the second block, both
kept for every later block. Fixed rules for a block are fitted on the blocks of the other graphs.

A rule's plan that was not timed on a configuration (it failed there) counts as the worst timed
candidate. Candidates whose generated programs are the same (two association trees that fuse to
one plan) are one candidate, timed as the mean of the copies (``merge_same_code``); the spread
between copies measures the noise. Writes ``selection_rules_<threads>t.md`` (summary per layer and
mode, how often the fastest candidate was a plan pruning removed, in all and by more than that
noise, and how much slower the fastest promoted plan was then, and a map of granii's choices over
graphs and sizes)
and ``selection_rules_<threads>t.csv``.
"""
import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.csvfile import write_csv  # noqa: E402
from granii.learned import default_cost_model  # noqa: E402
from granii.select import rank, trial_candidates  # noqa: E402
from granii.plan import compile_plan  # noqa: E402
from scripts.validate_costmodels import (_canonical, _key_text, base_graph,  # noqa: E402
                                         block_index, candidates, make_layer, mode_flags,
                                         prepared, study_graph, timed_candidates)

DGL = "dgl-layer"
RULES = ("granii", "granii + trial", "per model", "per sizes", "nearest graph", "DGL layer")


def geomean(xs):
    xs = [x for x in xs if x == x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def load_rows(path, threads, metric):
    """The configurations timed at ``threads``, the last of each, with ``t``: the ``metric``
    times of the candidates the study makes now (``timed_candidates``)."""
    rows, graphs = {}, {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r["threads"] != threads:
            continue
        rows[(r["layer"], r["graph"], r["k_in"], r["k_out"], r["mode"])] = r
    for r in rows.values():
        g = graphs.get(r["graph"])
        if g is None:
            g = graphs[r["graph"]] = study_graph(r["graph"])
        call, _ = prepared(make_layer(r["layer"], r["k_in"], r["k_out"]), g, r["k_in"], r["mode"])
        r["t"], r["spread"] = merge_same_code(timed_candidates(r[metric], call), call)
    return list(rows.values())


_NAME = re.compile(r"\bt\d+\b")
_KEY = re.compile(r"(once_per_(?:input|graph)\(gi, )'[^']*'")


def program(plan, impls):
    """The generated code of ``plan`` with ``impls``, without what does not change what runs
    (the function's name, comments, cache keys, the numbering of temporaries)."""
    _, src = compile_plan(plan, impls)
    body = [ln for ln in src.splitlines()[1:] if not ln.strip().startswith("#")]
    text = _KEY.sub(r"\1''", "\n".join(body))
    names = {}
    return _NAME.sub(lambda m: names.setdefault(m.group(0), f"v{len(names)}"), text)


def merge_same_code(times, call):
    """``(times, spreads)``: candidates whose programs are the same (two association trees that
    fuse to one plan) are one candidate measured several times, so each gets the mean of their
    times; otherwise the fastest of every candidate would be the luckiest of the copies.
    ``spreads``: slowest / fastest time of each such group, the noise of the measurement."""
    cands = candidates(call, pruned=True)
    groups = {}
    for key, (plan, impls) in cands.items():
        k = _key_text(key)
        if k in times:
            groups.setdefault(program(plan, impls), []).append(k)
    out, spreads = dict(times), []
    for keys in groups.values():
        if len(keys) > 1:
            ts = [times[k] for k in keys]
            spreads.append(max(ts) / min(ts))
            out.update({k: sum(ts) / len(ts) for k in keys})
    return out, spreads


def time_of(row, key):
    """Seconds of candidate ``key`` on ``row``; the worst timed candidate if it was not timed."""
    t = row["t"]
    return t.get(key, max(t.values()))


def oracle(row):
    return min(row["t"].values())


def fit(rows, score_rows=None):
    """The candidate key with the lowest geometric-mean regret over ``rows`` (among keys timed on
    all of them)."""
    if not rows:
        return None
    keys = set.intersection(*(set(r["t"]) for r in rows)) - {DGL}
    if not keys:
        keys = set(rows[0]["t"]) - {DGL}
    return min(sorted(keys), key=lambda k: geomean([time_of(r, k) / oracle(r) for r in rows]))


def granii_choices(rows, model):
    """``{row id: key}``: the candidate granii's selector ranks first for each configuration."""
    graphs, out = {}, {}
    for r in rows:
        g = graphs.get(r["graph"])
        if g is None:
            g = graphs[r["graph"]] = study_graph(r["graph"])
        layer = make_layer(r["layer"], r["k_in"], r["k_out"])
        call, _ = prepared(layer, g, r["k_in"], r["mode"])
        ranking = rank(call.compiled.plans, call.gi, call.symbols, model,
                       **mode_flags(r["mode"]))
        c = ranking[0]
        trial = [_key_text((t.plan.index, _canonical(t.plan, t.impls)))
                 for t in trial_candidates(ranking)] + [DGL]
        out[id(r)] = (_key_text((c.plan.index, _canonical(c.plan, c.impls))),
                      f"{c.plan.index}: {c.plan.composition()} "
                      f"[{','.join(sorted({i for i in c.impls if i != 'inline'}))}]", trial)
    return out


def reused(rows):
    """``{row id: (decision row, trial row)}`` for the rows of sampled blocks: granii ranks the
    plans on the first block of a sampler (the lowest block index of the same graph, layer, sizes
    and mode), times its tie-break on the next block, and keeps the winner for every later block:
    the decision a block is scored with is made on other blocks."""
    same = {}
    for r in rows:
        if block_index(r["graph"]) is not None:
            key = (base_graph(r["graph"]), r["layer"], r["k_in"], r["k_out"], r["mode"])
            same.setdefault(key, []).append(r)
    out = {}
    for rs in same.values():
        rs.sort(key=lambda r: block_index(r["graph"]))
        for r in rs:
            out[id(r)] = (rs[0], rs[1] if len(rs) > 1 else rs[0])
    return out


def evaluate(rows, model):
    """One record per configuration: each rule's regret and the oracle's kind. Rules fitted on
    other graphs leave out every block of the scored graph too (``base_graph``)."""
    edges = {g: study_graph(g).num_edges() for g in {r["graph"] for r in rows}}
    chosen = granii_choices(rows, model)
    blocks = reused(rows)
    out = []
    for r in rows:
        others = [o for o in rows if base_graph(o["graph"]) != base_graph(r["graph"])
                  and o["layer"] == r["layer"] and o["mode"] == r["mode"]
                  and (block_index(o["graph"]) is None) == (block_index(r["graph"]) is None)]
        same_sizes = [o for o in others if (o["k_in"], o["k_out"]) == (r["k_in"], r["k_out"])]
        near = None
        if same_sizes:
            near_graph = min({o["graph"] for o in same_sizes},
                             key=lambda g: abs(math.log(edges[g]) - math.log(edges[r["graph"]])))
            near_row = next(o for o in same_sizes if o["graph"] == near_graph)
            near = min((k for k in near_row["t"] if k != DGL), key=near_row["t"].get)
        first, trial_row = blocks.get(id(r), (r, r))
        decided = chosen[id(first)]
        timed = [k for k in decided[2] if k in trial_row["t"]]
        picks = {"granii": decided[0],
                 "granii + trial": min(timed, key=trial_row["t"].get) if timed else decided[0],
                 "per model": fit(others),
                 "per sizes": fit(same_sizes), "nearest graph": near, "DGL layer": DGL}
        best = min(r["t"], key=r["t"].get)
        rec = {k: r[k] for k in ("layer", "graph", "k_in", "k_out", "mode")}
        promoted = [t for k, t in r["t"].items() if not k.startswith("p")]
        cost = min(promoted) / oracle(r) if promoted else float("nan")
        rec.update(oracle=best, oracle_pruned=cost > 1, granii_plan=decided[1],
                   candidates=len(r["t"]), pruning_cost=cost,
                   spread=max(r["spread"]) if r["spread"] else float("nan"))
        for rule, key in picks.items():
            rec[rule] = time_of(r, key) / oracle(r) if key is not None else float("nan")
        out.append(rec)
    return out


def noise(recs):
    """The 90th percentile of the spread between copies of one program (``merge_same_code``):
    time differences below it are within the measurement's noise."""
    spreads = sorted(e["spread"] for e in recs if e["spread"] == e["spread"])
    return spreads[int(0.9 * (len(spreads) - 1))] if spreads else 1.0


def summary_lines(recs):
    groups = {}
    for e in recs:
        groups.setdefault((e["layer"], e["mode"]), []).append(e)
    floor = noise(recs)
    head = "| layer | mode | n | " + " | ".join(f"{r} geomean / worst" for r in RULES) + \
        f" | fastest was pruned (by more than the noise, {floor:.2f}x) | " \
        "fastest promoted / fastest, worst |"
    lines = [head, "|---|---|---:|" + "---:|" * len(RULES) + "---:|---:|"]
    for (layer, mode), es in sorted(groups.items()) + [(("**all**", ""), recs)]:
        cells = []
        for rule in RULES:
            v = [e[rule] for e in es if e[rule] == e[rule]]
            cells.append(f"{geomean(v):.3f} / {max(v):.2f}" if v else "-")
        pruned = sum(e["oracle_pruned"] for e in es)
        beyond = sum(e["pruning_cost"] > floor for e in es)
        cost = [e["pruning_cost"] for e in es if e["pruning_cost"] == e["pruning_cost"]]
        lines.append(f"| {layer} | {mode} | {len(es)} | " + " | ".join(cells) +
                     f" | {pruned}/{len(es)} ({beyond}) | {max(cost):.2f} |")
    return lines


def versus_lines(recs):
    """Per layer and mode: granii (its prediction alone, and after its tie-break) over the best
    fixed rule (geomean of regrets), and whether it is within 2% of every rule."""
    groups = {}
    for e in recs:
        groups.setdefault((e["layer"], e["mode"]), []).append(e)
    lines = ["| layer | mode | granii / best fixed rule | within 2% | granii + trial / best "
             "fixed rule | within 2% |", "|---|---|---:|---|---:|---|"]
    for (layer, mode), es in sorted(groups.items()) + [(("**all**", ""), recs)]:
        best = min(geomean([e[r] for e in es]) for r in RULES[2:])
        cells = []
        for who in RULES[:2]:
            g = geomean([e[who] for e in es]) / best
            cells += [f"{g:.3f}", "yes" if g <= 1.02 else "no"]
        lines.append(f"| {layer} | {mode} | " + " | ".join(cells) + " |")
    return lines


def map_lines(recs):
    """granii's chosen plan per graph (rows) and size pair (columns), one table per layer/mode."""
    lines = []
    groups = {}
    for e in recs:
        groups.setdefault((e["layer"], e["mode"]), []).append(e)
    for (layer, mode), es in sorted(groups.items()):
        sizes = sorted({(e["k_in"], e["k_out"]) for e in es})
        graphs = sorted({e["graph"] for e in es})
        cell = {(e["graph"], e["k_in"], e["k_out"]): e for e in es}
        lines += ["", f"#### {layer}, {mode}", "",
                  "| graph | " + " | ".join(f"{a}→{b}" for a, b in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for g in graphs:
            row = []
            for a, b in sizes:
                e = cell.get((g, a, b))
                row.append("-" if e is None else f"{e['granii_plan']} ({e['granii']:.2f})")
            lines.append(f"| {g} | " + " | ".join(row) + " |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--metric", default="min_times", choices=("min_times", "times", "cpu_times"))
    ap.add_argument("--times", type=Path, default=ROOT / "results/costmodels/selection_times.jsonl")
    ap.add_argument("--out", type=Path, default=ROOT / "results/costmodels")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows = load_rows(args.times, args.threads, args.metric)
    model = default_cost_model()
    recs = evaluate(rows, model)
    name = f"selection_rules_{args.threads}t"
    write_csv(args.out / f"{name}.csv", recs)
    lines = [f"# Plan choice against fixed rules ({args.threads} thread"
             f"{'s' if args.threads > 1 else ''}, {args.metric})", "",
             f"Generated by `python -m scripts.selection_rules --threads {args.threads} --metric "
             f"{args.metric}` from `{args.times.resolve().relative_to(ROOT)}` ({len(recs)} configurations; "
             f"cost model: {model.name}). Regret = time of the rule's plan / time of the fastest of "
             "every enumerated plan (pruned ones too) with every kernel implementation and DGL's "
             "own layer. Fixed rules are fitted on the other graphs (leave one graph out). "
             "Candidates whose generated programs are the same (association trees that fuse to "
             "one plan) count as one, timed as the mean of their copies; between copies of one "
             f"program the slower took up to {noise(recs):.2f}x the faster's time in 90% of "
             "configurations: the measurement's noise.", ""]
    lines += summary_lines(recs) + ["", "### granii against the best fixed rule", ""]
    lines += versus_lines(recs) + ["", "### Decision map: granii's plan (its regret)"]
    lines += map_lines(recs)
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))


if __name__ == "__main__":
    main()
