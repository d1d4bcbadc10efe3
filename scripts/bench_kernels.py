"""Benchmark of the SpMM kernels: DGL vs ``torch_csr`` (cached transpose) vs plain ``torch.sparse.mm``.

For ``spmm`` (``Y = A X``) and ``spmm_weighted`` (``Y = A_w X``, with ``w`` constant as a
normalised adjacency, with ``w`` trainable as attention, and with 4 attention heads), forward and
forward+backward, on random graphs and feature widths ``k``. Implementations are interleaved within each repeat so
background load affects them alike; the median over repeats is reported.

Usage: ``OMP_NUM_THREADS=2 python -m scripts.bench_kernels [--quick]``; writes
``results/kernels/spmm.csv`` and ``results/kernels/spmm.md``.
"""
import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dgl  # noqa: E402
import torch  # noqa: E402

from bench.csvfile import write_csv  # noqa: E402
from granii import kernels  # noqa: E402
from granii.graph import graph_info  # noqa: E402

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")

# name: (nodes, edges, feature widths k); k = 1024 on 2M edges alone would take minutes
GRAPHS = {"rand-10k-0.5M": (10_000, 500_000, [32, 256, 1024]),
          "rand-20k-1M": (20_000, 1_000_000, [32, 256, 1024]),
          "rand-50k-2M": (50_000, 2_000_000, [32, 256])}
DEFAULT_GRAPHS = ["rand-10k-0.5M", "rand-50k-2M"]
# torch's own backward for the values of a CSR tensor takes seconds even at 0.5M edges and its
# memory grows with num_dst * num_src: measured on graphs up to this many nodes and this k only.
PLAIN_W_GRAD_MAX_NODES = 10_000
PLAIN_W_GRAD_MAX_K = 32
# multi-head cells on at most this many edges * k (the larger graph runs k = 32 only)
HEADS_MAX_WORK = 500_000 * 256
IMPLS = ["dgl", "torch_csr", "torch_plain"]
# (primitive, variant): which inputs need grad in forward+backward; "4 heads": GAT-style
# aggregation with w of shape (E, 4, 1) and x of shape (n, 4, k / 4), for k <= 256 only
CASES = [("spmm", "x"), ("spmm_weighted", "x (w const)"), ("spmm_weighted", "x, w"),
         ("spmm_weighted", "x, w (4 heads)")]
HEADS = 4


def _plain_csr(gi, w):
    """``A`` or ``A_w`` as one torch CSR tensor, for ``torch.sparse.mm`` with torch's own backward."""
    crow, col, perm = gi.csr_in()
    vals = torch.ones(gi.num_edges) if w is None else w[perm]
    return torch.sparse_csr_tensor(crow.int(), col.int(), vals, size=(gi.num_dst, gi.num_src))


def _runner(gi, primitive, impl, x, w, w_grad):
    """A zero-argument function computing the primitive with ``impl`` on the given inputs."""
    if impl == "torch_plain":
        if primitive == "spmm":
            a = _plain_csr(gi, None)
            return lambda: torch.sparse.mm(a, x)
        if not w_grad:
            a = _plain_csr(gi, w)
            return lambda: torch.sparse.mm(a, x)
        return lambda: torch.sparse.mm(_plain_csr(gi, w), x)
    fn = kernels.get(primitive, impl)
    if primitive == "spmm":
        return lambda: fn(gi, x)
    return lambda: fn(gi, w, x)


def _time(run, backward, gy, leaves):
    for t in leaves:
        t.grad = None
    start = time.perf_counter()
    y = run()
    if backward:
        y.backward(gy)
    return time.perf_counter() - start, y


