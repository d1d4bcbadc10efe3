"""Single layers in inference, split by what the features do between calls.

For one layer (``bench.models``: GraphConv, SGConv, TAGConv, GINConv, SAGEConv, GATConv) on one
graph at ``(k_in, k_out)``, two rows:

* ``features="new"``   every call gets a feature tensor no call saw before (what a hidden layer
  sees, and inference on new data): nothing that depends on the features can be reused;
* ``features="same"``  the same tensor every call (a first layer on fixed features): granii may
  keep work that depends on the graph and the features alone. Where DGL offers such reuse itself
  (``SGConv(cached=True)``), DGL's column is that layer (same weights), so the comparison is
  against the best DGL does.

Candidates side by side (``rounds.interleaved``): ``dgl``, ``granii`` and, on new features,
``restricted`` (selection without the project's own kernels). Each has its own copy of the
graph. The first call is timed on its own and includes ``granii(layer, g, x0)`` (``x0`` another
tensor of the same shape, so on new features the first call reuses nothing); ``total`` is the time
of 100 calls: the first, the calls measured, and the steady median for the calls not measured
(``rounds.summarise``; steady: after granii's measured tie-break has settled). Layers run in
eval mode under ``torch.no_grad``.

On new features one more candidate, ``family_floor``, times in the same rounds the least work of
the plans granii enumerates for the layer (``floor_work``): ``X W`` (``torch.mm`` of new
``N x k_in`` features by a ``k_in x c k_out`` matrix, ``c`` the layer's weight blocks) plus ``a``
unweighted sums over the in-edges at width ``min(k_in, k_out)`` (the project's native SpMM; DGL's
``copy_u_sum`` without the extension), ``(c, a)`` = ``(1, 1)`` for GraphConv, GINConv and
GATConv, ``(2, 1)`` for SAGEConv, ``(1, k)`` for SGConv and ``(k + 1, k)`` for TAGConv.
``family_ceiling = dgl_ms / family_floor_ms`` bounds that family only, at the kernels' speed
measured here: it is not a bound on what a plan can do (granii's own steady time beat it in 45 of
162 configurations of an earlier run). The lower bound of the row is ``bound_ms``
(``bench.bounds``: the bytes and multiply-adds any correct algorithm must do, at this machine's
measured rates); no measured time may beat it.

First calls: timed in this process as above (``*_first_warm_ms``) and, given ``fresh``, in a
fresh process (``bench.fresh``), which the totals then use. With ``ablations``, new features also
time ``bench.ablation``'s ``dgl_pool`` and ``granii_nopool``.

Correctness, after timing, of the very copies timed: the output on a new tensor and, with the
same features, on the timed tensor called twice more (the reuse path), against DGL's layer
(``check.rel_err``).
"""
import copy
import time
import traceback

import dgl
import torch
from dgl import nn as dglnn
from dgl.nn import SGConv

from granii import granii as optimize
from granii.graph import graph_info
from granii.kernels import native, pool

from . import ablation, bounds, check, models
from .decisions import Settling, describe
from .fullbatch import CAP, _ratios, _short, record
from .inputs import FreshFeatures, fresh_graph
from .load import OthersMeter
from .rounds import interleaved, steady_median, timed

CALLS = 100
LAYERS = ("gcn", "sgc", "tagcn", "gin", "sage", "gat")
# sizes in the order they run: a run stopped by its deadline has the first levels everywhere
LEVELS = [((32, 128), (128, 32)), ((128, 512), (512, 128)), ((32, 512), (512, 32)),
          ((32, 32), (128, 128), (512, 512))]
QUICK_LEVELS = [((32, 128), (128, 32))]
ERRORS = []


def _call(layer, g, x):
    with torch.no_grad():
        return layer(g, x)


