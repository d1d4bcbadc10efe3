"""Mini-batch training with a neighbour sampler, per epoch, for one model on one graph.

As DGL's sampling examples train: ``dgl.dataloading.NeighborSampler(fanouts)`` and
``dgl.dataloading.DataLoader`` over the training seeds (``BATCH`` per batch, shuffled); for each
batch the blocks are used once: forward on the input nodes' features, cross-entropy on the seeds,
backward, Adam step. Nothing is reused between batches except granii's decision (ranked on the
first block of a sampler configuration, settled by the measured tie-break on the next blocks and
kept for the later ones, see README).

Each candidate (``dgl``, ``granii``, ``restricted``; see ``fullbatch``) has its own loader over
its own copy of the graph. One epoch of one candidate is one timed measurement, the sampling
included (what the user's epoch costs); the time spent inside the loader is recorded too, so
``model`` times (the epoch without the sampling) can be compared as well. Rounds alternate the
candidates epoch by epoch after a warm-up epoch each.

Seeds (the training nodes of an epoch): a fixed random ``max_seeds`` of the graph's nodes (4,096:
4 batches), or all of them on a smaller graph, so an epoch stays within seconds on two cores.
The first epoch of each candidate (for granii with ``granii(...)`` on its first batch) is timed
apart; then rounds (``rounds.interleaved``) until granii's measured tie-breaks have ended and 3
rounds are steady (at most ``max_rounds``, within ``budget``; the optimized copies go on alone
when the cap ends the rounds first). On sampled blocks a tie-break takes turns on successive
blocks of one sampler configuration, so with 4 batches per epoch it spans the first 3-4 epochs.
Two figures per candidate: ``*_ms`` is the steady epoch (the median of the steady rounds), and
``*_total_ms`` the epoch of a ``RUN_EPOCHS``-epoch training run with its first epochs included:
the first epoch, the measured ones, and the steady epoch for the rest, divided by ``RUN_EPOCHS``
(the headline, like the first-included totals of the other parts).

Ceiling: one more candidate, ``skeleton`` (``bench.skeleton``: the model with each graph layer
reduced to its dense products on the destination rows), is timed in the same rounds; its epoch is
what remains when the graph work costs nothing, so ``ceiling = dgl_ms / skeleton_ms`` bounds the
speedup any plan can reach on torch's GEMM. For GAT, ``skeleton_src`` projects every source row
(``ceiling_src``): the bound of the plans that project before aggregating, DGL's among them.

Correctness: one batch's blocks, one seeded forward and backward of each optimized copy against
DGL's model (outputs and gradients).
"""
import copy
import time
import traceback

import dgl
import torch
import torch.nn.functional as F

from granii import granii as optimize

from . import check
from .decisions import Settling, describe
from .fullbatch import CAP, _ratios, _short, record
from .inputs import fresh_graph
from .load import OthersMeter
from .restrict import uses_excluded
from .rounds import interleaved, median
from .skeleton import has_gat, skeleton

BATCH = 1024
DEFAULT_COST_MODEL = "default"     # Epoch's cost_model: granii(...) with its own default, as users call it
RUN_EPOCHS = 10    # a training run of the headline: DGL's sampling examples train 10
ERRORS = []


def loader(g, seeds, fanouts, seed):
    sampler = dgl.dataloading.NeighborSampler(fanouts)
    gen = torch.Generator().manual_seed(seed)
    return dgl.dataloading.DataLoader(g, seeds, sampler, batch_size=BATCH, shuffle=True,
                                      drop_last=False, generator=gen)


class Epoch:
    """One training epoch of ``model`` over its own loader; ``__call__`` returns the seconds of
    the epoch and keeps the seconds spent in the loader in ``self.sampling``."""

    def __init__(self, spec, model, g, inp, seeds, fanouts, seed, cost_model=None):
        self.spec, self.model, self.inp = spec, model, inp
        self.loader = loader(g, seeds, fanouts, seed)
        self.opt = torch.optim.Adam(model.parameters(), lr=0.003)
        self.cost_model = cost_model
        self.sampling = []
        self.batches = 0

    def __call__(self):
        self.model.train()
        t0 = time.perf_counter()
        in_loader = 0.0
        it = iter(self.loader)
        n = 0
        while True:
            t = time.perf_counter()
            try:
                inp_nodes, out_nodes, blocks = next(it)
            except StopIteration:
                in_loader += time.perf_counter() - t
                break
            in_loader += time.perf_counter() - t
            x = self.inp.x[inp_nodes]
            if self.cost_model is not None:        # the first epoch: granii(...) on its first batch
                cm = None if self.cost_model is DEFAULT_COST_MODEL else self.cost_model
                optimize(self.model, blocks, x, cost_model=cm)
                self.cost_model = None
            self.opt.zero_grad(set_to_none=True)
            out = self.spec.run(self.model, blocks, x)
            F.cross_entropy(out, self.inp.y[out_nodes]).backward()
            self.opt.step()
            n += 1
        self.batches = n
        self.sampling.append(in_loader)
        return time.perf_counter() - t0


