"""A short machine calibration that lets cost models trained on one machine price calls on another.

The calibration times four reference calls (a few seconds in all):

    stream   row_scale/torch   n = 2^18 rows, k = 64 (64 MiB in, 64 MiB out)  (memory bandwidth)
    gemm     gemm/torch        m = 8192, k = 256, n = 256                (GEMM rate)
    sparse   spmm/dgl          uniform graph, 2^16 nodes, 2^20 edges, k = 64  (SpMM gather rate)
    small    spmm/dgl          uniform graph, 2,000 nodes, 16,000 edges, k = 32  (a small call:
                               dispatch overhead and threads waking up)

and the same two SpMM calls with each other implementation of the graph kernels that has one
(``IMPL_REFERENCE``: ``sparse_native``, ``small_native``, ``sparse_torch_csr``,
``small_torch_csr``), where it is available: each call whose implementation this environment
runs (``measurable``). Without DGL (PyTorch Geometric's stack) DGL's two calls are left out and
the reference graphs are index graphs of the same edges.

Sparse kernels of different libraries do not keep their speed ratio from one processor to
another: measured on an Intel AVX-512 machine against the AMD EPYC the shipped models were
trained on, DGL's SpMM on the sparse reference took 2.0x, granii's native one 3.0x and torch's
CSR product 1.4x the models' predictions (small reference: 1.7x, 1.2x, 0.7x). One ratio for
every sparse kernel, DGL's, then priced the native kernels a third too low, and on graphs the
project never saw the tie-break timed only native plans where DGL's SpMM was the fastest. So a
sparse primitive is scaled by the references of its own implementation where both machines have
them, by DGL's otherwise, and where DGL's were not timed by the native kernels', then torch's
CSR product's (``Transfer.sparse_references``).

Transfer. A model trained on machine ``M`` predicts ``t_M(call)``; on this machine ``H`` the call
is priced as

    log t_H(call) = log t_M(call) + log r(call)
    log r(call)   = interpolation, in log t_M(call), between log(c_H[small] / c_M[small]) at
                    t_M = c_M[small] and log(c_H[cls] / c_M[cls]) at t_M = c_M[cls]
                    (constant beyond either end)

where ``c_X[name]`` is the reference time on machine ``X`` and ``cls`` the class of the primitive
(``CLASS``: GEMM, streaming row operations, or sparse gathers). In other words the model's target is
measured in units of the machine's own reference time, so the learned shape (how the cost grows
with the graph and the sizes, which implementation wins where) carries over and only the scale
changes. Small calls scale like the small reference, large ones like their class.

The reference times of a model folder are its own models' predictions of the four reference calls
(consistent with what the models learned, whatever the load while they were profiled); the
calibration measured at init (the manifest's ``calibration``) stands in for a reference call
without a model. This machine's are measured once per fingerprint and cached in
``$GRANII_CACHE`` (default ``~/.cache/granii``) as ``calibration-<fingerprint id>.json``.

A calibration measured while other processes held the cores is not this machine's: a parallel
call then waits whole scheduler slices for a descheduled thread (the small call took 24 ms on a
2-core machine under a load of 10, against 0.1 ms alone; another time the small call found a
quiet moment, 0.4 ms, while the GEMM and sparse calls took 6x and 24x their time), and ratios
that far apart reorder plans (``bench/decisions_unseen.py --calibrations``). So a measurement
taken while other processes used more cores than the calibration's threads left free
(``/proc/stat``), or whose small call exceeds ``CONTENDED`` (the bound
``profiling.harness.Probe`` puts on the same call), is taken again, and if every try was
contended it is not used: the models price calls unscaled, as on their own machine, and
processes measure again once ``BUSY_AGAIN`` seconds have passed (so a busy machine does not
spend seconds calibrating in every process). A cached calibration written before these checks
(no ``others_cores``), or over the bound, is measured again.
"""
import hashlib
import importlib.util
import json
import math
import os
import time
from pathlib import Path

from .diskcache import cache_dir, write_whole


