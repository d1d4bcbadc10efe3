"""The graphs of the benchmark and the embedding sizes each one is run at.

Real graphs: every graph shipped in ``data/`` (``granii.datasets.GRAPHS``). Generated graphs
(``granii.profiling.generators``, fixed seeds): an R-MAT power-law graph, a uniform random graph, a
road-like graph and a Mycielski graph (dense rows), each of about one to a few million edges,
and an R-MAT graph of about ten million edges (run last, at the first level of sizes only): what a
full run can time on two cores within its budget.

Sizes: the pairs ``(k_in, k_out)`` of ``{32, 128, 512, 1024}`` with ``k_in != k_out``, in both
orders, run in levels (``LEVELS``: first the pair 32/128 on every graph, then 32/1024, 32/512, ...)
so that a run stopped by its time budget has covered every graph and model at the earlier levels.
Pairs whose estimated cost (``work``) exceeds ``WORK_CAP`` on a graph are left out there, except
the first level, which every graph runs. ``--quick`` runs three small real graphs at
``{32, 256}``.
"""
from dataclasses import dataclass
from functools import partial

import dgl

from granii.datasets import GRAPHS, load_graph
from granii.profiling import generators as gen

LEVELS = [((32, 128), (128, 32)), ((32, 1024), (1024, 32)), ((32, 512), (512, 32)),
          ((128, 512), (512, 128)), ((128, 1024), (1024, 128)), ((512, 1024), (1024, 512))]
QUICK_LEVELS = [((32, 256), (256, 32))]
QUICK_GRAPHS = ("cora", "citeseer", "us-power-grid")
# cap on work(...) per (graph, sizes): about 1.5 s of forward time of the slowest candidate
WORK_CAP = 1.0e10


@dataclass
class GraphSpec:
    name: str
    family: str          # "real" or the generator's name
    factory: object      # () -> DGL graph


def generated():
    """``GraphSpec``s of the generated graphs (about 1 M directed edges each)."""
    return [
        GraphSpec("rmat-s16-ef8", "rmat", partial(gen.rmat, 16, 8, seed=1)),
        GraphSpec("uniform-100k-1M", "uniform",
                  partial(gen.uniform, 100_000, 500_000, seed=1, undirected=True)),
        GraphSpec("road-400k", "road", partial(gen.road_like, 400_000, seed=1)),
        GraphSpec("mycielskian-13", "mycielskian", partial(gen.mycielskian, 13)),
        GraphSpec("rmat-s19-ef10", "rmat", partial(gen.rmat, 19, 10, seed=1)),
    ]


def suite(quick=False, only=None):
    """The benchmark's graphs in run order (small to large), optionally only the names ``only``."""
    real = [GraphSpec(n, "real", partial(load_graph, n)) for n in (QUICK_GRAPHS if quick else GRAPHS)]
    specs = real if quick else real + generated()
    if only:
        known = {s.name: s for s in real + generated()}
        missing = [n for n in only if n not in known]
        if missing:
            raise KeyError(f"unknown graph(s) {missing}; known: {', '.join(known)}")
        specs = [known[n] for n in only]
    return specs


def with_self_loops(g):
    """``g`` with exactly one self-loop on every node (``A - diag(A) + I``)."""
    return dgl.add_self_loop(dgl.remove_self_loop(g))


def work(nodes, edges, k_in, k_out):
    """A rough cost of one layer call: dense flops plus sparse traffic weighted as flops."""
    return 2.0 * nodes * k_in * k_out + 40.0 * edges * max(k_in, k_out)


def size_levels(nodes, edges, quick=False, cap=WORK_CAP):
    """``[(level, (k_in, k_out))]`` run on a graph of this size (see module doc)."""
    levels = QUICK_LEVELS if quick else LEVELS
    return [(i, p) for i, pairs in enumerate(levels) for p in pairs
            if i == 0 or work(nodes, edges, *p) <= cap]


__all__ = ["suite", "generated", "size_levels", "LEVELS", "with_self_loops", "GraphSpec", "work"]
