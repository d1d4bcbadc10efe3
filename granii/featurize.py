"""Graph and embedding-size features for the per-primitive cost models.

``graph_features(gi)`` describes the graph of a ``GraphInfo`` by a fixed, ordered set of numbers
(``FEATURE_NAMES``); ``featurize(gi, sizes)`` appends features of the embedding sizes. The cost is
``O(N)`` plus ``O(K log N)`` for ``K = LOCALITY_SAMPLES`` edges, given the destination CSR of ``gi``
and its out-degrees (both cached in ``gi`` and shared with the kernels); the result is cached in
``gi.cache`` too, so a second call is a lookup.

Degree statistics, for ``x`` the in-degrees (``n = num_dst`` rows of ``A``) or the out-degrees
(``n = num_src``), ``m = sum(x) = E`` and ``mu = m / n``:

* ``max``, ``max_over_avg = max / mu``;
* ``std = sqrt(mean((x - mu)^2))``, ``cv = std / mu``, ``skew = mean((x - mu)^3) / std^3``;
* ``gini = sum_ij |x_i - x_j| / (2 n^2 mu)
  = 2 sum_i i x_(i) / (n m) - (n + 1) / n`` (``x_(i)`` ascending, ``i`` from 1):
  0 for equal degrees, towards 1 when few rows hold all edges;
* ``entropy = -sum_i p_i ln p_i / ln n`` with ``p_i = x_i / m``: 1 for equal degrees;
* ``empty_frac``: share of rows with ``x_i = 0``.

All are computed from the degree histogram ``c_v = #{i : x_i = v}`` in ``O(n + max)``, built
chunk by chunk so the degree vector never leaves the cache.
Undefined values (no rows, no edges, constant degrees) are 0.

Locality, over the edges ``u -> v`` (``v`` a destination row, ``u`` a source column; a block's
destinations are its first sources, so ids are comparable) with ``n = max(num_src, num_dst)``:
``locality_dist = mean |u - v| / n`` (about 1/3 for random graphs, near 0 for banded ones) and
``locality_log_dist = mean log2(1 + |u - v|) / log2(1 + n)``. Exact for ``E <= K``; otherwise
averaged over the ``K`` edges at evenly spaced positions of the CSR (deterministic).
"""
import math

import numpy as np
import torch

LOCALITY_SAMPLES = 1 << 14
_CHUNK = 1 << 16

_DEGREE_STATS = ["max", "log2_max", "max_over_avg", "std", "cv", "skew", "gini", "entropy",
                 "empty_frac"]

FEATURE_NAMES = (
    ["num_src", "num_dst", "num_edges", "log2_num_src", "log2_num_dst", "log2_num_edges",
     "density", "log10_density", "avg_in_degree", "avg_out_degree", "log2_avg_in_degree",
     "log2_avg_out_degree"]
    + [f"in_deg_{s}" for s in _DEGREE_STATS]
    + [f"out_deg_{s}" for s in _DEGREE_STATS]
    + ["locality_dist", "locality_log_dist"]
)

_EDGES, _SRC, _DST = (FEATURE_NAMES.index(n) for n in ("num_edges", "num_src", "num_dst"))


def _div(a, b):
    return a / b if b else 0.0


def _chunked_histogram(length, chunk):
    """``sum_j bincount(chunk(lo_j, hi_j))`` over cache-sized ranges ``[lo_j, hi_j)`` of
    ``range(length)``, so the degree vector is never materialised in full."""
    hist = np.zeros(1, dtype=np.int64)
    for lo in range(0, length, _CHUNK):
        part = np.bincount(chunk(lo, min(lo + _CHUNK, length)))
        if len(part) > len(hist):
            part[: len(hist)] += hist
            hist = part
        else:
            hist[: len(part)] += part
    return hist


