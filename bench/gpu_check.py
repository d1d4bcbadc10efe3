"""The short GPU check: granii's Triton kernels on a GPU, against cuSPARSE and PyG, in minutes.

    python bench/gpu_check.py [--nodes 2000000] [--budget 330] [--out DIR]
    python bench/gpu_check.py --small      # CPU, Triton's interpreter, seconds (a test runs it)

Steps (``--steps`` picks them), each printed as it starts, each skipped (and said so in the
report) once ``--budget`` seconds are spent:

1. **Checks**: ``tests/test_triton_kernels.py``'s (outputs and gradients against torch
   references on small graphs, both loop-bound forms, compiled for this GPU) and
   ``tests/test_gpu_path.py``'s (``granii(model, x, edge_index)`` on PyG models on the GPU
   against PyG), their workers run directly (no pytest), compiling into a cache of their own.
2. **Graph**: the power-law graph of issue 37: ``nodes * 10`` edges with uniform sources and
   destinations ``floor(N u^3)``, made symmetric, duplicates and loops removed, one self loop a
   node (2M nodes: about 40M edges plus 2M loops).
3. **Models**: 2-layer GCN, GAT (8 heads) and GraphSAGE, 128 -> 128 -> 16, as PyG's examples write
   them; a training step (forward, cross entropy, backward, Adam) and inference: PyG eager
   (``edge_index``), ``granii`` (a copy optimized by ``granii(model, x, edge_index)`` at its
   first call, which the first call's time holds, Triton's compilation included),
   ``granii-noreuse`` (the ablation without work on the fixed features kept), PyG with a CSR
   ``adj_t`` (GCN, SAGE), ``triton-plan`` (the same parameters through a forward of granii's
   Triton kernels composed by hand) and last ``torch.compile`` of the PyG model. Each cell's
   median and its ms per call over the first 100 calls (the first included); outputs, loss and
   gradients checked against the first variant's; for granii's cells, the peak of the settled
   calls beside the cell's (whose first calls include the tie-break's turn of PyG's forward).
   Then (``warm-cache``) granii's cells again in a new process, whose first calls find the
   Triton kernels compiled in Triton's cache on disk, as every run after a machine's first does.
4. **Decisions**: single layers; granii's settled choice against every plan and kernel choice
   (``pyg.plan_choices``) and PyG's forward, timed alike; the regret.
5. **Kernels** (median of ``--reps`` after warm-up, CUDA events): SpMM at 32 and 128 features by
   cuSPARSE, PyG's gather-scatter and granii's schedules, forward and forward + backward; the
   fused GAT against the same computation by edges in torch, eager and compiled; each checked.
6. **github-social**: the models and decisions on the shipped graph (``social``); with
   ``trace``, where its training steps spend their time (``trace_steps``: ``trace.md``).
7. **Profile**: this GPU's cost model (``granii/profiling/gpu.py``): ``gpu_points.csv`` and
   ``gpu_model.json`` beside the report, for ``costmodels/gpu/``.

Writes ``report.md`` and ``gpu_check.csv`` to ``--out`` (default: ``$OUT`` when set, else
``results/gpu``). An out-of-memory error is recorded as such for that cell, not a failure.
"""
import argparse
import copy
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import warnings

import torch

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIELDS = ["section", "name", "variant", "mode", "ms", "first100_ms", "peak_mib", "held_mib",
          "max_err", "ok",
          "note"]


class Run:
    """Time budget, progress printing and the rows of the report."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.rows = []
        self.dev = torch.device("cpu" if args.small else "cuda")

    def wants(self, variant):
        return self.args.variants is None or variant in self.args.variants

    def left(self):
        return self.args.budget - (time.monotonic() - self.t0)

    def say(self, msg):
        print(f"[{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    def row(self, section, name, variant, mode="", ms=None, peak=None, err=None, ok=None,
            note="", first100=None, held=None):
        r = dict(section=section, name=name, variant=variant, mode=mode,
                 ms="" if ms is None else f"{ms:.3f}",
                 first100_ms="" if first100 is None else f"{first100:.3f}",
                 peak_mib="" if peak is None else
                 f"{peak:.0f}", held_mib="" if held is None else f"{held:.0f}",
                 max_err="" if err is None else f"{err:.2e}",
                 ok="" if ok is None else ("yes" if ok else "NO"), note=note)
        self.rows.append(r)
        self.say(f"  {section} {name} {variant} {mode}: "
                 + ", ".join(f"{k}={v}" for k, v in r.items()
                             if k in ("ms", "first100_ms", "peak_mib", "held_mib", "max_err",
                                      "ok", "note")
                             and v))
        return r

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        return torch.cuda.max_memory_allocated() / 2**20 if self.dev.type == "cuda" else None

    def held(self):
        """MiB allocated now (what a cell's peak includes from before it started)."""
        return torch.cuda.memory_allocated() / 2**20 if self.dev.type == "cuda" else None

    def time(self, fn, reps=None, warmup=None):
        """Median milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` calls (1 on a GPU,
        none under the interpreter, where nothing is compiled)."""
        from granii.profiling.gpu import timed
        reps = self.args.reps if reps is None else reps
        warmup = (0 if self.args.small else 1) if warmup is None else warmup
        return 1e3 * timed(fn, self.dev.type == "cuda", reps, warmup)


def is_oom(ex):
    return isinstance(ex, torch.cuda.OutOfMemoryError) or "out of memory" in str(ex).lower()


# -- 1. kernel checks -----------------------------------------------------------------------------
def kernel_checks(run):
    test = ROOT / "tests" / "test_triton_kernels.py"
    # the checks compile into a cache of their own: the models' first calls compile cold
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               TRITON_CACHE_DIR=os.path.join(tempfile.mkdtemp(), "triton"))
    dev = "cpu" if run.args.small else "cuda"
    if dev == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    if run.left() < 60 and not run.args.small:
        run.row("checks", "kernel checks", "all", note="skipped: budget")
        return False
    run.say(f"kernel checks on {dev}, both loop forms side by side")
    t = time.monotonic()
    if "kernel-checks" not in run.args.steps:
        return gpu_path_checks(run, env, dev)
    procs = {mode: subprocess.Popen([sys.executable, str(test), "--worker", mode, dev], cwd=ROOT,
                                    env=dict(env, GRANII_TRITON_LOOPS=mode),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in ("dynamic", "static")}
    all_ok = True
    for mode, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(60, run.left() - 30))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            run.row("checks", "kernel checks", mode, ok=False, note="timed out")
            all_ok = False
            continue
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            all_ok = False
            run.row("checks", "kernel checks", mode, ok=False,
                    note=f"worker failed rc={proc.returncode}: {stderr[-300:]!r}")
            continue
        results = {k: e for k, e in json.loads(lines[-1])["results"].items()
                   if not (e or "").startswith("skipped")}
        for name, error in results.items():
            ok = error is None
            all_ok &= ok
            run.row("checks", name, mode, ok=ok,
                    note="" if ok else error.strip().splitlines()[-1][:300])
        run.say(f"  {mode}: {sum(e is None for e in results.values())}/{len(results)} passed, "
                f"{time.monotonic() - t:.0f} s")
    return gpu_path_checks(run, env, dev) and all_ok