# name -> (primitive, implementation, graph, sizes); a graph ``(n, m, seed)`` is the undirected
# ``granii.reference.uniform(n, m, seed)`` (2 m edges), ``None`` for a dense primitive
REFERENCE = {
    "stream": ("row_scale", "torch", None, {"n": 1 << 18, "k": 64}),
    "gemm": ("gemm", "torch", None, {"m": 8192, "k": 256, "n": 256}),
    "sparse": ("spmm", "dgl", (65536, 524288, 11), {"k": 64}),
    "small": ("spmm", "dgl", (2000, 8000, 12), {"k": 32}),
}
# implementation -> the suffix of its own sparse references (``sparse<suffix>``, ``small<suffix>``)
IMPL_REFERENCE = {"native": "_native", "torch_csr": "_torch_csr"}
for _impl, _suffix in IMPL_REFERENCE.items():
    REFERENCE["sparse" + _suffix] = ("spmm", _impl) + REFERENCE["sparse"][2:]
    REFERENCE["small" + _suffix] = ("spmm", _impl) + REFERENCE["small"][2:]
# the suffixes of the sparse references in the order they stand in for each other: DGL's, then
# each other implementation's
SPARSE_SUFFIXES = ("",) + tuple(IMPL_REFERENCE.values())
CLASS = {"gemm": "gemm", "head_gemm": "gemm", "row_scale": "stream", "add": "stream",
         "cat": "stream", "row_slice": "stream", "diag_mul": "stream"}
FORMAT = 4              # 2: each sparse implementation's references; 3: timed in the pool;
                        # 4: each call's runs in a row
CONTENDED = 2e-3        # seconds of the small reference call beyond which the cores were busy
QUIET_TRIES = 2         # measurements made before a contended machine's calibration is dropped
QUIET_PAUSE = 0.5       # seconds between them
BUSY_AGAIN = 600.0      # seconds a busy verdict is kept before processes measure again


def prim_class(prim):
    """The reference a primitive scales with: ``gemm``, ``stream`` or (every sparse one) ``sparse``."""
    return CLASS.get(prim, "sparse")


class _Graphs(dict):
    """``{spec: GraphInfo}`` that also holds the graphs (a ``GraphInfo`` refers to its graph
    weakly)."""
    keep = ()


def _graphs(names=REFERENCE):
    """``{spec: GraphInfo}`` of the reference graphs of the reference calls ``names``
    (``granii.reference.uniform``)."""
    from .graph import GraphInfo
    from .reference import uniform
    out, keep = _Graphs(), []
    for name in names:
        spec = REFERENCE[name][2]
        if spec is not None and spec not in out:
            keep.append(uniform(*spec, undirected=True))
            out[spec] = GraphInfo(keep[-1])
    out.keep = keep
    return out


def _dims(prim, gi, sizes):
    dims = dict(sizes)
    if prim.startswith("spmm") and gi is not None:
        dims["n"] = gi.num_dst
    return dims


def _runs(impl):
    """Whether this environment runs implementation ``impl`` of a reference call (DGL's kernels
    are registered everywhere and need DGL)."""
    if impl != "dgl":
        return True
    try:
        return importlib.util.find_spec("dgl") is not None
    except (ImportError, ValueError):
        return False


def measurable():
    """The names of the reference calls this environment can time: those of ``REFERENCE`` whose
    implementation is registered and runs here."""
    from . import kernels
    return tuple(name for name, (prim, impl, _, _) in REFERENCE.items()
                 if impl in kernels.implementations(prim) and _runs(impl))


def measure(repeat=7):
    """``{name: seconds}``: the fastest of ``repeat`` runs of each reference call in a row (after
    one warm-up), as the profiler times the models' points: interleaved with the other reference
    calls, the stream reference's 64 MiB came back from memory each time and took twice as long
    (6.1 ms against 3.0 ms here), which priced every row operation of a plan, whose input the step
    before has just written, twice too high. Other processes on the cores only add time (a thread
    waiting for a core), so the fastest run is the machine's own speed."""
    import torch
    from . import kernels
    from .kernels import pool
    from .reference import dense_inputs, graph_inputs
    names = measurable()             # not the native kernels without a compiler, nor DGL's
    graphs = _graphs(names)          # without DGL
    fns = {}
    for name in names:
        prim, impl, spec, sizes = REFERENCE[name]
        fn = kernels.get(prim, impl)
        if spec is None:
            args = dense_inputs(prim, sizes)
            fns[name] = lambda fn=fn, args=args: fn(*args)
        else:
            gi = graphs[spec]
            args = graph_inputs(prim, gi, sizes)
            fns[name] = lambda fn=fn, gi=gi, args=args: fn(gi, *args)
    samples = {k: [] for k in fns}
    # inside granii's memory pool, as the profiler times the models' points and as plans run:
    # outside it the stream reference's 64 MiB result is a fresh mapping at every call, and its
    # page faults (23 ms here against 4.4 ms in the pool) priced every row operation 5x too high
    pool.install()
    pool.enter()
    try:
        with torch.no_grad():
            for k, fn in fns.items():        # each call's runs in a row, as the profiler's
                fn()
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    fn()
                    samples[k].append(time.perf_counter() - t0)
    finally:
        pool.leave()
    return {k: min(v) for k, v in samples.items()}