def seeds_of(g, max_seeds, seed=0):
    n = g.num_nodes()
    if n <= max_seeds:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:max_seeds].sort().values


def correctness(spec, model0, inp, fanouts, seeds, cost_models):
    out = {}
    _, out_nodes, blocks = next(iter(loader(inp.g, seeds, fanouts, 5)))
    x = inp.x[blocks[0].srcdata[dgl.NID]]
    for name, cm in cost_models.items():
        ref, opt = copy.deepcopy(model0), copy.deepcopy(model0)
        optimize(opt, blocks, x, cost_model=cm)
        err, where = check.compare(ref, opt, lambda m: spec.run(m, blocks, x), True)
        ok, where = check.settle(err, where, lambda: copy.deepcopy(model0),    # smooth ReLUs
                                 lambda m: optimize(m, blocks, x, cost_model=cm),
                                 lambda m: spec.run(m, blocks, x))
        out[name] = (ok, err, where, describe(opt), uses_excluded(opt))
    return out


def measure(spec, fanouts, inp, cost_models, budget=20.0, max_rounds=RUN_EPOCHS - 1,
            max_seeds=4096, seed=0, fresh=None):
    """One row of ``models.csv`` with ``task="minibatch"`` (see module doc). ``fresh``:
    ``{candidate: seconds}`` of first epochs timed in a fresh process (``bench.fresh``)."""
    seeds = seeds_of(inp.g, max_seeds, seed)
    row = dict(model=spec.name, label=spec.label, graph=inp.name, nodes=inp.g.num_nodes(),
               edges=inp.g.num_edges(), features=inp.features, classes=inp.classes,
               task="minibatch", fanouts="/".join(map(str, fanouts)), seeds=len(seeds),
               batch=BATCH, status="ok", check="", max_rel_err="", check_where="")
    torch.manual_seed(seed)
    model0 = spec.build(inp.g, inp.features, inp.classes, True)
    try:
        checks = correctness(spec, model0, inp, fanouts, seeds, cost_models)
    except Exception as e:                 # noqa: BLE001
        ERRORS.append((dict(row), traceback.format_exc()[-3000:]))
        row.update(status=f"error: {_short(e)}", check="FAIL")
        checks = {}
    for name, (ok, err, where, desc, used) in checks.items():
        tag = "" if name == "granii" else f"{name}_"
        row.update({f"{tag}check": "pass" if ok else "FAIL", f"{tag}max_rel_err": err,
                    f"{tag}check_where": where,
                    f"{tag}optimized": f"{desc['optimized']}/{desc['layers']}",
                    f"{tag}fallbacks": desc["fallbacks"], f"{tag}plans": desc["plans"]})
        if name != "granii":
            row[f"{tag}uses_excluded"] = ",".join(used)
    names = ["dgl"] + [n for n in cost_models if n in checks] + ["skeleton"]
    names += ["skeleton_src"] if has_gat(model0) else []
    epochs, first = {}, {}
    try:
        for name in names:
            m = (skeleton(model0, sources=name == "skeleton_src") if name.startswith("skeleton")
                 else copy.deepcopy(model0))
            ep = epochs[name] = Epoch(spec, m, fresh_graph(inp.g), inp, seeds, fanouts, seed + 1,
                                      cost_models.get(name))
            first[name] = ep()                # includes granii(...) on the first batch
        optimized = [n for n in cost_models if n in checks]
        with OthersMeter() as others:
            samples, steady_from = interleaved(
                dict(epochs), warmup=0, max_rounds=max_rounds, min_rounds=min(3, max_rounds),
                budget=budget, settled=Settling(*(epochs[n].model for n in optimized)),
                cap=CAP * budget, settle=optimized)
    except Exception as e:                 # noqa: BLE001
        ERRORS.append((dict(row), traceback.format_exc()[-3000:]))
        row.update(status=f"error: {_short(e)}")
        return row
    record(row, names, first, samples, steady_from, RUN_EPOCHS, fresh)
    for name in names:
        sampling = median(epochs[name].sampling[1:]) * 1e3
        row[f"{name}_total_ms"] /= RUN_EPOCHS            # per epoch of the run
        row[f"{name}_total_warm_ms"] /= RUN_EPOCHS
        row[f"{name}_sampling_ms"] = sampling
        row[f"{name}_model_ms"] = row[f"{name}_ms"] - sampling
    if "granii" in names:
        row["granii"] = describe(epochs["granii"].model)["plans"]
    row["ceiling"] = row["dgl_ms"] / row["skeleton_ms"]
    if "skeleton_src" in names:
        row["ceiling_src"] = row["dgl_ms"] / row["skeleton_src_ms"]
    row.update(iterations=epochs["dgl"].batches, run_epochs=RUN_EPOCHS,
               others_cores=others.cores, time=time.strftime("%H:%M:%S"))
    _ratios(row)
    try:
        row["speedup_model"] = row["dgl_model_ms"] / row["granii_model_ms"]
    except (KeyError, ZeroDivisionError):
        row["speedup_model"] = float("nan")
    return row


__all__ = ["measure", "BATCH", "ERRORS", "seeds_of"]
