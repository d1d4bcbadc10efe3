"""What the profiler measures: the configurations, the graphs and sizes, and each primitive's inputs.

A *point* is one (primitive, graph or ``"dense"``, sizes) cell; every implementation of the
primitive is timed on it side by side. Sparse primitives run on the corpus graphs
(``generators.corpus``) plus one-hop neighbour-sampled blocks of some of them, over the
embedding sizes ``k`` (or the head counts of edge scores); the dense ones on size grids alone:
GEMM on ``(m, k, n)`` (``m`` rows of ``X``, ``X W`` with ``W`` of shape ``k x n``), the row
scaling on ``(n, k)``, GAT's per-head scores ``head_dot`` on ``(m, k = heads x F, n = heads)``
(``m`` from the GEMM grid, ``F`` from ``gat_f`` and 32).

Inputs are those the layers pass: float features, float edge values (a normalised adjacency) for
``spmm_weighted``, degree powers ``D^-1/2`` for ``sddmm_scale``, ``(n, heads, 1)`` attention terms
for ``sddmm_add`` and ``(E, heads, 1)`` scores for ``edge_softmax``.
"""
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from granii import kernels
from granii.costmodel import PRICED_AS
from granii.learned import MODEL_SIZES, PHASES, TRAIN_GRADS, baseline_seconds
from granii.reference import dense_inputs, graph_inputs  # noqa: F401  (the inputs of a point)
from granii.profiling import generators as gen

try:        # the fused GAT kernels register themselves when imported
    import granii.kernels.native_gat  # noqa: F401
except ImportError:
    pass

DENSE = "dense"
GRAPH_PRIMS = ["spmm", "spmm_weighted", "spmm_mean", "spmm_max", "sddmm_scale", "sddmm_add",
               "edge_softmax", "spmm_norm", "gat_aggregate", "spmm_heads"]
DENSE_PRIMS = ["gemm", "row_scale", "head_gemm", "head_dot"]
PER_HEAD = ["spmm_heads", "head_gemm"]     # GAT's per-head composition (A_h X) W_h


@dataclass
class Config:
    """One profiling run.

    ``graphs``: corpus names (``generators.build`` rebuilds each); ``blocks_every``: add a one-hop
    sampled block of every this-many-th non-sampled graph (0: none). ``ks``: embedding sizes of the
    SpMMs; ``heads``: head counts of the edge-score primitives and ``head_dot``; ``gat_f``:
    per-head widths of ``gat_aggregate`` and ``head_dot`` (``k = heads x F``). ``phases``: "forward" (no autograd) and "train"
    (forward and backward of the gradients ``learned.TRAIN_GRADS`` names). ``gemm_m``/``gemm_kn``: the GEMM
    grid (``k`` and ``n`` both from ``gemm_kn``); ``row_n``/``row_k``: the row-scaling grid.
    ``max_call``: a point whose implementations take longer than this together (seconds per round)
    ends the larger sizes of its (primitive, graph); points whose baseline estimate already exceeds
    it are not run. ``mem_fraction``: the share of available memory one point may use.
    ``max_wait``/``wait_budget``: how long to wait for other processes to leave the cores before
    a point (see ``harness.Probe``); points measured while contended are flagged.
    """
    name: str
    graphs: list
    ks: list
    heads: list = field(default_factory=lambda: [1, 4])
    gat_f: list = field(default_factory=lambda: [8, 64])
    phases: tuple = PHASES
    prims: list = field(default_factory=lambda: GRAPH_PRIMS + DENSE_PRIMS)
    blocks_every: int = 0
    gemm_m: list = field(default_factory=list)
    gemm_kn: list = field(default_factory=list)
    row_n: list = field(default_factory=list)
    row_k: list = field(default_factory=list)
    warmup: int = 2
    repeat: int = 7
    repeat_fast: int = 15          # repeats of points whose baseline is under 1 ms
    budget: float = 2.0            # seconds of repeats per point after the first 3 rounds
    max_call: float = 1.0
    trees: int = 160               # boosting rounds of each model trained on this run
    mem_fraction: float = 0.4
    max_wait: float = 5.0          # seconds a point waits for a contended machine to calm down
    retries: int = 1               # measurements again of a point measured while contended
    wait_budget: float = 300.0     # seconds all points together may wait


def quick_config():
    """About a minute and a half of profiling (``granii-init --quick`` stops it at 100 s): every
    graph of the quick corpus, three sizes, small grids, no waiting for a quiet machine (points
    measured under load are flagged). On an AVX2 machine, with the tie-break, the plans these
    models chose ran 1.049x the fastest (geomean over 96 layer configurations,
    ``results/selection_avx2/quick_init_current``); those of ``--graph-stride 3`` (10 min)
    1.031x, and the full models of an AVX-512 machine rescaled by a calibration of it 1.036x.
    ``gat_aggregate`` is profiled up to ``k = 4 x 64``, the widths of DGL's GAT examples. The
    per-head primitives are left to the longer runs: without their models ``select`` prices them
    by the models it falls back to, or from the one-head ones."""
    names = [n for n, _ in gen.corpus("quick")]
    prims = [p for p in GRAPH_PRIMS + DENSE_PRIMS if p not in PER_HEAD]
    return Config("quick", graphs=names, prims=prims, ks=[32, 96, 256], heads=[1, 4],
                  gat_f=[16, 64], blocks_every=4, gemm_m=[300, 5000, 60000, 400000],
                  gemm_kn=[16, 64, 256, 1024],
                  row_n=[1000, 50000, 1000000], row_k=[16, 256], warmup=1, repeat=3,
                  repeat_fast=5, budget=0.15, max_call=0.08, max_wait=0.0, wait_budget=0.0,
                  retries=0, trees=80)