def _digest(value):
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def prediction_key(manifest):
    """What predictions of the reference calls depend on: ``REFERENCE`` and the models of the
    folder (each model file's SHA-256 and feature names, as ``manifest`` lists them)."""
    models = {k: [v.get("sha256"), v.get("features"), v.get("baseline")]
              for k, v in (manifest.get("models") or {}).items()}
    return _digest([REFERENCE, models])


def prediction_record(model):
    """What a model folder's manifest keeps under ``calibration.predicted``: its models'
    predictions of the reference calls (``predicted``) and the ``prediction_key`` they hold for."""
    return {"key": prediction_key(model.manifest), "times": predicted(model)}


def stored_prediction(manifest):
    """The predictions of the reference calls stored in ``manifest`` when they were made for
    these reference calls and these models (``prediction_key``), else ``None``. Predicting them
    again means building the reference graphs and featurizing them: about a second in every
    process that transfers the folder."""
    record = (manifest.get("calibration") or {}).get("predicted")
    if isinstance(record, dict) and record.get("key") == prediction_key(manifest) and \
            isinstance(record.get("times"), dict):
        return dict(record["times"])
    return None


def predicted(model):
    """``{name: seconds}`` the forward models of ``model`` (a ``LearnedCost``) predict for the
    reference calls: the calibration of the machine the models were trained on, when its
    manifest does not hold a measured one. Names without a model are left out."""
    names = [n for n, (prim, impl, _, _) in REFERENCE.items() if model.has_model(prim, impl)]
    graphs = _graphs(names)
    out = {}
    for name in names:
        prim, impl, spec, sizes = REFERENCE[name]
        gi = graphs.get(spec)
        try:
            out[name] = float(model.predict_many(prim, impl, gi, [_dims(prim, gi, sizes)],
                                                 rescale=False)[0])
        except KeyError:      # a damaged file, dropped from the model with a warning
            continue
    return out


def _complete(times):
    """Whether reference ``times`` hold what a transfer needs: the streaming and GEMM calls and
    both sparse calls of one implementation."""
    return {"stream", "gemm"} <= set(times) and any(
        "sparse" + s in times and "small" + s in times
        for s in SPARSE_SUFFIXES)


def contended(times):
    """Whether reference ``times`` were measured while other processes held the cores (the
    small call's time says so, DGL's or else the first other one timed; a short call can also
    fall between two other processes' turns, so ``this_machine`` asks ``/proc/stat`` too)."""
    small = next((times["small" + s] for s in SPARSE_SUFFIXES if "small" + s in times), 0.0)
    return small > CONTENDED