def cached_twin(layer):
    """DGL's own reuse for ``layer``: ``SGConv(cached=True)`` with the same weights, or None."""
    if not isinstance(layer, SGConv):
        return None
    twin = SGConv(layer.fc.in_features, layer.fc.out_features, k=layer._k, cached=True,
                  bias=layer.fc.bias is not None, norm=layer.norm,
                  allow_zero_in_degree=layer._allow_zero_in_degree)
    twin.load_state_dict(layer.state_dict())
    return twin.eval()


def _check(layer0, g, x, timed_layers, features):
    """``{name: worst relative error}`` of the timed granii copies against DGL's layer: on a new
    tensor, and (same features) on the timed tensor called twice more (the reuse path)."""
    gen = torch.Generator().manual_seed(123)
    xn = torch.randn(x.shape, generator=gen)
    want_new = _call(layer0, g, xn)
    want_same = _call(layer0, g, x) if features == "same" else None
    errs = {}
    for name, (layer, fg) in timed_layers.items():
        if name == "dgl":
            continue
        err = check.rel_err(_call(layer, fg, xn.clone()), want_new)
        if features == "same":
            err = max(err, check.rel_err(_call(layer, fg, x), want_same),
                      check.rel_err(_call(layer, fg, x), want_same))
        errs[name] = err
    return errs


def measure(model, graph_name, g, k_in, k_out, cost_models, budget=0.6, max_rounds=CALLS - 1,
            seed=0, fresh=None, ablations=False, rates=None):
    """The two rows (new features, same features) of one configuration (see module doc).

    ``fresh``: ``{(features, candidate): seconds}`` of first calls timed in a fresh process
    (``bench.fresh``), used in the totals; ``ablations``: on new features, time
    ``bench.ablation``'s candidates too; ``rates``: this machine's (``bounds.measure_rates``), for
    the lower bound of each new-features row (``bound_ms``)."""
    layer0 = models.build(model, k_in, k_out, seed).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(g.num_nodes(), k_in, generator=gen)
    base = dict(model=model, label=models.MODELS[model].label, graph=graph_name,
                nodes=g.num_nodes(), edges=g.num_edges(), k_in=k_in, k_out=k_out)
    rows = []
    for features in ("new", "same"):
        row = dict(base, features=features, status="ok", check="")
        names = {"dgl": None, "granii": cost_models["granii"]}
        if features == "new" and "restricted" in cost_models:
            names["restricted"] = cost_models["restricted"]
        if features == "new" and ablations:
            names.update(dgl_pool=None, granii_nopool=cost_models["granii"])
        firsts = {c: v for (f, c), v in (fresh or {}).items() if f == features}
        try:
            timing, timed_layers = _time(layer0, g, x, k_out, names, features, budget, max_rounds,
                                         seed, firsts)
            if features == "new":
                nbytes, macs = bounds.layer_work(layer0, g, k_in, k_out)
                timing.update(bound_bytes=nbytes, bound_macs=macs)
                if rates is not None:       # the report recomputes it with the run's best rates
                    timing["bound_ms"] = bounds.bound_seconds(rates, nbytes, macs) * 1e3
                    timing["bound_ceiling"] = timing["dgl_ms"] / timing["bound_ms"]
            row.update(timing)
            errs = _check(layer0, g, x, timed_layers, features)
            for name, err in errs.items():
                tag = "" if name == "granii" else f"{name}_"
                row[f"{tag}check"] = "pass" if check.passed(err) else "FAIL"
                row[f"{tag}max_rel_err"] = err
            desc = describe(timed_layers["granii"][0])
            row.update(optimized=f"{desc['optimized']}/{desc['layers']}",
                       fallbacks=desc["fallbacks"], granii=desc["plans"])
        except Exception as e:             # noqa: BLE001 - recorded, the run goes on
            ERRORS.append((dict(row), traceback.format_exc()[-3000:]))
            row.update(status=f"error: {_short(e)}", check="FAIL")
        _ratios(row)
        rows.append(row)
    return rows


