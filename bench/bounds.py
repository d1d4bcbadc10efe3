"""Lower bounds on a layer call from the work any correct algorithm must do, at this machine's
measured rates.

A call of a layer on new features must, whatever the algorithm:

* read every feature row that reaches the result once (the sources with at least one out-edge,
  ``k_in`` floats each), the graph's structure once (one 4-byte index per edge, the smallest index
  any kernel here reads), the weights once, and write the result once (``N_dst x H k_out``
  floats): ``bytes`` moved;
* multiply every such row by each weight block it meets: ``c N k_in H k_out`` multiply-adds
  (``c`` weight blocks of ``k_in x H k_out``: 2 for SAGEConv's ``fc_self`` and ``fc_neigh``,
  ``k + 1`` for TAGConv, 1 otherwise; ``H`` heads), before or after aggregating, since the
  weights have no structure to exploit.

Neither can go faster than this machine's best measured rate, so

    bound = max(bytes / BW(bytes), macs / GEMM)

where ``GEMM`` is the best rate of large float32 products on torch's threads and ``BW(W)`` the
best streaming rate measured over buffers no larger than ``W`` bytes (a smaller buffer sits in a
nearer cache: reading ``W`` bytes cannot go faster than the fastest of those; below the smallest
size measured, the fastest rate of all). Both are measured at the start and at the end of a run (``measure_rates``, ``best_of``), each
the best of several repeats, so noise can only lower the bound. Rows keep the work
(``bound_bytes``, ``bound_macs``); the report computes the bound from the run's best rates.

A measured time below ``bound`` is a harness bug, not a fast plan (``summary.check_bounds``).
The ``family`` floor of ``bench/single.py`` is different: the least work of the plans granii
enumerates, timed; it bounds that family only, and is reported as such.
"""
import time

import torch

SIZES = [1 << s for s in range(16, 29, 2)]       # 64 KiB .. 256 MiB
FLOAT = 4
INDEX = 4


def _best(fn, repeats, floor=0.05):
    """Fastest of ``repeats`` timings of ``fn`` (each repeated until ``floor`` seconds pass)."""
    best = float("inf")
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= floor:
                break
        best = min(best, dt / n)
    return best


def measure_rates(repeats=3, sizes=SIZES):
    """``{"bandwidth": {bytes: bytes/s}, "gemm_macs": multiply-adds/s, "threads"}``: the best
    streaming rate (a reduction reading the buffer; a copy, its read and write counted) per buffer
    size, and the best rate of ``2048^3`` float32 products, on torch's current threads."""
    bw = {}
    with torch.no_grad():
        for size in sizes:
            a = torch.rand(size // FLOAT)
            b = torch.empty_like(a)
            read = size / _best(lambda: a.sum(), repeats)
            copy = 2 * size / _best(lambda: b.copy_(a), repeats)
            bw[size] = max(read, copy)
            del a, b
        n = 2048
        x, w = torch.rand(n, n), torch.rand(n, n)
        out = torch.empty(n, n)
        gemm = n ** 3 / _best(lambda: torch.mm(x, w, out=out), repeats, floor=0.2)
    return {"bandwidth": bw, "gemm_macs": gemm, "threads": torch.get_num_threads()}


def best_of(*measured):
    """The best rate of each kind over several ``measure_rates`` results (taken at the start and
    at the end of a run: a rate measured while other work held the cores is too low, and a bound
    made from it too high)."""
    measured = [m for m in measured if m]
    bw = {}
    for m in measured:
        for k, v in m["bandwidth"].items():
            bw[int(k)] = max(bw.get(int(k), 0.0), float(v))
    return {"bandwidth": bw, "gemm_macs": max(float(m["gemm_macs"]) for m in measured),
            "threads": measured[0].get("threads")}


def bandwidth_for(rates, nbytes):
    """``BW(W)`` of the module doc: the best rate over buffers of at most ``nbytes``."""
    bw = {int(k): float(v) for k, v in rates["bandwidth"].items()}
    fits = [v for k, v in bw.items() if k <= nbytes]
    return max(fits) if fits else max(bw.values())


def layer_work(layer, g, k_in, k_out):
    """``(bytes, macs)`` a call of ``layer`` on ``g`` with new ``k_in``-wide features must do
    (module doc)."""
    from dgl import nn as dglnn
    heads = int(getattr(layer, "_num_heads", 1))
    k = int(getattr(layer, "_k", 1))
    if isinstance(layer, dglnn.TAGConv):
        blocks = k + 1
    elif isinstance(layer, dglnn.SAGEConv) and hasattr(layer, "fc_self"):
        blocks = 2
    else:
        blocks = 1
    u, _ = g.edges()
    used_src = int(torch.unique(u).numel())
    n_dst = g.num_dst_nodes() if g.is_block else g.num_nodes()
    nbytes = FLOAT * (used_src * k_in + n_dst * heads * k_out + blocks * k_in * heads * k_out) \
        + INDEX * g.num_edges()
    macs = blocks * n_dst * k_in * heads * k_out
    return nbytes, macs


def bound_seconds(rates, nbytes, macs):
    """``max(bytes / BW(bytes), macs / GEMM)`` (module doc)."""
    return max(nbytes / bandwidth_for(rates, nbytes), macs / float(rates["gemm_macs"]))


def layer_bound(rates, layer, g, k_in, k_out):
    """Seconds no correct call of ``layer`` on new features can beat on this machine."""
    return bound_seconds(rates, *layer_work(layer, g, k_in, k_out))


__all__ = ["measure_rates", "layer_work", "layer_bound", "bound_seconds", "bandwidth_for",
           "best_of"]
