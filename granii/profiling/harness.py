"""The profiling run: time every (primitive, implementation) over graphs and sizes, resumably.

Records go to ``<run_dir>/points.jsonl``, one JSON line per (point, implementation):

    key, prim, impl, phase, graph, sizes, num_src, num_dst, num_edges,
    status   "ok" | "skipped_memory" | "skipped_slow" | "error"
    median   seconds of one call (median over rounds), samples (every round), iqr: in phase
             "forward" one forward call without autograd, in phase "train" the forward with
             autograd and the backward (``points.runners``)
    reason   why a point was skipped or failed

and the features of each graph to ``<run_dir>/graphs.jsonl``. A point's lines are written together
and flushed, so an interrupted run loses at most the point in progress; a resumed run reads the
keys back and skips them (skipped points included), unless the records were measured with other
native kernels than the ones loaded now (``kernels.json`` in the run directory holds the hash of
their sources): then it starts over, so no model is trained on timings of two builds.
Implementations of a point run side by side (``timing.side_by_side``) so load on the machine hits
all of them alike.
"""
import gc
import json
import math
import statistics
import time
import warnings
from pathlib import Path

import torch

from granii.featurize import FEATURE_NAMES, graph_features
from granii.graph import GraphInfo, graph_info
from granii.kernels import native, pool
from granii.kernels.spmm import csr_tensor
from granii.profiling import generators as gen
from granii.profiling import points as pts
from granii.profiling.timing import fix_threads, side_by_side, time_once

POINTS = "points.jsonl"
GRAPHS = "graphs.jsonl"
_SPREAD = 2.5               # see unsettled()
_OVERHEAD = 0.02            # seconds of bookkeeping per point, for the time estimate
_COLLECT_BYTES = 256 << 20  # garbage-collect after points and graphs larger than this


# -- the record files ------------------------------------------------------------------------------
def read_jsonl(path):
    """The parseable JSON lines of ``path`` (a line cut off by an interruption is ignored)."""
    out = []
    if not Path(path).is_file():
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _append(path, rows):
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    with open(path, "a") as f:
        f.write(text)
        f.flush()


def unsettled(r):
    """A record measured on a contended machine, or whose rounds disagree: median more than
    ``_SPREAD`` times the fastest round (and above 1 ms). Such medians hold waits for the cores
    (OpenMP threads descheduled in steps of the scheduler tick), not the kernel."""
    if r.get("contended"):
        return True
    return (r.get("status") == "ok" and r.get("median", 0) > 1e-3
            and r["median"] > _SPREAD * r.get("min", r["median"]))


def done_keys(run_dir, retry_contended=False):
    """Keys of the points already recorded in ``run_dir``; with ``retry_contended``, without
    those whose latest measurement of some implementation is ``unsettled``."""
    latest = {}
    for r in read_jsonl(Path(run_dir) / POINTS):
        if "key" in r:
            latest[(r["key"], r.get("impl"))] = unsettled(r)
    retry = {k for (k, _), bad in latest.items() if retry_contended and bad}
    return {k for k, _ in latest} - retry


def graph_table(run_dir):
    """``{graph name: record}`` of ``graphs.jsonl`` (the last record of a name wins)."""
    return {r["graph"]: r for r in read_jsonl(Path(run_dir) / GRAPHS) if "graph" in r}


def graph_record(name, gi):
    return {"graph": name, "num_src": gi.num_src, "num_dst": gi.num_dst,
            "num_edges": gi.num_edges, "is_block": bool(gi.is_block),
            "feature_names": list(FEATURE_NAMES), "features": graph_features(gi)}


def _weight(config, prim, sizes, n_impls, n_src=0, n_dst=0, e=0, phase="forward"):
    """Estimated seconds of one point: warm-up and repeat rounds of all implementations."""
    est = pts.estimate(prim, sizes, n_src, n_dst, e, phase) * n_impls
    if est > config.max_call:
        return _OVERHEAD
    t = est * 1.5       # the baseline is optimistic
    repeat = config.repeat_fast if t < 1e-3 else config.repeat
    return min(t * (config.warmup + repeat), t * (config.warmup + 3) + config.budget) + _OVERHEAD


