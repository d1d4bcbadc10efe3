"""Cost models fitted to timings measured on a GPU (``granii/profiling/gpu.py``).

On a GPU every kernel granii runs streams its operands through memory, so its time is close to a
sum of terms, each a count of work of one kind over a rate. Per (primitive, implementation,
phase), with ``E`` edges, ``N`` rows, ``k`` columns, ``h`` heads and ``dmax`` the largest
in-degree (the serial path of a program per row)::

    spmm family    t = c0 + c1 E k + c2 N k + c3 E + c4 dmax k
    edge scores    t = c0 + c1 E h + c2 N h + c3 dmax h             (sddmm_*, edge_softmax)
    gat_aggregate  t = c0 + c1 E k + c2 E h + c3 N k + c4 dmax k
    gemm           t = c0 + c1 m k n + c2 (m k + k n + m n)
    head_dot       t = c0 + c1 m k
    row_scale      t = c0 + c1 n k

with every ``c >= 0`` (``c0`` the launch overhead), fitted by non-negative least squares on the
relative error. ``load`` reads a folder's ``gpu_model.json``; ``FittedCost`` prices what it has
and asks the analytical model of the same GPU for the rest.
"""
import json
import math
from pathlib import Path

FORMAT = 1


def features(prim, n_src, n_dst, e, dmax, dims):
    """The terms of ``prim``'s model (module docstring), or ``None`` for a primitive without
    one."""
    k = dims.get("k", 1)
    h = dims.get("heads", 1)
    if prim == "gemm":
        m, kk, n = dims["m"], dims["k"], dims["n"]
        return [1.0, m * kk * n, m * kk + kk * n + m * n]
    if prim == "head_dot":
        return [1.0, dims["m"] * dims["k"]]
    if prim == "row_scale":
        return [1.0, dims["n"] * dims["k"]]
    if prim == "gat_aggregate":
        return [1.0, e * k, e * h, n_dst * k, dmax * k]
    if prim.startswith("spmm"):
        return [1.0, e * k, max(n_src, n_dst) * k, e, dmax * k]
    if prim.startswith("sddmm") or prim == "edge_softmax":
        return [1.0, e * h, max(n_src, n_dst) * h, dmax * h]
    return None


def fit(rows):
    """``{(prim, impl, phase): [c0, c1, ...]}`` from measured rows ``(prim, impl, phase, n_src,
    n_dst, e, dmax, dims, seconds)``: non-negative least squares of ``t / t_measured - 1``."""
    import numpy as np
    from scipy.optimize import nnls
    groups = {}
    for prim, impl, phase, n_src, n_dst, e, dmax, dims, sec in rows:
        x = features(prim, n_src, n_dst, e, dmax, dims)
        if x is not None and sec > 0 and math.isfinite(sec):
            groups.setdefault((prim, impl, phase), []).append((x, sec))
    out = {}
    for key, pts in groups.items():
        a = np.array([x for x, _ in pts], dtype=np.float64)
        t = np.array([s for _, s in pts], dtype=np.float64)
        scale = a.max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(a / scale / t[:, None], np.ones(len(t)))
        out[key] = (coef / scale).tolist()
    return out


def save(path, coefs, gpu, points):
    """Write the fitted ``coefs`` of ``gpu`` (its description) to ``path`` (JSON)."""
    entries = [{"prim": p, "impl": i, "phase": ph, "coef": c}
               for (p, i, ph), c in sorted(coefs.items())]
    Path(path).write_text(json.dumps({"format": FORMAT, "gpu": gpu, "points": points,
                                      "models": entries}, indent=1))


class FittedCost:
    """``predict(prim, impl, gi, dims)`` (and ``predict_train``) by a fitted model; pairs it has
    no model of go to ``fallback``."""

    def __init__(self, data, fallback):
        self.gpu = data["gpu"]
        self.name = f"fitted-gpu ({self.gpu})"
        self.fallback = fallback
        self.coefs = {(m["prim"], m["impl"], m["phase"]): m["coef"] for m in data["models"]}

    def has_model(self, prim, impl, phase="forward"):
        return (prim, impl, phase) in self.coefs

    def _seconds(self, prim, impl, gi, dims, phase):
        coef = self.coefs.get((prim, impl, phase))
        if coef is None:
            return None
        dmax = 0 if gi is None else gi.memo("max_in_degree", lambda: float(
            gi.in_degrees().max()) if gi.num_dst else 0.0)
        x = features(prim, 0 if gi is None else gi.num_src, 0 if gi is None else gi.num_dst,
                     0 if gi is None else gi.num_edges, dmax, dims)
        return None if x is None else sum(c * v for c, v in zip(coef, x))

    def predict(self, prim, impl, gi, dims):
        t = self._seconds(prim, impl, gi, dims, "forward")
        return self.fallback.predict(prim, impl, gi, dims) if t is None else t

    def predict_train(self, prim, impl, gi, dims):
        return self._seconds(prim, impl, gi, dims, "train")


def load(folder, gpu, fallback):
    """The ``FittedCost`` in ``folder`` whose GPU description starts as ``gpu`` does (model
    name and SM count), or ``None``."""
    for path in sorted(Path(folder).glob("*/gpu_model.json")) + sorted(
            Path(folder).glob("gpu_model.json")):
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT and _same_gpu(data.get("gpu", ""), gpu):
            return FittedCost(data, fallback)
    return None


def _same_gpu(a, b):
    return a.split(",")[:2] == b.split(",")[:2]