def degree_stats(degrees):
    """The ``_DEGREE_STATS`` of an integer degree vector, as a dict."""
    if isinstance(degrees, torch.Tensor):
        degrees = degrees.cpu()
    return histogram_stats(np.bincount(np.asarray(degrees, dtype=np.int64)))


def histogram_stats(hist):
    """The ``_DEGREE_STATS`` of the degrees with histogram ``hist[v] = #{i : x_i = v}``."""
    hist = np.trim_zeros(np.asarray(hist, dtype=np.float64), "b")
    n = float(hist.sum())
    if n == 0:
        return dict.fromkeys(_DEGREE_STATS, 0.0)
    v = np.arange(len(hist), dtype=np.float64)
    m = float(hist @ v)
    mu = m / n
    dev = v - mu
    var = float(hist @ (dev * dev)) / n
    std = math.sqrt(var)
    third = float(hist @ (dev * dev * dev)) / n
    before = np.cumsum(hist) - hist
    rank_sum = float(v @ (hist * before + hist * (hist + 1) / 2))
    vlogv = v[1:] * np.log(v[1:])
    top = float(len(hist) - 1)
    return {
        "max": top,
        "log2_max": math.log2(1 + top),
        "max_over_avg": _div(top, mu),
        "std": std,
        "cv": _div(std, mu),
        "skew": _div(third, std ** 3) if std > 1e-12 * max(mu, 1.0) else 0.0,
        "gini": 2 * rank_sum / (n * m) - (n + 1) / n if m else 0.0,
        "entropy": _div(math.log(m) - float(hist[1:] @ vlogv) / m, math.log(n)) if m else 0.0,
        "empty_frac": float(hist[0]) / n,
    }


def _locality(indptr, indices, n):
    """``(mean |u - v| / n, mean log2(1 + |u - v|) / log2(1 + n))`` over (sampled) CSR edges."""
    e = len(indices)
    if e == 0 or n == 0:
        return 0.0, 0.0
    if e <= LOCALITY_SAMPLES:         # every edge: each row's number repeated per edge
        rows = np.repeat(np.arange(len(indptr) - 1, dtype=np.int64), np.diff(indptr))
        dist = np.abs(indices - rows).astype(np.float64)
    else:
        pos = np.arange(LOCALITY_SAMPLES, dtype=np.int64) * e // LOCALITY_SAMPLES
        rows = np.searchsorted(indptr, pos, side="right") - 1
        dist = np.abs(indices[pos] - rows).astype(np.float64)
    return float(dist.mean()) / n, float(np.log2(1 + dist).mean()) / math.log2(1 + n)


def _in_histogram(indptr):
    return _chunked_histogram(len(indptr) - 1, lambda lo, hi: np.diff(indptr[lo:hi + 1]))


def _out_histogram(gi):
    if "csr_out" in gi.cache:
        return _in_histogram(gi.csr_out()[0].cpu().numpy())
    deg = gi.out_degrees().cpu().numpy()
    return _chunked_histogram(len(deg), lambda lo, hi: deg[lo:hi].astype(np.int64))


def _compute(gi):
    counted = gi.counted()            # int32 where it fits: read as it is, never widened
    indptr, indices = counted[:2] if counted is not None else gi.csr_in()[:2]
    indptr, indices = indptr.cpu().numpy(), indices.cpu().numpy()
    n_src, n_dst, e = float(gi.num_src), float(gi.num_dst), float(gi.num_edges)
    density = _div(e, n_src * n_dst)
    avg_in, avg_out = _div(e, n_dst), _div(e, n_src)
    feats = {
        "num_src": n_src,
        "num_dst": n_dst,
        "num_edges": e,
        "log2_num_src": math.log2(1 + n_src),
        "log2_num_dst": math.log2(1 + n_dst),
        "log2_num_edges": math.log2(1 + e),
        "density": density,
        "log10_density": math.log10(density) if density > 0 else -20.0,
        "avg_in_degree": avg_in,
        "avg_out_degree": avg_out,
        "log2_avg_in_degree": math.log2(1 + avg_in),
        "log2_avg_out_degree": math.log2(1 + avg_out),
    }
    for side, hist in (("in", _in_histogram(indptr)), ("out", _out_histogram(gi))):
        for key, val in histogram_stats(hist).items():
            feats[f"{side}_deg_{key}"] = val
    feats["locality_dist"], feats["locality_log_dist"] = _locality(
        indptr, indices, max(gi.num_src, gi.num_dst))
    return {name: float(feats[name]) for name in FEATURE_NAMES}