def gpu_path_checks(run, env, dev):
    """``tests/test_gpu_path.py``'s checks: ``granii(model, x, edge_index)`` on PyG models on
    ``dev`` against PyG's outputs and gradients, every layer a plan of GPU kernels."""
    test = ROOT / "tests" / "test_gpu_path.py"
    run.say(f"GPU path checks on {dev}")
    try:
        proc = subprocess.run([sys.executable, str(test), "--worker", dev], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=max(60, run.left() - 30))
    except subprocess.TimeoutExpired:
        run.row("checks", "gpu path", "all", ok=False, note="timed out")
        return False
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "gpu_path.log").write_text(proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        run.row("checks", "gpu path", "all", ok=False,
                note=f"worker failed rc={proc.returncode}: {proc.stderr[-300:]!r}")
        return False
    ok_all = True
    for name, error in json.loads(lines[-1])["results"].items():
        ok = error is None
        ok_all &= ok
        run.row("checks", name, "gpu-path", ok=ok,
                note="" if ok else error.strip().splitlines()[-1][:300])
    return ok_all


# -- 2. the graph ---------------------------------------------------------------------------------
def power_law_graph(n, edges, device, seed=0):
    """``(src, dst)`` of the symmetric power-law graph with one self loop a node (module
    docstring), sorted by destination."""
    gen = torch.Generator(device=device).manual_seed(seed)
    src = torch.randint(0, n, (edges,), device=device, generator=gen)
    u = torch.rand(edges, device=device, generator=gen)
    dst = (n * u ** 3).long().clamp_(max=n - 1)
    s = torch.cat([src, dst])
    d = torch.cat([dst, src])
    del src, dst, u
    keep = s != d
    key = torch.unique(d[keep] * n + s[keep])        # sorted: by destination, then source
    del s, d, keep
    loops = torch.arange(n, device=device)
    key = torch.sort(torch.cat([key, loops * n + loops])).values
    return key % n, key // n


# -- 3. kernels -----------------------------------------------------------------------------------
def legacy(fn):
    """``fn`` run with the SpMM's launch configuration from before the one-warp rule
    (``spmm_kernels.LEGACY``; schedules and kernels otherwise the same), to time both."""
    from granii.kernels.triton import spmm_kernels

    def run(*args):
        spmm_kernels.LEGACY = True
        try:
            return fn(*args)
        finally:
            spmm_kernels.LEGACY = False
    return run


def spmm_timings(run, graph, src, dst, n):
    from torch_geometric.utils import scatter

    from granii.kernels.triton import spmm

    dev = run.dev
    crow = graph.a.indptr.to(torch.int64) if run.args.small else graph.a.indptr
    col = graph.a.indices
    ones = torch.ones(graph.num_edges, device=dev)
    a_csr = torch.sparse_csr_tensor(crow, col, ones, size=(n, n))
    for width in run.args.widths:
        if run.left() < 30:
            run.row("kernels", f"spmm k={width}", "all", note="skipped: budget")
            continue
        x = torch.randn(n, width, device=dev)
        want = torch.sparse.mm(a_csr, x)
        variants = {
            "cusparse": lambda: torch.sparse.mm(a_csr, x),
            "pyg-scatter": lambda: scatter(x[src], dst, 0, dim_size=n, reduce="sum"),
            "triton-rows": lambda: spmm(graph, x, schedule="rows"),
            "triton-segments": lambda: spmm(graph, x, schedule="segments"),
            "triton-rows-legacy": legacy(lambda: spmm(graph, x, schedule="rows")),
            "triton-segments-legacy": legacy(lambda: spmm(graph, x, schedule="segments")),
        }
        for name, fn in variants.items():
            try:
                run.reset_peak()
                got = fn()
                err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                ms = run.time(fn)
                run.row("kernels", f"spmm k={width}", name, "forward", ms, run.peak(), err,
                        err < 1e-4)
            except Exception as ex:     # noqa: BLE001 (an OOM or a missing op is a result)
                run.row("kernels", f"spmm k={width}", name, "forward",
                        note=("OOM" if is_oom(ex) else f"error: {ex}")[:300])
        # forward + backward: dX = A^T dY (cuSPARSE's backward transposes A at every call)
        dy = torch.randn(n, width, device=dev)
        xg = x.clone().requires_grad_(True)
        ref_grad = None
        for name, f in {"cusparse": lambda t: torch.sparse.mm(a_csr, t),
                        "triton": lambda t: spmm(graph, t),
                        "triton-legacy": lambda t: spmm(graph, t)}.items():
            def step():
                xg.grad = None
                f(xg).backward(dy)
            try:
                run.reset_peak()
                ms = run.time(legacy(step) if name.endswith("legacy") else step)
                err = ok = None
                if ref_grad is None:
                    ref_grad = xg.grad.detach().clone()
                else:
                    err = (xg.grad - ref_grad).abs().max().item() / max(
                        ref_grad.abs().max().item(), 1e-30)
                    ok = err < 1e-4
                run.row("kernels", f"spmm k={width}", name, "fwd+bwd", ms, run.peak(), err, ok)
            except Exception as ex:     # noqa: BLE001
                run.row("kernels", f"spmm k={width}", name, "fwd+bwd",
                        note=("OOM" if is_oom(ex) else f"error: {ex}")[:300])
        del x, want, dy, xg


def gat_timings(run, graph, src, dst, n):
    from granii.kernels.triton import gat
    dev = run.dev
    heads, dim = run.args.gat_heads, run.args.gat_dim
    gen = torch.Generator(device=dev).manual_seed(1)
    el = torch.randn(n, heads, device=dev, generator=gen).requires_grad_(True)
    er = torch.randn(n, heads, device=dev, generator=gen).requires_grad_(True)
    feat = torch.randn(n, heads, dim, device=dev, generator=gen).requires_grad_(True)
    dout = torch.randn(n, heads, dim, device=dev, generator=gen)

    def by_edges(el, er, feat):
        x = torch.nn.functional.leaky_relu(el[src] + er[dst], 0.2)
        m = torch.full((n, heads), -torch.inf, device=x.device).index_reduce(
            0, dst, x.detach(), "amax")
        ex = torch.exp(x - m[dst])
        den = torch.zeros(n, heads, device=x.device).index_add(0, dst, ex)
        a = ex / den[dst]
        return torch.zeros(n, heads, dim, device=x.device).index_add(
            0, dst, a.unsqueeze(-1) * feat[src])

    def step(f, keep):
        def go():
            for t in (el, er, feat):
                t.grad = None
            out = f(el, er, feat)
            out.backward(dout)
            keep[:] = [out.detach(), feat.grad, el.grad, er.grad]
        return go
    variants = {"triton-fused": lambda a, b, c: gat(graph, a, b, c, 0.2),
                "torch-edges": by_edges}
    if not run.args.small:
        variants["torch-edges-compiled"] = torch.compile(by_edges)
    what = f"gat h={heads} d={dim}"
    try:                                # the fused forward alone, checked against the edges'
        with torch.no_grad():
            got, want = gat(graph, el, er, feat, 0.2), by_edges(el, er, feat)
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            ms = run.time(lambda: gat(graph, el, er, feat, 0.2))
        run.row("kernels", what, "triton-fused", "forward", ms, None, err, err < 1e-3)
        del got, want
    except Exception as ex:             # noqa: BLE001
        run.row("kernels", what, "triton-fused", "forward",
                note=("OOM" if is_oom(ex) else f"error: {ex}")[:300])
    fused = None
    for name, f in variants.items():
        if run.left() < (60 if "compiled" in name else 20):
            run.row("kernels", what, name, "fwd+bwd", note="skipped: budget")
            continue
        try:
            run.reset_peak()
            keep = []
            t = time.monotonic()
            step(f, keep)()
            run.sync()
            first = time.monotonic() - t
            ms = run.time(step(f, keep))
            err = ok = None
            if fused is None:
                fused = keep
            else:                       # this variant against the fused kernel
                err = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                          for a, b in zip(keep, fused))
                ok = err < 1e-3
            note = f"first call {first:.1f} s" if "compiled" in name else ""
            run.row("kernels", what, name, "fwd+bwd", ms, run.peak(), err, ok, note)
        except Exception as ex:         # noqa: BLE001
            run.row("kernels", what, name, "fwd+bwd",
                    note=("OOM" if is_oom(ex) else f"error: {ex}")[:300])
        if run.dev.type == "cuda":
            torch.cuda.empty_cache()