# -- measuring -------------------------------------------------------------------------------------
def measure(fns, config, est, phase="forward"):
    """``{impl: (median, samples)}`` of the callables ``fns`` timed side by side, inside granii's
    memory pool as a layer's plans run (``granii.kernels.pool``: large results reuse blocks)."""
    repeat = config.repeat_fast if est < 1e-3 else config.repeat
    pool.install()
    pool.enter()
    try:
        with torch.set_grad_enabled(phase != "forward"):
            return side_by_side(fns, warmup=config.warmup, repeat=repeat, budget=config.budget)
    finally:
        pool.leave()


class Probe:
    """A contention check: a small parallel SpMM (2,000 nodes, 16,000 edges, ``k = 32``, about
    0.2 ms alone on 2 cores). When other processes keep the cores busy, a parallel kernel waits a
    scheduler time slice (milliseconds) for a descheduled thread, and the median of 3 probe runs
    rises above ``threshold``: the machine is contended and timings would measure the wait.

    The product runs in torch's own thread pool (granii's native kernel, or torch's CSR product
    without it): DGL's kernels run in another OpenMP runtime, whose spinning workers slowed the
    narrow GEMMs measured after each probe 2-2.5x (7,700 x 64 x 4: 249 against 117 us)."""

    def __init__(self, threshold=2e-3):
        self.threshold = threshold
        g = gen.uniform(2000, 16000, seed=1)
        x = torch.randn(2000, 32, generator=torch.Generator().manual_seed(0))
        self.fn = _pool_product(g, x)
        self.fn()
        self.last = (-math.inf, math.inf)       # (when, seconds) of the latest probe

    def seconds(self, runs=3):
        with torch.no_grad():
            t = statistics.median(time_once(self.fn) for _ in range(runs))
        self.last = (time.perf_counter(), t)
        return t

    def wait_quiet(self, max_wait, fresh=1.0):
        """Probe (or reuse a probe taken less than ``fresh`` seconds ago), sleeping while
        contended for up to ``max_wait`` seconds; returns ``(last probe seconds, seconds waited)``."""
        at, t = self.last
        if time.perf_counter() - at > fresh:
            t = self.seconds()
        waited = 0.0
        while t > self.threshold and waited < max_wait:
            pause = min(2.0, max_wait - waited)
            time.sleep(pause)
            waited += pause
            t = self.seconds()
        return t, waited


def _pool_product(g, x):
    """``A X`` of graph ``g`` as a function run in torch's thread pool."""
    if native.available():
        idx = native.csr_index(graph_info(g))
        x3 = x.reshape(x.shape[0], 1, -1)
        return lambda: torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x3)
    indptr, indices, _ = graph_info(g).csr_in()
    a = csr_tensor(indptr, indices, torch.ones(indices.numel()),
                   (g.num_dst_nodes(), g.num_src_nodes()))
    return lambda: torch.sparse.mm(a, x)


def _failing(fns, phase):
    """``{impl: reason}`` of the implementations whose first call raises (one broken kernel does
    not cost the others their point)."""
    failed = {}
    with torch.set_grad_enabled(phase != "forward"):
        for impl, fn in fns.items():
            try:
                fn()
            except (RuntimeError, ValueError, TypeError) as e:
                failed[impl] = f"{type(e).__name__}: {str(e)[:300]}"
    return failed


def _disagree(timings):
    """Some implementation's rounds disagree (see ``unsettled``)."""
    return any(med > 1e-3 and med > _SPREAD * min(samples) for med, samples in timings.values())


def _iqr(samples):
    if len(samples) < 4:
        return max(samples) - min(samples)
    q = statistics.quantiles(samples, n=4)
    return q[2] - q[0]


def _rows(key, prim, impls, graph, sizes, shape, status, timings=None, reason=None, probe=None,
          phase="forward"):
    n_src, n_dst, e = shape
    rows = []
    for impl in impls:
        r = {"key": key, "prim": prim, "impl": impl, "phase": phase, "graph": graph, "sizes": sizes,
             "num_src": n_src, "num_dst": n_dst, "num_edges": e, "status": status}
        if timings is not None:
            med, samples = timings[impl]
            r.update(median=med, min=min(samples), iqr=_iqr(samples),
                     samples=[round(s, 9) for s in samples])
        if probe is not None:
            r.update(probe=probe[0], contended=probe[1])
        if reason:
            r["reason"] = reason
        rows.append(r)
    return rows


KERNELS = "kernels.json"


