"""The layer sweep: every (model, graph, k_in, k_out, mode) measured once, rows appended to a CSV.

Resumable: a configuration whose rows are already in the CSV is skipped, so an interrupted run
continues where it stopped (``--fresh`` starts over). Rows of one configuration are written
together after it is measured. Progress is weighted by each configuration's estimated cost
(``graphs.work``), so the time left shown is meaningful while sizes grow. With a deadline the
sweep stops between configurations once it has passed; the levels of ``graphs.LEVELS`` make the
configurations run by then a balanced subset.
"""
import csv
import os
import time
from pathlib import Path

from tqdm import tqdm

from . import graphs as bg
from . import measure as bm
from . import models
from .load import wait_quiet

FIELDS = ["level", "model", "graph", "family", "nodes", "edges", "k_in", "k_out", "mode", "candidate",
          "kind", "status", "steady_ms", "min_ms", "first_ms", "total100_ms", "n_samples", "plan",
          "plan_key", "scenarios", "impls", "impl_tag", "predicted_ms", "chosen", "check", "max_rel_err",
          "cost_model", "others_cores", "load1", "time"]
MODES = ("inference", "training")


def done_configs(path):
    """The ``(model, graph, k_in, k_out, mode)`` already in the CSV at ``path``."""
    if not Path(path).exists():
        return set()
    with open(path, newline="") as f:
        return {(r["model"], r["graph"], int(r["k_in"]), int(r["k_out"]), r["mode"])
                for r in csv.DictReader(f)}


def append_rows(path, rows):
    """Append ``rows``; an existing CSV keeps its own columns (a resumed run of older code)."""
    new = not Path(path).exists() or os.path.getsize(path) == 0
    fields = FIELDS
    if not new:
        with open(path, newline="") as f:
            fields = next(csv.reader(f))
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)


# Above this many edges only DGL and granii are timed (every plan and PyG would take minutes per
# configuration on two cores), so those graphs give speedups but no regret.
BIG_EDGES = 5_000_000


def sweep(path, model_names, specs, cost_model, quick=False, repeat=15, budget=0.5,
          with_pyg=True, deadline=None, quiet_wait=0.0, log=print):
    """Measure every configuration not yet in ``path``, level by level (``graphs.LEVELS``), until
    ``deadline`` (a ``time.time()`` value, or None). Returns ``(measured, left for lack of time)``.
    ``quiet_wait``: before each configuration, wait up to this many seconds for the other
    processes of the machine to fall below a third of a core (``load.wait_quiet``).
    """
    done = done_configs(path)
    graphs_in = {}
    for spec in specs:
        base = spec.factory()
        graphs_in[spec.name] = (spec, base, bg.with_self_loops(base))
    todo = []
    for spec, base, _ in graphs_in.values():
        n, e = base.num_nodes(), base.num_edges()
        for level, pair in bg.size_levels(n, e, quick):
            for model in model_names:
                for mode in MODES:
                    key = (model, spec.name, pair[0], pair[1], mode)
                    if key not in done:
                        weight = bg.work(n, e, *pair) * (3 if mode == "training" else 1) + 2e9
                        todo.append((level, spec.name, key, weight))
    todo.sort(key=lambda t: t[0])           # stable: graphs in suite order within a level
    if not todo:
        log(f"layer sweep: all configurations already in {path}")
        return 0, 0
    bar = tqdm(total=sum(t[3] for t in todo), unit="work", unit_scale=True, smoothing=0.05,
               bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}] {postfix}")
    n_done = 0
    for i, (level, gname, (model, _, k_in, k_out, mode), weight) in enumerate(todo):
        if deadline is not None and time.time() > deadline:
            bar.close()
            log(f"layer sweep: time budget reached at level {level}; {len(todo) - i} "
                "configurations left (run again to resume)")
            return n_done, len(todo) - i
        spec, base, looped = graphs_in[gname]
        g = looped if models.MODELS[model].self_loops else base
        left = f", {(deadline - time.time()) / 60:.0f} min budget left" if deadline else ""
        bar.set_postfix_str(f"L{level} {model} {gname} {k_in}->{k_out} {mode}{left}")
        if quiet_wait:
            wait_quiet(quiet_wait)
        big = g.num_edges() > BIG_EDGES
        rows = bm.measure(model, gname, spec.family, g, k_in, k_out, mode == "training",
                          cost_model, repeat=repeat, budget=budget, with_plans=not big,
                          with_pyg=with_pyg and not big)
        for r in rows:
            r["level"] = level
        append_rows(path, rows)
        _write_errors(path)
        n_done += 1
        bar.update(weight)
    bar.close()
    return n_done, 0


def _write_errors(path):
    """Tracebacks of granii's errors so far, beside the CSV (``errors.txt``), for its developers."""
    if not bm.ERRORS:
        return
    text = "\n".join(f"== {b['model']} {b['graph']} {b['k_in']}->{b['k_out']} {b['mode']}\n{tb}"
                     for b, tb in bm.ERRORS)
    (Path(path).parent / "errors.txt").write_text(text)


__all__ = ["sweep", "done_configs", "append_rows", "FIELDS"]