# -- 4. models ------------------------------------------------------------------------------------
def build_model(kind, fin, hidden, classes, heads):
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "gcn":
                self.conv1, self.conv2 = GCNConv(fin, hidden), GCNConv(hidden, classes)
            elif kind == "sage":
                self.conv1, self.conv2 = SAGEConv(fin, hidden), SAGEConv(hidden, classes)
            else:
                self.conv1 = GATConv(fin, hidden // heads, heads=heads)
                self.conv2 = GATConv(hidden, classes, heads=1)

        def forward(self, x, edge_index):
            act = torch.nn.functional.elu if kind == "gat" else torch.relu
            return self.conv2(act(self.conv1(x, edge_index)), edge_index)
    return Net()


class TritonPlan(torch.nn.Module):
    """The PyG model's parameters run by granii's Triton kernels (module docstring, step 4)."""

    def __init__(self, model, kind, graph, n):
        super().__init__()
        self.model, self.kind, self.graph = model, kind, graph
        deg = (graph.a.indptr[1:] - graph.a.indptr[:-1]).to(torch.float32)
        self.dis = deg.clamp(min=1).pow(-0.5)        # GCN: loops are in the graph already
        self.inv = 1.0 / deg.clamp(min=1)            # SAGE: mean

    def forward(self, x, _edge_index=None):
        from granii.kernels.triton import gat, spmm
        m, g = self.model, self.graph
        if self.kind == "gcn":
            h = spmm(g, x @ m.conv1.lin.weight.t(), row_scale=self.dis, col_scale=self.dis,
                     bias=m.conv1.bias, relu=True)
            return spmm(g, h @ m.conv2.lin.weight.t(), row_scale=self.dis, col_scale=self.dis,
                        bias=m.conv2.bias)
        if self.kind == "sage":
            c1, c2 = m.conv1, m.conv2
            h = spmm(g, x @ c1.lin_l.weight.t(), row_scale=self.inv, bias=c1.lin_l.bias,
                     residual=x @ c1.lin_r.weight.t(), relu=True)
            return spmm(g, h @ c2.lin_l.weight.t(), row_scale=self.inv, bias=c2.lin_l.bias,
                        residual=h @ c2.lin_r.weight.t())
        h = self._gat(m.conv1, x)
        return self._gat(m.conv2, torch.nn.functional.elu(h))

    def _gat(self, conv, x):
        from granii.kernels.triton import gat
        heads, ch = conv.heads, conv.out_channels
        proj = (x @ conv.lin.weight.t()).reshape(-1, heads, ch)
        el = (proj * conv.att_src).sum(-1)
        er = (proj * conv.att_dst).sum(-1)
        out = gat(self.graph, el, er, proj, conv.negative_slope,
                  bias=conv.bias.reshape(heads, ch) if conv.bias is not None else None)
        return out.reshape(x.shape[0], heads * ch)


def model_timings(run, graph, src, dst, n, compiled, label=""):
    """The model cells of step 4: PyG eager, ``adj_t`` and the Triton plan (``compiled`` false),
    or ``torch.compile`` (true: the slowest, their compilation, so run last). The models are
    built from the same seed in both calls: the same parameters."""
    args = run.args
    dev = run.dev
    edge_index = torch.stack([src, dst])
    gen = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(n, args.features, device=dev, generator=gen)
    y = torch.randint(0, args.classes, (n,), device=dev, generator=gen)
    # PyG's gcn_norm adds a whole diagonal to a sparse adjacency (not only the missing loops, as
    # on edge_index): GCN's adj_t is the graph without its loops, SAGE's the graph as it is
    adj_t = _adj_t(src, dst, n, keep_loops=True)
    adj_t_gcn = _adj_t(src, dst, n, keep_loops=False)
    cells = []
    reference = run.references.setdefault(label, {})
    for kind in args.models:
        torch.manual_seed(0)
        model = build_model(kind, args.features, args.hidden, args.classes, args.heads).to(dev)
        plan = TritonPlan(model, kind, graph, n)
        if compiled:
            variants = {} if args.small else {"compile": (torch.compile(model), edge_index)}
        else:
            # granii before the Triton plan: its first call compiles the Triton kernels it runs
            variants = {"eager": (model, edge_index),
                        "granii": (GraniiModel(model, True), edge_index),
                        "granii-noreuse": (GraniiModel(model, False), edge_index)}
            if kind != "gat":
                variants["adj_t"] = (model, adj_t_gcn if kind == "gcn" else adj_t)
            variants["triton-plan"] = (plan, None)
        cells.append((kind, model, variants))
    order = [(k, m, name, v) for k, m, vs in cells for name, v in vs.items() if run.wants(name)]
    for kind, model, name, (fn, graph_arg) in order:
        if name == "compile":       # one forward function for every model: its own cache each
            torch._dynamo.reset()
        for training in (False, True):
            mode = "training" if training else "inference"
            if run.left() < (60 if name == "compile" else 20):
                run.row("models", kind + label, name, mode, note="skipped: budget")
                continue
            try:
                run.reset_peak()
                held = run.held()
                owner = fn.model if isinstance(fn, GraniiModel) else model
                ms, first, check, first100, peak, steady = _model_cell(
                    run, owner, fn, x, graph_arg, y, training)
                err = ok = None
                note = f"first call {first * 1e3:.0f} ms" if name == "compile" else ""
                if isinstance(fn, GraniiModel):
                    note = f"first call {first * 1e3:.0f} ms; ran {fn.ran()}"
                if (kind, mode) not in reference:     # eager's, or the first that ran
                    reference[kind, mode] = (name, check)
                else:
                    ref_name, ref = reference[kind, mode]
                    err = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
                              for a, b in zip(check, ref))
                    ok = err < (2e-3 if name != "adj_t" else 1e-2)
                    note = "; ".join(t for t in (note, f"vs {ref_name}") if t)
                if steady is not None and isinstance(fn, GraniiModel):
                    note = f"{note}; settled calls' peak {steady:.0f} MiB"
                run.row("models", kind + label, name, mode, ms, peak, err, ok, note,
                        first100=first100, held=held)
            except Exception as ex:     # noqa: BLE001
                run.row("models", kind + label, name, mode,
                        note=("OOM" if is_oom(ex) else f"error: {type(ex).__name__}: {ex}")[:300])
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        write_report(run)