def kernels_build():
    """What the timings depend on besides the machine: the native kernels loaded (the hash of
    their sources the timings depend on, as the models record it), or ``"none"`` without
    them."""
    from granii.fingerprint import native_build
    return native_build()


def _kernels_stamp(run_dir):
    """The ``kernels_build()`` a run's records were measured with, or ``None`` (not recorded)."""
    try:
        return json.loads((Path(run_dir) / KERNELS).read_text())["native_kernels"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Run:
    """State of one profiling run: config, files, done keys, counters, progress bar."""

    def __init__(self, config, run_dir, resume, log, retry_contended=False):
        self.config = config
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.points = self.dir / POINTS
        self.graphs = self.dir / GRAPHS
        was, now = _kernels_stamp(self.dir), kernels_build()
        stale = resume and self.points.is_file() and was != now
        if stale:
            log(f"granii: the records in {self.dir} were measured with other native kernels "
                f"({was or 'unrecorded'}, now {now}): profiling again from the start")
        if not resume or stale:
            for p in (self.points, self.graphs):
                p.unlink(missing_ok=True)
        (self.dir / KERNELS).write_text(json.dumps({"native_kernels": now}) + "\n")
        self.done = done_keys(self.dir, retry_contended)
        self.known_graphs = graph_table(self.dir)
        self.log = log
        self.counts = {}
        self.mem_limit = config.mem_fraction * pts.available_bytes()
        self.bar = None
        self.probe = Probe()
        self.wait_left = config.wait_budget
        self.waited = 0.0
        self.retried = 0
        self.deadline = math.inf
        self.stopped_early = False

    def count(self, prim, status):
        self.counts.setdefault(prim, {}).setdefault(status, 0)
        self.counts[prim][status] += 1

    def write(self, rows, prim, status, weight):
        _append(self.points, rows)
        self.done.add(rows[0]["key"])
        self.count(prim, status)
        if self.bar is not None:
            self.bar.update(weight)

    def run_point(self, prim, impls, graph, sizes, make_fns, shape, slow, phase="forward"):
        """Measure one point (or record why not); returns the seconds of one round of all impls."""
        key = pts.point_key(prim, graph, sizes, phase)
        weight = _weight(self.config, prim, sizes, len(impls), *shape, phase=phase)
        tag = prim if phase == "forward" else f"{prim}/{phase}"
        if time.perf_counter() > self.deadline:
            raise _TimeUp
        if key in self.done:
            self.count(tag, "resumed")
            if self.bar is not None:
                self.bar.update(weight)
            return None
        est = pts.estimate(prim, sizes, *shape, phase=phase)
        need = pts.point_bytes(prim, sizes, *shape) * (2 if phase == "train" else 1)
        row = lambda status, **kw: _rows(key, prim, impls, graph, sizes, shape, status,
                                         phase=phase, **kw)
        if need > self.mem_limit:
            reason = f"needs about {need / 2**30:.1f} GiB, limit {self.mem_limit / 2**30:.1f} GiB"
            self.write(row("skipped_memory", reason=reason), tag, "skipped_memory", weight)
            return None
        if slow or est * len(impls) > self.config.max_call:
            reason = slow or f"estimated {est * len(impls):.2f} s per round"
            self.write(row("skipped_slow", reason=reason), tag, "skipped_slow", weight)
            return None
        try:
            fns = make_fns()
            failed = _failing(fns, phase)
            if failed:
                self.write([r for i, reason in failed.items() for r in _rows(
                    key, prim, [i], graph, sizes, shape, "error", reason=reason, phase=phase)],
                    tag, "error", 0.0)
                fns = {i: f for i, f in fns.items() if i not in failed}
                impls = [i for i in impls if i not in failed]
                if not fns:
                    return None
            before, waited = self.probe.wait_quiet(min(self.config.max_wait, self.wait_left))
            self.wait_left -= waited
            self.waited += waited
            timings = measure(fns, self.config, est, phase)
            after = self.probe.seconds()
            for _ in range(self.config.retries):
                if max(before, after) <= self.probe.threshold and not _disagree(timings):
                    break
                # measured while other processes held the cores: wait for them (within the
                # budget) and measure again, keeping each implementation's fastest median
                before, waited = self.probe.wait_quiet(min(self.config.max_wait, self.wait_left))
                self.wait_left -= waited
                self.waited += waited
                again = measure(fns, self.config, est, phase)
                after = self.probe.seconds()
                self.retried += 1
                timings = {i: min(timings[i], again[i], key=lambda x: x[0]) for i in timings}
        except (RuntimeError, MemoryError, ValueError) as e:
            self.write(row("error", reason=f"{type(e).__name__}: {str(e)[:300]}"), tag, "error",
                       weight)
            return None
        finally:
            fns = None
            if need > _COLLECT_BYTES:
                gc.collect()
        contended = max(before, after) > self.probe.threshold
        self.write(row("ok", timings=timings, probe=(max(before, after), contended)), tag, "ok",
                   weight)
        if contended:
            self.count(tag, "contended")
        return sum(m for m, _ in timings.values())

    def run_series(self, prim, impls, graph, series, make, shape):
        """Points of one (primitive, graph) in increasing work, in each phase of the run; once a
        round takes longer than ``max_call`` the larger ones are recorded as skipped."""
        for phase in self.config.phases:
            if pts.has_phase(prim, phase):
                self._series(prim, impls, graph, series, make, shape, phase)

    def _series(self, prim, impls, graph, series, make, shape, phase):
        slow = None
        for sizes in series:
            t = self.run_point(prim, impls, graph, sizes, lambda s=sizes: make(s, phase), shape,
                               slow, phase)
            if t is not None and t > self.config.max_call and slow is None:
                slow = f"a smaller size took {t:.2f} s per round"


def plan_weight(config, prims):
    """Estimated total seconds of a run (before resuming) and its number of points."""
    total, n = 0.0, 0
    for prim, impls in prims:
        phases = [ph for ph in config.phases if pts.has_phase(prim, ph)]
        if prim in pts.DENSE_PRIMS:
            for sizes in pts.dense_points(prim, config):
                for ph in phases:
                    total += _weight(config, prim, sizes, len(impls), phase=ph)
                    n += 1
    for name, _ in pts.graph_jobs(config):
        nodes, e = gen.approx_size(name)
        for prim, impls in prims:
            if prim in pts.GRAPH_PRIMS:
                for sizes in pts.graph_sizes(prim, config):
                    for ph in config.phases:
                        if pts.has_phase(prim, ph):
                            total += _weight(config, prim, sizes, len(impls), nodes, nodes, e,
                                             phase=ph)
                            n += 1
    return total, n


class _TimeUp(Exception):
    pass


def profile(config, run_dir, threads=2, resume=True, progress=True, log=print,
            retry_contended=False, time_limit=None):
    """Run (or resume) the profiling of ``config`` into ``run_dir``; returns a summary dict.
    ``retry_contended`` measures again the points recorded while the machine was contended (the
    newer records then take precedence in training). ``time_limit`` (seconds): stop after the
    point that passes it (``summary["stopped_early"]``); a later resumed run continues."""
    previous = torch.get_num_threads()
    threads = fix_threads(threads)
    try:
        return _profile(config, run_dir, threads, resume, progress, log, retry_contended,
                        time_limit)
    finally:
        torch.set_num_threads(previous)


def _profile(config, run_dir, threads, resume, progress, log, retry_contended, time_limit):
    prims = [(p, i) for p, i in pts.registered(config.prims)]
    run = _Run(config, run_dir, resume, log, retry_contended)
    if time_limit is not None:
        run.deadline = time.perf_counter() + time_limit
    total, n_points = plan_weight(config, prims)
    start = time.perf_counter()
    log(f"granii: profiling '{config.name}' with {threads} threads: {n_points} points "
        f"({len(run.done)} already recorded) over {len(pts.graph_jobs(config))} graphs and the "
        f"dense grids; records in {run.dir}")
    try:
        from tqdm import tqdm       # DGL's dependency; without it, no progress bar
    except ImportError:
        progress = False
    if progress:
        run.bar = tqdm(total=round(total, 3), unit="s", unit_scale=False, dynamic_ncols=True,
                       bar_format="{l_bar}{bar}| [{elapsed}<{remaining}] {postfix}",
                       desc="profiling", smoothing=0.05)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is in beta")
            _dense(run, prims)
            _graphs(run, prims)
    except _TimeUp:
        run.stopped_early = True
        log(f"granii: profiling stopped at its time limit ({time_limit:.0f} s); training on "
            "the points measured (a resumed run continues)")
    finally:
        if run.bar is not None:
            run.bar.close()
    seconds = time.perf_counter() - start
    summary = {"config": config.name, "threads": threads, "seconds": seconds,
               "waited": run.waited, "retried": run.retried, "counts": run.counts,
               "stopped_early": run.stopped_early,
               "run_dir": str(run.dir)}
    log(format_summary(summary))
    return summary


def _dense(run, prims):
    for prim, impls in prims:
        if prim not in pts.DENSE_PRIMS:
            continue
        if run.bar is not None:
            run.bar.set_postfix_str(prim)
        grid = pts.dense_points(prim, run.config)
        # rows of the grid that grow in their last size: GEMM (m, k) over n, row scaling n over k
        last = "n" if prim in ("gemm", "head_gemm") else "k"
        series = {}
        for sizes in grid:
            series.setdefault(tuple(v for k, v in sizes.items() if k != last), []).append(sizes)
        for group in series.values():
            run.run_series(prim, impls, pts.DENSE, group,
                           lambda s, ph, p=prim, i=impls: pts.runners(p, None, s, i, ph),
                           (0, 0, 0))


def _graphs(run, prims):
    jobs = pts.graph_jobs(run.config)
    graph_prims = [(p, i) for p, i in prims if p in pts.GRAPH_PRIMS]
    prev_name, prev_g = None, None
    for name, base in jobs:
        keys = [pts.point_key(p, name, s, ph) for p, _ in graph_prims
                for s in pts.graph_sizes(p, run.config) for ph in run.config.phases
                if pts.has_phase(p, ph)]
        if all(k in run.done for k in keys) and name in run.known_graphs:
            for p, impls in graph_prims:
                for s in pts.graph_sizes(p, run.config):
                    for ph in run.config.phases:
                        if not pts.has_phase(p, ph):
                            continue
                        rec = run.known_graphs[name]
                        run.count(p if ph == "forward" else f"{p}/{ph}", "resumed")
                        if run.bar is not None:
                            run.bar.update(_weight(run.config, p, s, len(impls), rec["num_src"],
                                                   rec["num_dst"], rec["num_edges"], phase=ph))
            continue
        if run.bar is not None:
            run.bar.set_postfix_str(f"building {name[:48]}")
        if base is not None and base == prev_name and prev_g is not None:
            params = gen.parse_name(name)[1]
            params.pop("base")
            g = gen.sample_subgraph(prev_g, **params)
        else:
            prev_g = None
            g = gen.build(name)
        gi = GraphInfo(g)
        shape = (gi.num_src, gi.num_dst, gi.num_edges)
        if name not in run.known_graphs:
            rec = graph_record(name, gi)
            _append(run.graphs, [rec])
            run.known_graphs[name] = rec
        if run.bar is not None:
            run.bar.set_postfix_str(f"E={gi.num_edges:,} {name[:40]}")
        for prim, impls in graph_prims:
            run.run_series(prim, impls, name, pts.graph_sizes(prim, run.config),
                           lambda s, ph, p=prim, i=impls: pts.runners(p, gi, s, i, ph), shape)
        if base is None:
            prev_name, prev_g = name, g
        del gi, g
        if 64 * shape[2] > _COLLECT_BYTES:
            gc.collect()


def format_summary(summary):
    """Readable table of a run's counts per primitive."""
    statuses = ["ok", "contended", "resumed", "skipped_memory", "skipped_slow", "error"]
    lines = [f"granii: profiling '{summary['config']}' finished in "
             f"{summary['seconds'] / 60:.1f} min ({summary['threads']} threads); "
             f"points per primitive:",
             f"  {'primitive':<15}" + "".join(f"{s:>15}" for s in statuses)]
    tot = dict.fromkeys(statuses, 0)
    for prim, c in summary["counts"].items():
        lines.append(f"  {prim:<15}" + "".join(f"{c.get(s, 0):>15}" for s in statuses))
        for s in statuses:
            tot[s] += c.get(s, 0)
    lines.append(f"  {'total':<15}" + "".join(f"{tot[s]:>15}" for s in statuses))
    lines.append(f"  ({summary.get('waited', 0):.0f} s waited for other processes to leave the cores; "
                 f"{summary.get('retried', 0)} points measured again after a contended or "
                 "unsettled round; 'contended': still contended after that, kept in 'ok')")
    lines.append(f"  records: {summary['run_dir']}")
    return "\n".join(lines)