def full_config():
    """An hour or more on two cores: the full corpus up to 4 M edges, sizes 16..1024, both phases,
    a GEMM grid of 6 x 9 x 9 (``k`` and ``n`` at 64 too: without it the models interpolated from
    32 to 128 and priced a 12,000 x 256 x 64 product at 2.2 ms where it takes 2.5, and one of
    32 columns at 1.1 ms where it takes 1.4; and at 4 and 8, the widths of attention heads'
    scores ``H (W a)``, which trees cannot extrapolate to: a 2,500 x 64 x 4 product was priced
    as one of 16 columns, 23 us, where it takes 33); contended points waited for and measured
    again once."""
    names = [n for n, _ in gen.corpus("full")]
    names = [n for n in names if _approx_edges(n) <= 4e6]
    return Config("full", graphs=names, ks=[16, 32, 128, 256, 1024],
                  heads=[1, 4, 8], gat_f=[8, 64], blocks_every=3,
                  gemm_m=[int(m) for m in np.geomspace(300, 1e6, 6).round(-1)],
                  gemm_kn=[4, 8, 16, 32, 64, 128, 256, 1024, 100],
                  row_n=[int(m) for m in np.geomspace(300, 3e6, 6).round(-1)],
                  row_k=[16, 64, 256, 1024],
                  warmup=1, repeat=5, repeat_fast=9, budget=0.5, max_call=0.4, max_wait=0.5,
                  wait_budget=120.0, retries=1)


def _approx_edges(name):
    return gen.approx_size(name)[1]


CONFIGS = {"quick": quick_config, "full": full_config}


# -- graphs ----------------------------------------------------------------------------------------
def block_name(base_name, i):
    """Corpus name of a one-hop neighbour-sampled block of graph ``base_name``: seeds a share
    0.05, 0.125 or 0.25 of the nodes, fanout 5, 10 or 25 (by ``i``)."""
    return gen.spec_name("sample", fraction=(0.05, 0.125, 0.25)[i % 3], fanout=(5, 10, 25)[i % 3],
                         seed=9000 + i, block=True, base=base_name)


def _family(name):
    fam = name.partition(":")[0]
    return fam + ("-directed" if "undirected=0" in name else "")