def bench_cell(gi, primitive, variant, k, backward, repeats, budget_s):
    """Median and min seconds per implementation for one configuration.

    An implementation whose warm-up call alone exceeds ``budget_s`` is timed once more only.
    """
    torch.manual_seed(0)
    w_grad = backward and variant.startswith("x, w")
    heads = HEADS if "heads" in variant else 0
    impls = [i for i in IMPLS if not (i == "torch_plain" and (heads or (w_grad and (
        gi.num_dst > PLAIN_W_GRAD_MAX_NODES or k > PLAIN_W_GRAD_MAX_K))))]
    feat = (heads, k // heads) if heads else (k,)
    x = torch.randn(gi.num_src, *feat, requires_grad=backward)
    w_shape = (gi.num_edges, heads, 1) if heads else (gi.num_edges,)
    w = torch.rand(*w_shape, requires_grad=w_grad) if primitive == "spmm_weighted" else None
    leaves = [t for t in (x, w) if t is not None and t.requires_grad]
    gy = torch.randn(gi.num_dst, *feat)
    runs = {impl: _runner(gi, primitive, impl, x, w, w_grad) for impl in impls}
    times = {impl: [] for impl in impls}
    outs, slow = {}, set()
    for impl, run in runs.items():  # warm-up: builds the cached per-graph structures
        seconds, outs[impl] = _time(run, backward, gy, leaves)
        if seconds > budget_s:
            slow.add(impl)
    for impl in impls[1:]:
        torch.testing.assert_close(outs[impl], outs["dgl"], rtol=1e-3, atol=1e-3)
    del outs
    start = time.perf_counter()
    for rep in range(repeats):
        for impl, run in runs.items():
            if impl not in slow or not times[impl]:
                times[impl].append(_time(run, backward, gy, leaves)[0])
        if rep >= 2 and time.perf_counter() - start > budget_s:
            break
    return {impl: (statistics.median(ts), min(ts), len(ts)) for impl, ts in times.items()}


def write_markdown(rows, path, header):
    lines = [header, "",
             "| graph | primitive | grad wrt | mode | k | dgl ms | torch_csr ms | torch_plain ms "
             "| dgl / torch_csr | torch_plain / torch_csr | dgl / torch_csr (min) | fastest |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    cells = {}
    for r in rows:
        cells.setdefault((r["graph"], r["primitive"], r["variant"], r["mode"], r["k"]), {})[r["impl"]] = r
    for (graph, primitive, variant, mode, k), by in cells.items():
        ms = {impl: r["median_ms"] for impl, r in by.items()}
        lo = {impl: r["min_ms"] for impl, r in by.items()}
        plain = f"{ms['torch_plain']:.1f}" if "torch_plain" in ms else "n/a"
        plain_ratio = f"{ms['torch_plain'] / ms['torch_csr']:.2f}" if "torch_plain" in ms else "n/a"
        lines.append(
            f"| {graph} | {primitive} | {variant if mode == 'fwd+bwd' else '-'} | {mode} | {k} | "
            f"{ms['dgl']:.1f} | {ms['torch_csr']:.1f} | {plain} | "
            f"{ms['dgl'] / ms['torch_csr']:.2f} | {plain_ratio} | {lo['dgl'] / lo['torch_csr']:.2f} | "
            f"{min(ms, key=ms.get)} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest graph, k=32 and 256 only")
    parser.add_argument("--graphs", nargs="+", choices=sorted(GRAPHS), default=DEFAULT_GRAPHS)
    parser.add_argument("--ks", nargs="+", type=int, help="only these of each graph's widths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=2.5, help="seconds per cell after 3 repeats")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "kernels")
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    graphs = args.graphs[:1] if args.quick else args.graphs
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    rows = []
    t0 = time.perf_counter()
    for name in graphs:
        n, e, ks = GRAPHS[name]
        ks = [k for k in ks if (args.ks is None or k in args.ks) and not (args.quick and k > 256)]
        dgl.seed(0)
        g = dgl.rand_graph(n, e)
        gi = graph_info(g)
        for primitive, variant in CASES:
            for backward in ([False, True] if variant in ("x", "x (w const)") else [True]):
                for k in (k for k in ks if not ("heads" in variant and k * e > HEADS_MAX_WORK)):
                    res = bench_cell(gi, primitive, variant, k, backward, args.repeats, args.budget)
                    mode = "fwd+bwd" if backward else "fwd"
                    for impl, (med, lo, reps) in res.items():
                        rows.append({"graph": name, "nodes": n, "edges": g.num_edges(),
                                     "primitive": primitive, "variant": variant, "mode": mode,
                                     "k": k, "impl": impl, "median_ms": round(med * 1e3, 3),
                                     "min_ms": round(lo * 1e3, 3), "repeats": reps})
                    ms = {i: round(r[0] * 1e3, 1) for i, r in res.items()}
                    print(f"{name} {primitive} [{variant}] {mode} k={k}: {ms}", flush=True)
    elapsed = time.perf_counter() - t0

    write_csv(args.out / "spmm.csv", rows)
    header = (f"# SpMM kernels: median milliseconds per call\n\n"
              f"torch {torch.__version__}, dgl {dgl.__version__}, {platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads; 1-minute load average {load[0]:.2f} at start, "
              f"{os.getloadavg()[0]:.2f} at the end; "
              f"{elapsed:.0f} s in all. Ratios above 1 mean torch_csr is faster. `torch_plain` is "
              f"`torch.sparse.mm` on a CSR tensor with torch's own backward (the CSR of a trainable "
              f"`w` is rebuilt per call, as autograd needs; n/a: not run, see the script). Forward rows "
              f"of spmm_weighted use a constant `w`. The min column is the ratio of the fastest "
              f"repeats, less sensitive to other load on the machine than the median.")
    write_markdown(rows, args.out / "spmm.md", header)
    print(f"wrote {args.out / 'spmm.csv'} and {args.out / 'spmm.md'} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