def social_graph(device):
    """``(src, dst, n)`` of github-social (``data/graphs``), both directions of every edge and
    one self loop a node, sorted by destination, as the power-law graph."""
    from granii.datasets import DATA_DIR, read_edge_csv
    u, v, n = read_edge_csv(DATA_DIR / "graphs" / "github-social.edges.csv")
    u, v = torch.as_tensor(u), torch.as_tensor(v)
    s, d = torch.cat([u, v]), torch.cat([v, u])
    keep = s != d
    loops = torch.arange(n)
    key = torch.unique(torch.cat([d[keep] * n + s[keep], loops * n + loops]))
    return (key % n).to(device), (key // n).to(device), n


def layer_specs(args):
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv
    f, h, c, heads = args.features, args.hidden, args.classes, args.heads
    return {f"GCNConv {f}->{h}": lambda: GCNConv(f, h), f"GCNConv {h}->{c}": lambda: GCNConv(h, c),
            f"SAGEConv {f}->{h}": lambda: SAGEConv(f, h),
            f"GATConv {f}->{h // heads}x{heads}": lambda: GATConv(f, h // heads, heads=heads)}


def decision_timings(run, src, dst, n, label, specs):
    """Per layer and mode: granii's settled choice (``granii(conv, x, edge_index)`` called until
    its tie-break settles) against every plan and kernel choice (``pyg.plan_choices``) and PyG's
    own forward, each timed the same way; the regret is granii's median over the fastest."""
    from granii import granii, pyg
    from granii.runtime.dispatch import layer_states
    edge_index = torch.stack([src, dst])
    for name, make in specs.items():
        for training in (False, True):
            mode = "training" if training else "inference"
            if run.left() < 25:
                run.row("decisions", name + label, "all", mode, note="skipped: budget")
                continue
            torch.manual_seed(0)
            conv = make().to(run.dev).train(training)
            x = torch.randn(n, conv.in_channels, device=run.dev)
            dout = None

            def call(fn):
                nonlocal dout
                with torch.set_grad_enabled(training):
                    out = fn()
                    if training:
                        if dout is None:
                            dout = torch.randn_like(out)
                        out.backward(dout)
            times = {}
            try:
                times["PyG forward"] = run.time(lambda: call(lambda: conv(x, edge_index)), reps=5)
                prepared = pyg.prepare(conv, x, edge_index)
                for plan, impls in pyg.plan_choices(prepared):
                    if run.left() < 15:
                        break
                    key = f"[{plan.index}] " + "/".join(i for i in impls if i != "inline")
                    try:
                        times[key] = run.time(lambda: call(lambda: pyg.run(prepared, plan,
                                                                           impls)), reps=5)
                    except Exception as ex:     # noqa: BLE001
                        times[key] = float("inf")
                        run.say(f"    {key}: {'OOM' if is_oom(ex) else ex}"[:200])
                    if run.dev.type == "cuda":
                        torch.cuda.empty_cache()
                del prepared
                ours = copy.deepcopy(conv)
                granii(ours, x, edge_index)
                for _ in range(40):
                    call(lambda: ours(x, edge_index))
                    if settled(ours):
                        break
                ms = run.time(lambda: call(lambda: ours(x, edge_index)), reps=5)
                chosen = next(iter(layer_states(ours)[0].chosen.values()), {})
                what = chosen.get("plan", "?")
                what = "original" if what == "original" else \
                    f"[{what}] " + "/".join(i for i in chosen.get("impls") or () if i != "inline")
                best = min(times, key=times.get)
                run.row("decisions", name + label, "granii", mode, ms,
                        note=f"chose {what}; regret {ms / times[best]:.2f} vs fastest {best} "
                             f"{times[best]:.3f} ms; {len(times)} timed")
                for key, t in sorted(times.items(), key=lambda kv: kv[1])[:3]:
                    run.row("decisions", name + label, key, mode, t)
            except Exception as ex:     # noqa: BLE001
                run.row("decisions", name + label, "all", mode,
                        note=("OOM" if is_oom(ex) else f"error: {type(ex).__name__}: {ex}")[:300])
            del conv
            if run.dev.type == "cuda":
                torch.cuda.empty_cache()
        write_report(run)


class GraniiModel:
    """A copy of the PyG model (the same parameters) optimized by ``granii(model, x,
    edge_index)`` at its first call, which counts in the first call's time; ``reuse``: granii's
    ``reuse_inputs`` (work on the fixed input features done once, an ablation when off)."""

    def __init__(self, model, reuse):
        import copy
        self.model, self.reuse, self.done = copy.deepcopy(model), reuse, False

    def __call__(self, x, edge_index):
        if not self.done:
            from granii import granii
            granii(self.model, x, edge_index, reuse_inputs=self.reuse)
            self.done = True
        return self.model(x, edge_index)

    def ran(self):
        """What each layer's last call ran and the settled choice's kernels; whether the
        layer's own forward was left out of the tie-break for its memory (``decide``)."""
        from granii.runtime.dispatch import layer_states
        parts = []
        for st in layer_states(self.model):
            impls = sorted({i for c in st.chosen.values() for i in (c.get("impls") or ())
                            if i != "inline"})
            no_turn = " (own forward: no tie-break turn)" if st.original_turn else ""
            parts.append(f"{st.name} {st.ran.kind} {st.ran.label} {'/'.join(impls)}{no_turn}")
        return "; ".join(parts)


def _adj_t(src, dst, n, keep_loops):
    """``torch.sparse`` CSR adjacency with rows as targets (PyG's ``adj_t``); ``src``/``dst``
    sorted by destination."""
    if not keep_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    crow = torch.zeros(n + 1, dtype=torch.int64, device=src.device)
    crow[1:] = torch.cumsum(torch.bincount(dst, minlength=n), 0)
    return torch.sparse_csr_tensor(crow, src.to(torch.int64),
                                   torch.ones(src.shape[0], device=src.device), size=(n, n))


def _settle(run, fn, first):
    """Calls of ``fn`` after its first until granii's tie-breaks have settled (at most 40; one
    for the others): their milliseconds. Then ``(median ms, ms per call over the first 100
    calls, the first included, peak MiB of all calls, peak MiB of the settled calls)``, the
    calls after those timed taken at the median: the settled peak leaves out what the first
    calls held (granii's tie-break runs the layer's own forward once)."""
    times = []
    graniis = getattr(fn, "granii_model", None) is not None
    for _ in range(40 if graniis else 1):
        run.sync()
        t = time.perf_counter()
        fn()
        run.sync()
        times.append(1e3 * (time.perf_counter() - t))
        if not graniis or settled(fn.granii_model):
            break
    before = run.peak()
    run.reset_peak()
    ms = run.time(fn)
    steady = run.peak()
    first100 = (1e3 * first + sum(times) + (99 - len(times)) * ms) / 100
    return ms, first100, None if before is None else max(before, steady), steady


def settled(model):
    """Whether every optimized layer of ``model`` has ended its measured tie-breaks."""
    from granii.runtime.dispatch import layer_states
    from granii.runtime.tiebreak import Trial
    return all(not any(isinstance(d, Trial) for per in st.decisions.values()
                       for d in per.values()) for st in layer_states(model))


def _model_cell(run, model, fn, x, graph_arg, y, training):
    """``(median ms, first call s, tensors to compare, ms per call over the first 100, peak MiB,
    settled calls' peak MiB)``: inference gives the output; training the first step's loss and
    the gradients of every parameter (before Adam moves them), then steps go on from a copy of
    the parameters so each variant starts from the same ones."""
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params]
    if not training:
        model.eval()

        def call():
            with torch.no_grad():
                return fn(x, graph_arg)
        t = time.monotonic()
        out = call()
        run.sync()
        first = time.monotonic() - t
        call.granii_model = fn.model if isinstance(fn, GraniiModel) else None
        ms, first100, peak, steady = _settle(run, call, first)
        return ms, first, [out.float()], first100, peak, steady
    model.train()
    opt = torch.optim.Adam(params, lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(fn(x, graph_arg), y)
        loss.backward()
        opt.step()
        return loss
    opt.zero_grad(set_to_none=True)
    t = time.monotonic()
    loss = torch.nn.functional.cross_entropy(fn(x, graph_arg), y)
    loss.backward()
    run.sync()
    first = time.monotonic() - t
    check = [loss.detach().reshape(1)] + [p.grad.detach().clone() for p in params]
    step.granii_model = fn.model if isinstance(fn, GraniiModel) else None
    ms, first100, peak, steady = _settle(run, step, first)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return ms, first, check, first100, peak, steady


def trace_steps(run, src, dst, n, steps=5):
    """Where a training step's time goes on a small graph (github-social): for PyG eager and
    granii, per model, ``torch.profiler`` over ``steps`` settled steps gives the device's busy
    time (the kernels' sum) beside the step's wall time, and the kernels and host calls that
    take most; written to ``trace.md`` beside the report. A step whose kernels sum to far less
    than its wall time waits on the host (the launches and the Python around them)."""
    from torch.profiler import ProfilerActivity, profile
    if run.left() < 40:
        return
    run.say("trace: where a training step's time goes on github-social")
    args, dev = run.args, run.dev
    edge_index = torch.stack([src, dst])
    gen = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(n, args.features, device=dev, generator=gen)
    y = torch.randint(0, args.classes, (n,), device=dev, generator=gen)
    lines = ["# Training steps on github-social, traced (`trace` step of the GPU check)", ""]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for kind in args.models:
        for variant in ("eager", "granii"):
            if run.left() < 20:
                break
            torch.manual_seed(0)
            model = build_model(kind, args.features, args.hidden, args.classes,
                                args.heads).to(dev).train()
            fn = GraniiModel(model, True) if variant == "granii" else model
            params = list((fn.model if variant == "granii" else model).parameters())
            opt = torch.optim.Adam(params, lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(fn(x, edge_index), y).backward()
                opt.step()
            for _ in range(40):             # past granii's tie-break
                step()
            run.sync()
            t = time.perf_counter()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
                run.sync()
            wall = 1e3 * (time.perf_counter() - t) / steps
            events = prof.key_averages()
            device_ms = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events
                            if str(getattr(e, "device_type", "")).endswith("CUDA")) / 1e3 / steps
            launches = sum(e.count for e in events
                           if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                        "cuLaunchKernelEx")) / steps
            # the host waiting for the device: explicit waits and copies to the host
            waits = sum(e.count for e in events
                        if "Synchronize" in e.key or "DtoH" in e.key) / steps
            lines += [f"## {kind} {variant}: {wall:.2f} ms a step (profiled), kernels "
                      f"{device_ms:.2f} ms, {launches:.0f} launches and {waits:.0f} waits for "
                      "the device a step", "", "```",
                      events.table(sort_by="self_device_time_total" if dev.type == "cuda"
                                   else "self_cpu_time_total", row_limit=12,
                                   max_name_column_width=60),
                      events.table(sort_by="self_cpu_time_total", row_limit=12,
                                   max_name_column_width=60), "```", ""]
            run.say(f"  trace {kind} {variant}: {wall:.2f} ms a step, kernels {device_ms:.2f} "
                    f"ms, {launches:.0f} launches, {waits:.0f} waits")
            del fn, model, opt
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "trace.md").write_text("\n".join(lines))


def warm_cache_first_calls(run):
    """granii's model cells again in a new process, after this one compiled their Triton
    kernels into Triton's cache on disk: the first calls of every later run on this machine
    (the cells above are the machine's first run, every kernel compiled cold)."""
    if run.left() < 90 or run.args.small:
        run.row("models", "all", "granii (warm cache)", note="skipped: budget" if
                not run.args.small else "skipped: no compilation under the interpreter")
        return
    out = Path(tempfile.mkdtemp())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--skip-checks", "--steps", "",
           "--variants", "granii", "--nodes", str(run.args.nodes), "--models",
           ",".join(run.args.models), "--budget", str(max(30, run.left() - 60)), "--out",
           str(out)]
    run.say("granii's first calls in a new process, Triton's cache warm")
    try:
        subprocess.run(cmd, cwd=ROOT, timeout=max(60, run.left() - 30), capture_output=True)
    except subprocess.TimeoutExpired:
        run.row("models", "all", "granii (warm cache)", note="timed out")
        return
    import csv
    path = out / "gpu_check.csv"
    rows = list(csv.DictReader(path.open())) if path.exists() else []
    for r in rows:
        if r["section"] == "models" and r["variant"] == "granii":
            r["variant"] = "granii (warm cache)"
            run.rows.append(r)
            run.say(f"  {r['name']} {r['variant']} {r['mode']}: ms={r['ms']}, "
                    f"first100_ms={r['first100_ms']}, {r['note']}")
    if not rows:
        run.row("models", "all", "granii (warm cache)", note="the new process wrote no rows")


