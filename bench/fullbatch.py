"""Full-batch training epochs and inference on new features, for one model on one graph.

Candidates, side by side in one process (``rounds.interleaved``), all from one model built with a
fixed seed (``copy.deepcopy``, so the same weights), each on its own copy of the graph (no formats
or caches shared between them):

* ``dgl``         the model as written;
* ``granii``      the same model after ``granii(model, g, x)`` with this machine's cost model;
* ``restricted``  the same after ``granii`` with selection restricted to DGL's and torch's kernels
                  (``restrict.WithoutNative``), when the project's own kernels are available.

Training (``task="train"``): one epoch is ``zero_grad``, forward in train mode (dropout on),
cross-entropy on the training nodes, backward, Adam step (lr 0.01, weight decay 5e-4). The first
epoch is timed on its own (for granii it includes the ``granii(...)`` call); ``total`` is the time
of ``EPOCHS`` epochs (DGL's examples train 200): the first, every epoch measured after it, and the
steady median for the epochs not measured (``rounds.summarise``). The steady median is taken over
the rounds after granii's measured tie-break (its first calls, when it times candidate plans
against each other) has settled, the same rounds for every candidate.

Inference (``task="infer"``): ``model.eval()`` under ``torch.no_grad``, each call on a feature
tensor that no call saw before (``inputs.FreshFeatures``, made outside the timer): what every
hidden layer sees anyway and what serving new data sees. The first call (for granii:
``granii(model, g, x0)`` with the dataset's features, then the call on new features) is timed on
its own; ``total`` is the time of ``CALLS`` calls as for training. Up to ``CALLS - 1`` rounds
are timed, fewer when the round budget is spent (large graphs) and granii has settled.

First calls: the ones above are timed in the benchmark's own process, after the correctness
checks have filled granii's process-wide caches (``*_first_warm_ms``); given ``fresh`` (first
calls timed each in a fresh process, ``bench.fresh``), the totals use those instead (``record``).
With ``ablations``, ``bench.ablation``'s ``dgl_pool`` and ``granii_nopool`` run in the same rounds.

Correctness first, on copies: training mode, one seeded forward and backward (outputs and every
parameter's gradient) and eval mode outputs on new features, each optimized copy against DGL's
(``check.compare``). A configuration that fails is timed but marked ``check=FAIL``; the report
leaves it out of every mean.
"""
import copy
import math
import time
import traceback

import torch
import torch.nn.functional as F

from granii import granii as optimize

from . import ablation, check
from .decisions import Settling, describe
from .examples import build, set_graph
from .inputs import FreshFeatures, fresh_graph
from .load import OthersMeter
from .restrict import uses_excluded
from .rounds import interleaved, summarise, timed

EPOCHS = 200
CALLS = 100
CAP = 5          # rounds stop after CAP x budget seconds, settled or not
ERRORS = []


def _short(e, n=200):
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _train_step(spec, model, opt, g, x, y, mask):
    opt.zero_grad(set_to_none=True)
    out = spec.run(model, g, x)
    F.cross_entropy(out[mask], y[mask]).backward()
    opt.step()


def _infer(spec, model, g, x):
    with torch.no_grad():
        spec.run(model, g, x)


def correctness(spec, model0, inp, cost_models, training):
    """``{candidate: (passed, worst error, where, describe(...), restricted uses)}`` of each
    optimized copy against DGL's model on the shared graph."""
    out = {}
    feats = FreshFeatures(inp.x.shape, pool=1, seed=99)
    for name, cm in cost_models.items():
        ref = set_graph(copy.deepcopy(model0), inp.g)
        opt = set_graph(copy.deepcopy(model0), inp.g)
        optimize(opt, inp.g, inp.x, cost_model=cm)
        xn = inp.x if training else feats.next()
        err, where = check.compare(ref, opt, lambda m: spec.run(m, inp.g, xn), training)
        ok = check.passed(err)
        if training:                     # a failure is checked again with smooth ReLUs
            ok, where = check.settle(err, where, lambda: set_graph(copy.deepcopy(model0), inp.g),
                                     lambda m: optimize(m, inp.g, inp.x, cost_model=cm),
                                     lambda m: spec.run(m, inp.g, xn))
        out[name] = (ok, err, where, describe(opt), uses_excluded(opt))
    return out