def graph_features(gi):
    """``{name: value}`` for ``FEATURE_NAMES`` (in that order), cached in ``gi.cache``."""
    return dict(gi.memo("graph_features", lambda: _compute(gi)))


def size_feature_names(size_names):
    """Names of the embedding-size features for the sizes ``size_names`` (taken in sorted order).

    Per size ``k``: ``k``, ``log2_k``, ``E*k`` (sparse work), ``src*k``, ``dst*k`` (dense rows);
    per pair ``k1 < k2``: ``k1*k2`` and ``dst*k1*k2``, ``src*k1*k2`` (dense transform work) and
    their log2.
    """
    keys = sorted(size_names)
    names = []
    for k in keys:
        names += [k, f"log2_{k}", f"E*{k}", f"src*{k}", f"dst*{k}", f"log2_E*{k}"]
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            names += [f"{a}*{b}", f"dst*{a}*{b}", f"src*{a}*{b}", f"log2_dst*{a}*{b}"]
    return names


def feature_names(size_names):
    """Column names of ``featurize(gi, sizes)`` for a sizes dict with keys ``size_names``."""
    return list(FEATURE_NAMES) + size_feature_names(size_names)


def featurize(gi, sizes):
    """Graph features followed by embedding-size features, float64, in ``feature_names(sizes)``
    order. ``sizes`` maps size names to values, e.g. ``{"k_in": 32, "k_out": 256}``."""
    row = gi.memo("graph_feature_row", lambda: [graph_features(gi)[n] for n in FEATURE_NAMES])
    e, src, dst = row[_EDGES], row[_SRC], row[_DST]
    keys = sorted(sizes)
    vals = []
    for k in keys:
        s = float(sizes[k])
        vals += [s, math.log2(s) if s > 0 else -1.0, e * s, src * s, dst * s, math.log2(1 + e * s)]
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            p = float(sizes[a]) * float(sizes[b])
            vals += [p, dst * p, src * p, math.log2(1 + dst * p)]
    return np.array(row + vals, dtype=np.float64)


def class_shape(n, e, in_deg, out_deg, stats=None):
    """What places a whole graph in a class of graphs one decision serves (``dispatch``): with
    ``n`` nodes, ``e`` edges and float degree vectors ``in_deg``, ``out_deg``,

        (log2(1 + n), log2(1 + e), log2(1 + max in_deg), log2(1 + max out_deg),
         log2(1 + std in_deg))

    Two graphs are alike when every coordinate differs by at most a set slack: sizes, largest
    degrees and the spread of the in-degrees within a factor. ``O(n)``, on degree vectors the
    kernels' index already counted; ``stats``, when that pass gave them: ``(max in_deg,
    max out_deg, std in_deg)``."""
    if n == 0 or e == 0:
        return (math.log2(1 + n), math.log2(1 + e), 0.0, 0.0, 0.0)
    if stats is not None:
        max_in, max_out, std_in = stats
        return (math.log2(1 + n), math.log2(1 + e), math.log2(1 + max_in),
                math.log2(1 + max_out), math.log2(1 + std_in))
    d_in, d_out = in_deg.cpu().numpy(), out_deg.cpu().numpy()
    return (math.log2(1 + n), math.log2(1 + e), math.log2(1 + float(d_in.max())),
            math.log2(1 + float(d_out.max())), math.log2(1 + float(d_in.std())))