def _busy_seconds():
    """``(CPU seconds the machine's CPUs were busy, this process's CPU seconds)``; the first
    ``None`` where ``/proc/stat`` cannot be read."""
    import resource
    own = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open("/proc/stat") as f:
            parts = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(parts[:8]) - parts[3] - parts[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = None
    return busy, own.ru_utime + own.ru_stime


def _measure_with_others():
    """``(measure(), cores other processes used meanwhile)`` (0 when that cannot be told: no
    ``/proc/stat``, or too short a measurement for its clock ticks)."""
    wall, (busy, own) = time.perf_counter(), _busy_seconds()
    times = measure()
    wall, (busy2, own2) = time.perf_counter() - wall, _busy_seconds()
    if busy is None or busy2 is None or wall < 0.2:
        return times, 0.0
    return times, max(0.0, (busy2 - busy - (own2 - own)) / wall)


def _spare_cores():
    """Cores others may use without taking one from the calibration's threads (half a core of
    slack)."""
    import torch
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(cores - torch.get_num_threads(), 0) + 0.5


def this_machine(fingerprint, refresh=False, log=None):
    """This machine's calibration ``{"times": {name: seconds}, "fingerprint_id", "seconds",
    "measured_at"}``, measured once and cached per fingerprint id; ``times`` is empty (and
    ``contended`` holds what was measured) when every try was contended (module doc)."""
    from .fingerprint import fingerprint_id
    fid = fingerprint_id(fingerprint)
    path = cache_dir() / f"calibration-{fid}.json"
    if not refresh and path.is_file():
        try:
            cal = json.loads(path.read_text())
            if cal.get("format") == FORMAT and _complete(cal.get("times", {})) \
                    and "others_cores" in cal and not contended(cal["times"]):
                return cal
            if cal.get("format") == FORMAT and cal.get("contended") and \
                    0 <= time.time() - cal.get("measured_s", -1) < BUSY_AGAIN:
                return cal                # busy a moment ago: not measured again yet
        except (OSError, ValueError, TypeError):
            pass
    t0 = time.perf_counter()
    for attempt in range(QUIET_TRIES):
        if attempt:
            time.sleep(QUIET_PAUSE)
        times, others = _measure_with_others()
        busy = contended(times) or others > _spare_cores()
        if not busy:
            break
    cal = {"format": FORMAT, "fingerprint_id": fid, "times": times,
           "seconds": round(time.perf_counter() - t0, 2), "others_cores": round(others, 2),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cache": str(path)}
    if busy:                      # not this machine's speed: not used; kept as "busy"
        cal.update(times={}, contended=times, measured_s=time.time())
        if log is not None:
            log(f"granii: the machine was busy while calibrating (other processes used "
                f"{others:.1f} cores); models unscaled")
    if not write_whole(path, (json.dumps(cal, indent=1, sort_keys=True) + "\n").encode()):
        cal["cache"] = None
    if log is not None:
        log(f"granii: calibrated this machine in {cal['seconds']:.1f} s")
    return cal


class Transfer:
    """The scale ``r(call)`` of the module docstring from the reference times ``model_times`` (of
    the machine the models were trained on) to ``here_times`` (this machine)."""

    def __init__(self, model_times, here_times):
        self.model_times = dict(model_times)
        self.here_times = dict(here_times)

    def ratio(self, name):
        m, h = self.model_times.get(name), self.here_times.get(name)
        return h / m if m and h and m > 0 and h > 0 else None

    def sparse_references(self, impl):
        """``(large, small)`` reference names that scale a sparse primitive run by ``impl``: its
        own implementation's where both machines timed both, else DGL's, else the native
        kernels', else torch's CSR product's; DGL's names where none has both."""
        own = IMPL_REFERENCE.get(impl)
        for suffix in ((own,) if own else ()) + SPARSE_SUFFIXES:
            if self.ratio("sparse" + suffix) and self.ratio("small" + suffix):
                return "sparse" + suffix, "small" + suffix
        return "sparse", "small"

    def scale(self, prim, seconds, impl=None):
        """``seconds`` (predicted for the models' machine for ``prim`` run by ``impl``) in this
        machine's seconds."""
        cls, small_name = prim_class(prim), "small"
        if cls == "sparse":
            cls, small_name = self.sparse_references(impl)
        big, small = self.ratio(cls), self.ratio(small_name)
        if big is None and small is None:
            return seconds
        if big is None or small is None:
            return seconds * (big or small)
        lo, hi = math.log(self.model_times[small_name]), math.log(self.model_times[cls])
        t = math.log(max(seconds, 1e-12))
        if hi <= lo:
            w = 1.0 if t >= hi else 0.0
        else:
            w = min(max((t - lo) / (hi - lo), 0.0), 1.0)
        return seconds * math.exp((1 - w) * math.log(small) + w * math.log(big))

    def summary(self):
        return {k: self.ratio(k) for k in REFERENCE}


def analytical_rates(times):
    """Roofline rates of ``granii.costmodel.AnalyticalCost`` from reference times:
    ``flop_rate = 2 m k n / t_gemm``, ``stream_rate = 2 * 4 n k / t_stream``,
    ``gather_rate = 4 E k / t_sparse`` and ``call_overhead = t_small / 2`` (a rough share); the
    sparse calls DGL's, else the first other implementation's timed."""
    times = dict(times)
    for name in ("sparse", "small"):
        if not times.get(name):
            times[name] = next((times[name + s] for s in SPARSE_SUFFIXES if times.get(name + s)),
                               None)
    out = {}
    if times.get("gemm"):
        s = REFERENCE["gemm"][3]
        out["flop_rate"] = 2.0 * s["m"] * s["k"] * s["n"] / times["gemm"]
    if times.get("stream"):
        s = REFERENCE["stream"][3]
        out["stream_rate"] = 2 * 4.0 * s["n"] * s["k"] / times["stream"]
    if times.get("sparse"):
        edges = 2 * REFERENCE["sparse"][2][1]
        out["gather_rate"] = 4.0 * edges * REFERENCE["sparse"][3]["k"] / times["sparse"]
    if times.get("small"):
        out["call_overhead"] = times["small"] / 2
    return out