def measure(spec, inp, task, cost_models, budget=3.0, max_rounds=None, warmup=0, seed=0,
            fresh=None, ablations=False):
    """One row of ``models.csv`` (see module doc). ``cost_models``: ``{"granii": model,
    "restricted": model}`` (``restricted`` may be absent). ``fresh``: ``{candidate: seconds}`` of
    first calls timed in a fresh process (``bench.fresh``), used in the totals; ``ablations``:
    time ``bench.ablation``'s candidates too. Never raises for granii's failures."""
    training = task == "train"
    row = dict(model=spec.name, label=spec.label, graph=inp.name, nodes=inp.g.num_nodes(),
               edges=inp.g.num_edges(), features=inp.features, classes=inp.classes, task=task,
               status="ok", check="", max_rel_err="", check_where="")
    model0 = build(spec, inp.g, inp.features, inp.classes, training, seed)
    try:
        checks = correctness(spec, model0, inp, cost_models, training)
    except Exception as e:                 # noqa: BLE001 - recorded, the run goes on
        ERRORS.append((dict(row), traceback.format_exc()[-3000:]))
        row.update(status=f"error: {_short(e)}", check="FAIL")
        checks = {}
    for name, (ok, err, where, desc, used) in checks.items():
        tag = "" if name == "granii" else f"{name}_"
        row[f"{tag}check"] = "pass" if ok else "FAIL"
        row[f"{tag}max_rel_err"] = err
        row[f"{tag}check_where"] = where
        row[f"{tag}optimized"] = f"{desc['optimized']}/{desc['layers']}"
        row[f"{tag}fallbacks"] = desc["fallbacks"]
        row[f"{tag}plans"] = desc["plans"]
        if name != "granii":
            row[f"{tag}uses_excluded"] = ",".join(used)
    names = ["dgl"] + [n for n in cost_models if n in checks]
    if ablations and "granii" in checks:
        names += list(ablation.CANDIDATES)

    fns, first, models = {}, {}, {}
    feats = FreshFeatures(inp.x.shape, seed=seed + 7)
    try:
        for name in names:
            g = fresh_graph(inp.g)
            m = set_graph(copy.deepcopy(model0), g)
            models[name] = m
            cm = cost_models.get("granii" if name == "granii_nopool" else name)
            step = _train_step if training else _infer
            if name in ablation.CONTEXT:
                step = lambda *a, name=name, step=step: ablation.run_in(name, step, *a)
            if training:
                opt = torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=5e-4)
                m.train()
                t0 = time.perf_counter()
                if cm is not None:
                    optimize(m, g, inp.x, cost_model=cm)
                step(spec, m, opt, g, inp.x, inp.y, inp.train)
                first[name] = time.perf_counter() - t0
                fns[name] = (lambda m=m, opt=opt, g=g, step=step:
                             timed(step, spec, m, opt, g, inp.x, inp.y, inp.train))
            else:
                m.eval()
                x1 = feats.next()
                t0 = time.perf_counter()
                if cm is not None:
                    optimize(m, g, inp.x, cost_model=cm)
                step(spec, m, g, x1)
                first[name] = time.perf_counter() - t0

                def call(m=m, g=g, step=step):
                    x = feats.next()
                    return timed(step, spec, m, g, x)
                fns[name] = call
        n = EPOCHS if training else CALLS
        opt_models = [models[k] for k in names if not k.startswith("dgl")]
        with OthersMeter() as others:
            samples, steady_from = interleaved(
                fns, warmup=warmup, max_rounds=max_rounds or n - 1, min_rounds=3, budget=budget,
                settled=Settling(*opt_models), cap=max(CAP * budget, 5.0))
    except Exception as e:                 # noqa: BLE001
        ERRORS.append((dict(row), traceback.format_exc()[-3000:]))
        row.update(status=f"error: {_short(e)}")
        return row
    record(row, names, first, samples, steady_from, n, fresh)
    if "granii" in names:
        row["granii"] = describe(models["granii"])["plans"]
    row.update(iterations=n, others_cores=others.cores, time=time.strftime("%H:%M:%S"))
    _ratios(row)
    return row


def record(row, names, first, samples, steady_from, n, fresh=None):
    """Per candidate: steady median, fastest round, first call and the total of ``n`` calls.

    ``first``: first calls timed in this process (``*_first_warm_ms``, and ``*_total_warm_ms``
    with them); ``fresh``: those timed in a fresh process (``bench.fresh``). Where DGL's and
    granii's both are there, ``*_first_ms`` and ``*_total_ms`` (the headline's) use the fresh
    ones (``first_call = "fresh process"``); otherwise the warm ones, and the row says so."""
    fresh = fresh or {}
    use_fresh = all(_finite(fresh.get(k)) for k in ("dgl", "granii") if k in names)
    row["first_call"] = "fresh process" if use_fresh else "warm process"
    for name in names:
        med, total = summarise(first[name], samples[name], steady_from, n)
        f = fresh.get(name) if use_fresh and _finite(fresh.get(name)) else first[name]
        row[f"{name}_ms"] = med * 1e3
        row[f"{name}_min_ms"] = min(samples[name]) * 1e3
        row[f"{name}_first_warm_ms"] = first[name] * 1e3
        row[f"{name}_total_warm_ms"] = total * 1e3
        row[f"{name}_first_ms"] = f * 1e3
        row[f"{name}_total_ms"] = (total - first[name] + f) * 1e3
    row["rounds"] = len(samples["dgl"])
    # optimized copies may have gone on alone until settled (``rounds.interleaved``)
    mine = samples.get("granii", samples["dgl"])
    row["alone_rounds"] = len(mine) - len(samples["dgl"])
    row["steady_rounds"] = len(mine[steady_from:]) if steady_from is not None else 0


def _finite(x):
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _ratios(row):
    """Speedups of a row: DGL over granii (total and steady), restricted over granii."""
    def ratio(a, b):
        try:
            return float(row[a]) / float(row[b])
        except (KeyError, ValueError, ZeroDivisionError, TypeError):
            return float("nan")
    row["speedup"] = ratio("dgl_total_ms", "granii_total_ms")
    row["speedup_steady"] = ratio("dgl_ms", "granii_ms")
    # the restricted copy's first call is a warm process's: compared with warm totals
    row["restricted_speedup"] = ratio("dgl_total_warm_ms", "restricted_total_warm_ms")
    row["joint_gain"] = ratio("restricted_total_warm_ms", "granii_total_warm_ms")
    row["joint_gain_steady"] = ratio("restricted_ms", "granii_ms")
    row["speedup_min"] = ratio("dgl_min_ms", "granii_min_ms")      # fastest rounds: noise check
    row["speedup_warm"] = ratio("dgl_total_warm_ms", "granii_total_warm_ms")
    ablation.ratios(row)


__all__ = ["measure", "correctness", "EPOCHS", "CALLS", "ERRORS"]