# -- report ---------------------------------------------------------------------------------------
def describe_device(dev):
    import triton
    parts = [f"torch {torch.__version__}", f"triton {triton.__version__}",
             f"python {platform.python_version()}"]
    try:
        import torch_geometric
        parts.append(f"torch_geometric {torch_geometric.__version__}")
    except ImportError:
        pass
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        parts.insert(0, f"{p.name} ({p.multi_processor_count} SMs, "
                        f"{p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
    else:
        parts.insert(0, "CPU, Triton interpreter")
    return "; ".join(parts)


def summary(rows):
    """Markdown lines: per model and mode, PyG's variants and granii's ms per call over the
    first 100 calls (the first included), granii over the fastest PyG variant and over PyG
    eager, the same on the settled calls, and the geometric means (issue 37's targets)."""
    cell = {(r["name"], r["variant"], r["mode"]): r for r in rows
            if r["section"] == "models" and r["ms"]}

    def get(kind, variant, mode, field="first100_ms"):
        r = cell.get((kind, variant, mode))
        return float(r[field]) if r and r[field] else None

    def ms(v):
        return "-" if v is None else f"{v:.1f}"
    lines = ["| model | mode | PyG eager | PyG adj_t | PyG compiled | granii | granii, warm "
             "cache | x fastest PyG | x eager | settled: granii / fastest PyG | x |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = {"first": [], "eager": [], "settled": [], "warm": []}
    order = ["gcn", "sage", "gat"]
    for kind in sorted({k for k, _, _ in cell}, key=lambda k: (
            "@" in k, k.split("@")[0] not in order,
            order.index(k.split("@")[0]) if k.split("@")[0] in order else 0, k)):
        for mode in ("inference", "training"):
            pyg = {v: get(kind, v, mode) for v in ("eager", "adj_t", "compile")}
            settled = {v: get(kind, v, mode, "ms") for v in pyg}
            ours, ours_ms = get(kind, "granii", mode), get(kind, "granii", mode, "ms")
            warm = get(kind, "granii (warm cache)", mode)
            if ours is None or not any(pyg.values()):
                continue
            fast = min((t, v) for v, t in pyg.items() if t)
            fast_ms = min((t, v) for v, t in settled.items() if t)
            ratios["first"].append(fast[0] / ours)
            ratios["settled"].append(fast_ms[0] / ours_ms)
            if pyg["eager"]:
                ratios["eager"].append(pyg["eager"] / ours)
            if warm:
                ratios["warm"].append(fast[0] / warm)
            lines.append(f"| {kind} | {mode} | {ms(pyg['eager'])} | {ms(pyg['adj_t'])} | "
                         f"{ms(pyg['compile'])} | {ms(ours)} | {ms(warm)} | "
                         f"{fast[0] / ours:.2f} ({fast[1]}) | "
                         + (f"{pyg['eager'] / ours:.1f}" if pyg["eager"] else "-")
                         + f" | {ours_ms:.1f} / {fast_ms[0]:.1f} ({fast_ms[1]}) | "
                           f"{fast_ms[0] / ours_ms:.2f} |")

    def gm(v):
        return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")
    lines += ["", "Geometric means over the cells: granii over the fastest PyG variant "
              f"{gm(ratios['first']):.2f}x (least {min(ratios['first'], default=0):.2f}x), over "
              f"PyG eager {gm(ratios['eager']):.2f}x, ms per call over the first 100 calls; on "
              f"the settled calls {gm(ratios['settled']):.2f}x (least "
              f"{min(ratios['settled'], default=0):.2f}x); with Triton's cache warm "
              f"{gm(ratios['warm']):.2f}x."]
    return lines


def write_report(run):
    """``report.md`` and ``gpu_check.csv`` of what has run so far (rewritten after each step, so
    that a run cut short still leaves its results)."""
    from bench.csvfile import write_csv
    out, graph_line = run.out, run.graph_line
    checks = [r for r in run.rows if r["section"] == "checks"]
    checks_ok = all(r["ok"] != "NO" for r in checks)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "gpu_check.csv", run.rows)
    lines = ["# GPU check (`scripts/gpu_check.sh`)", "",
             f"Device: {describe_device(run.dev)}.", "",
             f"Graph: {graph_line}.", "",
             f"Command: `{' '.join(sys.argv)}`; {time.monotonic() - run.t0:.0f} s. Kernel checks: "
             f"{'none run' if not checks else 'all passed' if checks_ok else 'FAILED'}.", ""]
    if any(r["section"] == "models" and r["variant"] == "granii" and r["ms"]
           for r in run.rows):
        lines += ["## Summary (ms per call over the first 100 calls, the first included)", ""]
        lines += summary(run.rows) + [""]
    for section, title in (("checks", "Kernel checks (outputs and gradients vs torch)"),
                           ("kernels", "Kernels (median ms)"),
                           ("models", "2-layer models (median ms per call)"),
                           ("decisions", "Decisions: granii's settled choice against every "
                                         "plan (median ms of one layer's call)")):
        rows = [r for r in run.rows if r["section"] == section]
        if not rows:
            continue
        lines += [f"## {title}", "",
                  "| name | variant | mode | ms | ms/call, first 100 | peak MiB | held before, "
                  "MiB | max err | ok | note |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append("| " + " | ".join(r[k] for k in FIELDS[1:]) + " |")
        lines.append("")
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true",
                   help="CPU, Triton's interpreter, a tiny graph: the script's own check")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds for all steps")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--models", default="gcn,sage,gat")
    p.add_argument("--steps",
                   default="kernel-checks,warm-cache,kernels,decisions,social,trace,profile,"
                           "compile",
                   help="steps: kernel-checks (the Triton kernels' own checks; the GPU path's "
                        "always run), warm-cache (granii's model cells again in a new process, "
                        "Triton's cache warm), kernels, decisions (every plan against granii's "
                        "choice), trace (where github-social's training steps spend their "
                        "time: trace.md), "
                        "social (the models on github-social), profile (this GPU's cost model: "
                        "gpu_points.csv, gpu_model.json), compile (torch.compile cells)")
    p.add_argument("--profile-budget", type=float, default=60.0)
    p.add_argument("--variants", default=None,
                   help="only these model variants (comma-separated; default: all)")
    p.add_argument("--summarize", default=None, metavar="CSV",
                   help="print the summary table of a finished run's gpu_check.csv and exit")
    args = p.parse_args(argv)
    if args.summarize:
        import csv
        with open(args.summarize) as f:
            print("\n".join(summary(list(csv.DictReader(f)))))
        return 0
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--small runs under Triton's interpreter: TRITON_INTERPRET must be 1")
        args.nodes = args.nodes or 16
        args.budget = args.budget or 600
        args.reps = args.reps or 1
        args.widths = (4,)
        args.features, args.hidden, args.classes, args.heads = 8, 8, 4, 2
        args.gat_heads, args.gat_dim = 2, 4
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: run with --small for the CPU check")
        args.nodes = args.nodes or 2_000_000
        args.budget = args.budget or 330
        args.reps = args.reps or 10
        args.widths = (32, 128)
        args.features, args.hidden, args.classes, args.heads = 128, 128, 16, 8
        args.gat_heads, args.gat_dim = 8, 16
    args.models = [m for m in args.models.split(",") if m]
    args.steps = [m for m in args.steps.split(",") if m]
    args.variants = None if args.variants is None else args.variants.split(",")
    if args.small:          # github-social under the interpreter would take hours
        args.steps = [m for m in args.steps if m != "social"]
    run = Run(args)
    run.references = {}
    run.out = Path(args.out or os.environ.get("OUT") or ROOT / "results" / "gpu")
    run.graph_line = "not built yet"
    run.say(f"device: {describe_device(run.dev)}")
    if not args.skip_checks:
        kernel_checks(run)
        write_report(run)
    from granii.kernels.triton import CsrGraph
    n = args.nodes
    run.say(f"graph: {n} nodes")
    src, dst = power_law_graph(n, 10 * n, run.dev)
    graph = CsrGraph.from_coo(src, dst, n, n)
    graph_line = (f"power-law, {n} nodes, {graph.num_edges} edges with self loops "
                  f"(symmetric; largest in-degree {graph.a.max_len}, mean "
                  f"{graph.num_edges / max(n, 1):.1f})")
    run.say(graph_line)
    run.graph_line = graph_line
    # the models first: their first calls compile the Triton kernels they run (in a fresh
    # process, as a user's first run does), then the kernels alone
    model_timings(run, graph, src, dst, n, compiled=False)
    if "warm-cache" in args.steps:
        warm_cache_first_calls(run)
    specs = layer_specs(args)
    if "decisions" in args.steps:
        decision_timings(run, src, dst, n, "", {k: v for k, v in specs.items()
                                                if not k.startswith("GAT")})
    if "kernels" in args.steps:
        spmm_timings(run, graph, src, dst, n)
        write_report(run)
        gat_timings(run, graph, src, dst, n)
        write_report(run)
    if "social" in args.steps and run.left() > 40:
        del graph
        s2, d2 = social_graph(run.dev)[:2]
        n2 = int(max(s2.max(), d2.max())) + 1
        g2 = CsrGraph.from_coo(s2, d2, n2, n2)
        run.graph_line += f"; github-social ({n2} nodes, {g2.num_edges} edges with loops)"
        model_timings(run, g2, s2, d2, n2, compiled=False, label="@github")
        if "decisions" in args.steps:
            decision_timings(run, s2, d2, n2, "@github", specs)
        if "compile" in args.steps:
            model_timings(run, g2, s2, d2, n2, compiled=True, label="@github")
        if "trace" in args.steps:
            trace_steps(run, s2, d2, n2)
        del g2, s2, d2
    if "profile" in args.steps and not args.small and run.left() > args.profile_budget + 30:
        from granii.profiling.gpu import profile
        run.say("profile: this GPU's cost model")
        profile(run.dev, run.out, budget=args.profile_budget, log=run.say)
    if "compile" in args.steps:
        model_timings(run, CsrGraph.from_coo(src, dst, n, n), src, dst, n, compiled=True)
    path = write_report(run)
    bad = [r for r in run.rows if r["ok"] == "NO"]
    run.say(f"wrote {path} and {run.out / 'gpu_check.csv'}; {len(bad)} check(s) failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