def _time(layer0, g, x, k_out, names, features, budget, max_rounds, seed, fresh=None):
    """``(timing columns, {name: (timed layer, its graph)})``."""
    feats = FreshFeatures(x.shape, seed=seed + 11) if features == "new" else None
    x0 = torch.randn_like(x)
    fns, first, layers, row = {}, {}, {}, {}
    for name, cm in names.items():
        fg = fresh_graph(g)
        twin = cached_twin(layer0) if name == "dgl" and features == "same" else None
        layer = twin if twin is not None else copy.deepcopy(layer0)
        if twin is not None:
            row["dgl_layer"] = "SGConv(cached=True)"
        layers[name] = (layer, fg)
        call = _call
        if name in ablation.CONTEXT:
            call = lambda *a, name=name: ablation.run_in(name, _call, *a)
        xi = feats.next() if feats else x
        t0 = time.perf_counter()
        if cm is not None:
            optimize(layer, fg, x0 if feats else x, cost_model=cm)
        call(layer, fg, xi)
        first[name] = time.perf_counter() - t0
        if feats:
            fns[name] = lambda layer=layer, fg=fg, call=call: timed(call, layer, fg, feats.next())
        else:
            fns[name] = lambda layer=layer, fg=fg, call=call: timed(call, layer, fg, x)
    if feats:
        fns["family_floor"] = floor_fn(fresh_graph(g), x.shape[1], k_out, feats, seed,
                                       *floor_work(layer0))
    optimized = [k for k in names if not k.startswith("dgl")]
    opt_layers = [layers[k][0] for k in optimized]
    with OthersMeter() as others:
        samples, steady_from = interleaved(
            fns, max_rounds=max_rounds, min_rounds=5, budget=budget,
            settled=Settling(*opt_layers), cap=CAP * max(budget, 0.5), settle=optimized)
    record(row, names, first, samples, steady_from, CALLS, fresh)
    if feats:
        floor = steady_median(samples["family_floor"], steady_from) * 1e3
        row.update(family_floor_ms=floor, family_ceiling=row["dgl_ms"] / floor)
    row.update(others_cores=others.cores, time=time.strftime("%H:%M:%S"))
    return row, layers


def floor_work(layer):
    """``(c, a)`` of the ``floor`` (module doc): weight blocks of ``k_in x k_out`` every plan
    multiplies all rows by, and aggregations every plan does."""
    k = getattr(layer, "_k", 1)
    if isinstance(layer, dglnn.TAGConv):
        return k + 1, k
    if isinstance(layer, dglnn.SGConv):
        return 1, k
    if isinstance(layer, dglnn.SAGEConv) and hasattr(layer, "fc_self"):
        return 2, 1
    return 1, 1


def floor_fn(g, k_in, k_out, feats, seed, blocks=1, aggregations=1):
    """One timed call of the ``floor`` candidate (see module doc) on ``g``."""
    w = torch.randn(k_in, blocks * k_out)
    narrow = FreshFeatures((g.num_nodes(), min(k_in, k_out)), seed=seed + 13)
    if native.available():
        gi = graph_info(g)
        native.spmm_native(gi, narrow.next())          # its CSR, once per graph as in a plan
        aggregate = lambda h: native.spmm_native(gi, h)
    else:
        aggregate = lambda h: dgl.ops.copy_u_sum(g, h)

    def run(x, h):
        with torch.no_grad():
            x @ w
            for _ in range(aggregations):
                h = aggregate(h)
    # in the memory pool's scope, as granii's plans run: a fresh result of tens of MB would
    # otherwise pay its page faults, as much as the product that fills it
    return lambda: timed(pool.run, (), run, feats.next(), narrow.next())


def configs(graph_names, quick=False, layers=LAYERS):
    """``[(level, model, graph, k_in, k_out)]`` in run order: level by level of sizes."""
    levels = QUICK_LEVELS if quick else LEVELS
    return [(i, m, gname, ki, ko) for i, pairs in enumerate(levels) for gname in graph_names
            for m in layers for ki, ko in pairs]


__all__ = ["measure", "configs", "LAYERS", "LEVELS", "ERRORS", "cached_twin"]