def graph_jobs(config):
    """``[(name, base)]`` in run order. ``base`` is ``None`` (build from the name) or the name of
    the graph just before, which the block ``name`` is sampled from (so the base is not rebuilt).

    The families take turns (first graph of each, then the second of each, ...), so an
    interrupted run has covered every family, up to some size.
    """
    by_family = {}
    for name in config.graphs:
        by_family.setdefault(_family(name), []).append(name)
    order = [n for group in itertools.zip_longest(*by_family.values()) for n in group if n]
    jobs = []
    plain = 0
    for name in order:
        jobs.append((name, None))
        if config.blocks_every and not name.startswith(("sample:", "mycielskian:")):
            if plain % config.blocks_every == 0:
                jobs.append((block_name(name, plain // config.blocks_every), name))
            plain += 1
    return jobs


# -- points ----------------------------------------------------------------------------------------
def graph_sizes(prim, config):
    """The size dicts of a sparse primitive, increasing in work."""
    names = MODEL_SIZES[prim][1]
    if not names:
        return [{}]
    if prim == "spmm_heads":        # the raw features, shared by the heads: k is their width
        return sorted(({"heads": h, "k": k} for h in config.heads if h > 1 for k in config.ks),
                      key=lambda s: (s["k"], s["heads"]))
    if names == ("k",):
        return [{"k": k} for k in sorted(config.ks)]
    if names == ("heads", "k"):
        return sorted(({"heads": h, "k": h * f} for h in config.heads for f in config.gat_f),
                      key=lambda s: (s["k"], s["heads"]))
    return [{"heads": h} for h in sorted(config.heads)]


def dense_points(prim, config):
    """Size dicts of a dense primitive's grid, ordered so each (m, k) row grows in ``n``."""
    if prim == "gemm":
        return [{"m": m, "k": k, "n": n} for m in sorted(config.gemm_m)
                for k in sorted(config.gemm_kn) for n in sorted(config.gemm_kn)]
    if prim == "head_gemm":         # n = heads x F: each head's sum times its own F columns
        return [{"m": m, "k": k, "heads": h, "n": h * f} for m in sorted(config.gemm_m)
                for k in sorted(config.gemm_kn) for h in sorted(config.heads) if h > 1
                for f in sorted(config.gat_f)]
    if prim == "head_dot":          # k = heads x F columns, one score per head (n = heads)
        return [{"m": m, "k": h * f, "n": h} for m in sorted(config.gemm_m)
                for h in sorted(config.heads) for f in sorted(set(config.gat_f) | {32})]
    return [{"n": n, "k": k} for n in sorted(config.row_n) for k in sorted(config.row_k)]


def point_key(prim, graph, sizes, phase="forward"):
    """The resume key of a point: primitive, graph name (or ``"dense"``), sorted sizes, and
    ``|train`` for a training-phase point."""
    key = f"{prim}|{graph}|" + ",".join(f"{k}={sizes[k]}" for k in sorted(sizes))
    return key if phase == "forward" else f"{key}|{phase}"


def has_phase(prim, phase):
    """Whether ``prim`` is profiled in ``phase``: a training point needs a gradient to compute."""
    return phase == "forward" or bool(TRAIN_GRADS.get(prim))


def point_bytes(prim, sizes, n_src=0, n_dst=0, e=0):
    """Rough peak bytes of one point: inputs, output, index structures and a temporary."""
    f = 4
    if prim == "gemm":
        m, k, n = sizes["m"], sizes["k"], sizes["n"]
        return f * (m * k + k * n + 2 * m * n)
    if prim == "head_gemm":         # Z and its gradient are (m, heads, k)
        m, k, n, h = sizes["m"], sizes["k"], sizes["n"], sizes["heads"]
        return f * (2 * m * h * k + k * n + 2 * m * n)
    if prim == "row_scale":
        return 3 * f * sizes["n"] * sizes["k"]
    if prim == "head_dot":          # X and its gradient
        return 2 * f * sizes["m"] * sizes["k"]
    index = 48 * e + 16 * (n_src + n_dst)         # two CSRs (int64), int32 copies, edge ids
    if prim == "gat_aggregate":
        h, k = sizes["heads"], sizes["k"]
        return index + 2 * f * k * (n_src + 2 * n_dst) + 6 * f * e * h
    if prim == "spmm_heads":
        h, k = sizes["heads"], sizes["k"]
        return index + f * k * (2 * n_src + 2 * h * n_dst) + 3 * f * e * h
    if prim.startswith("spmm"):
        return index + f * sizes["k"] * (n_src + 3 * n_dst) + 2 * f * e
    h = sizes.get("heads", 1)
    return index + 4 * f * e * h + f * h * (n_src + n_dst)


def estimate(prim, sizes, n_src=0, n_dst=0, e=0, phase="forward"):
    """Baseline seconds of one call of one implementation (for skipping and for progress); a
    training call counts a forward per gradient on top."""
    dims = dict(sizes)
    if prim.startswith("spmm") or prim == "row_scale":
        dims.setdefault("n", n_dst)
    t = baseline_seconds(prim, dims, n_src, n_dst, e)
    return t * (1 + len(TRAIN_GRADS.get(prim, ()))) if phase == "train" else t


def available_bytes():
    """``MemAvailable`` of /proc/meminfo (or 8 GiB when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


# -- inputs ----------------------------------------------------------------------------------------
def runners(prim, gi, sizes, impls, phase="forward", device=None):
    """``{impl: zero-argument callable}`` running ``prim`` by each implementation on one input
    (on ``device``; by default the CPU's, or the graph's for graph primitives).

    In the ``"train"`` phase a call is the forward with autograd and the backward of the
    operands ``TRAIN_GRADS[prim]`` (``torch.autograd.grad`` with a fixed random output gradient,
    so nothing accumulates between calls)."""
    args = dense_inputs(prim, sizes, device=device) if gi is None else \
        graph_inputs(prim, gi, sizes, device=device)
    lead = () if gi is None else (gi,)
    if phase == "forward":
        return {i: (lambda fn=kernels.get(prim, i): fn(*lead, *args)) for i in impls}
    args = list(args)
    grads = TRAIN_GRADS[prim]
    for p in grads:
        args[p] = args[p].detach().clone().requires_grad_(True)
    wrt = [args[p] for p in grads]
    out = {}
    for i in impls:
        fn = kernels.get(prim, i)
        with torch.no_grad():
            shape = fn(*lead, *args).shape
        dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(
            wrt[0].device)

        def run(fn=fn, dy=dy):
            with torch.enable_grad():
                y = fn(*lead, *args)
                return torch.autograd.grad(y, wrt, dy)
        out[i] = run
    return out


def registered(prims):
    """``[(prim, [impls])]`` of the primitives in ``prims`` that the kernel registry has (every
    implementation registered, the native ones included when the extension is built, except those
    priced as another, ``costmodel.PRICED_AS``)."""
    return [(p, [i for i in kernels.implementations(p) if (p, i) not in PRICED_AS]) for p in prims
            if p in kernels.REGISTRY and p in MODEL_SIZES]


def log2_round(x):
    return round(math.log2(max(x, 1)), 1)
