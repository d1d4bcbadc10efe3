"""Benchmark of GAT's attention + aggregation: the fused native kernel against today's granii
pieces and DGL's GATConv ops, at the sizes of DGL's GAT examples.

``gat_aggregate`` (``out[v,h] = sum_{u->v} softmax_u(leaky_relu(el[u,h] + er[v,h])) feat[u,h]``)
computed by

    fused            gat_fused_native: one native pass per destination row, all heads
    granii_dgl       sddmm_add dgl + leaky_relu + edge_softmax dgl + spmm_weighted torch_csr
    granii_torch     sddmm_add torch + leaky_relu + edge_softmax torch + spmm_weighted torch_csr
    unfused_native   sddmm_add native + leaky_relu + edge_softmax native + spmm_weighted native
    dgl_gatconv      GATConv's own sequence: apply_edges(u_add_v), leaky_relu, edge_softmax,
                     update_all(u_mul_e, sum)

on the citation graphs of ``data/`` with 8 heads of 8 features (DGL's GAT example; self-loops as
the example adds them) and a generated graph of PPI's size (24 communities, 56,944 nodes, about
820 k edges plus self-loops) with 4 heads of 256 (DGL's PPI example), 1 and 2 threads, forward
alone (no autograd) and forward + backward (gradients to el, er and feat). "today" is the faster
of the two granii compositions in each cell (the plan granii runs today uses one of them); the
target is fused at least 1.5x faster than today in forward and in forward + backward.

The primitives ``sddmm_add`` and ``edge_softmax`` are timed the same way with each implementation
(native, dgl, torch), since the native ones are registered beside the others. On sampled blocks
(pubmed, ppi-like; batch 1024, fanout 10) the cost of building the fused kernel's per-block index
structures is set against its forward and backward on the block.

Implementations run interleaved within each round (background load hits them alike); the median
and the minimum over the rounds are reported (wall clock of this process).

Two OpenMP runtimes share the process: torch's own libgomp copy and the system one DGL links.
After a parallel region each one's workers spin for a while; on a 2-core machine those spinning
threads take the core the other runtime's next region needs, and 2-thread calls that follow a call
of the other library wait for it. ``OMP_WAIT_POLICY=PASSIVE`` (workers sleep at once) removes that;
the committed results hold a run with the default (``gat.*``) and one with PASSIVE
(``gat_passive.*``, ``--tag _passive``).

Usage: ``OMP_NUM_THREADS=2 python -m scripts.bench_gat [--quick] [--budget S] [--tag T]``; writes
``results/kernels/gat<T>.csv``, ``gat<T>_primitives.csv``, ``gat<T>_blocks.csv``, ``gat<T>.md``
and ``gat<T>.png``.
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
import dgl.function as fn  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.csvfile import write_csv  # noqa: E402
from granii import kernels  # noqa: E402
from granii.datasets import load_graph  # noqa: E402
from granii.graph import graph_info  # noqa: E402
from granii.kernels import native_gat  # noqa: E402
from granii.profiling import generators as gen  # noqa: E402

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")
OUT = ROOT / "results" / "kernels"
SLOPE = 0.2

# name: (graph builder, heads, features per head)
CASES = {
    "cora": (lambda: load_graph("cora", self_loops="add"), 8, 8),
    "citeseer": (lambda: load_graph("citeseer", self_loops="add"), 8, 8),
    "pubmed": (lambda: load_graph("pubmed", self_loops="add"), 8, 8),
    "ppi-like": (lambda: dgl.add_self_loop(gen.community(56_944, 24, 14.4, mix=0.95, seed=0)), 4, 256),
}
BLOCK_CASES = ["pubmed", "ppi-like"]
IMPLS = ["fused", "granii_dgl", "granii_torch", "unfused_native", "dgl_gatconv"]
TODAY = ["granii_dgl", "granii_torch"]


def progress(msg):
    print(msg, file=sys.stderr, flush=True)


def _composed(sddmm, softmax, spmm):
    """``gat_aggregate`` from registered primitives, as a lowered plan calls them."""
    add, soft, agg = (kernels.get(p, i) for p, i in
                      (("sddmm_add", sddmm), ("edge_softmax", softmax), ("spmm_weighted", spmm)))

    def run(gi, el, er, feat):
        return agg(gi, soft(gi, F.leaky_relu(add(gi, el, er), SLOPE)), feat)
    return run


def _gatconv_ops(gi, el, er, feat):
    """The message-passing sequence of ``dgl.nn.GATConv.forward`` after its projections."""
    g = gi.g
    with g.local_scope():
        g.srcdata.update({"ft": feat, "el": el})
        g.dstdata.update({"er": er})
        g.apply_edges(fn.u_add_v("el", "er", "e"))
        e = F.leaky_relu(g.edata.pop("e"), SLOPE)
        g.edata["a"] = dgl.ops.edge_softmax(g, e)
        g.update_all(fn.u_mul_e("ft", "a", "m"), fn.sum("m", "ft"))
        return g.dstdata["ft"]


def implementations():
    out = {
        "granii_dgl": _composed("dgl", "dgl", "torch_csr"),
        "granii_torch": _composed("torch", "torch", "torch_csr"),
        "dgl_gatconv": _gatconv_ops,
    }
    if native_gat.available():
        out["fused"] = lambda gi, el, er, feat: native_gat.gat_fused_native(gi, el, er, feat, SLOPE)
        if "native" in kernels.implementations("spmm_weighted"):
            out["unfused_native"] = _composed("native", "native", "native")
    return {k: out[k] for k in IMPLS if k in out}


def _wall(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def side_by_side(fns, min_rounds, max_rounds, budget):
    """Rounds of every candidate in turn (after one warm-up call each, which also builds the
    once-per-graph structures) until ``max_rounds`` or ``budget`` seconds (at least ``min_rounds``)."""
    for f in fns.values():
        f()
    samples = {k: [] for k in fns}
    start = time.perf_counter()
    for r in range(max_rounds):
        for k, f in fns.items():
            samples[k].append(_wall(f))
        if r + 1 >= min_rounds and time.perf_counter() - start > budget:
            break
    return samples


def _runner(call, args, backward, gy):
    if not backward:
        def run():
            with torch.no_grad():
                call(*args)
        return run

    def run_bwd():
        for t in args[1:]:
            t.grad = None
        call(*args).backward(gy)
    return run_bwd


def bench_case(name, g, heads, width, threads_list, budget, rows, prim_rows):
    gi = graph_info(g)
    n, e = g.num_nodes(), g.num_edges()
    gen_ = torch.Generator().manual_seed(0)
    el = torch.randn(n, heads, 1, generator=gen_)
    er = torch.randn(n, heads, 1, generator=gen_)
    feat = torch.randn(n, heads, width, generator=gen_)
    gy = torch.randn(n, heads, width, generator=gen_)
    impls = implementations()
    big = e * heads * width > 100e6
    for threads in threads_list:
        torch.set_num_threads(threads)
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            args = (gi, *(t.clone().requires_grad_(backward) for t in (el, er, feat)))
            fns = {k: _runner(f, args, backward, gy) for k, f in impls.items()}
            t0 = time.perf_counter()
            samples = side_by_side(fns, 3 if big else 5, 7 if big else 25, budget)
            med = {k: statistics.median(s) for k, s in samples.items()}
            today = min(TODAY, key=lambda k: med[k])
            for k, s in samples.items():
                rows.append({
                    "graph": name, "nodes": n, "edges": e, "heads": heads, "features": width,
                    "threads": threads, "mode": mode, "impl": k,
                    "median_ms": round(med[k] * 1e3, 4), "min_ms": round(min(s) * 1e3, 4),
                    "rounds": len(s),
                    "today_over_this": round(med[today] / med[k], 3),
                    "today_over_this_min": round(min(samples[today]) / min(s), 3),
                })
            if "fused" in med:
                progress(f"  {name} {heads}x{width} threads={threads} {mode}: fused "
                         f"{med['fused'] * 1e3:.2f} ms, today ({today}) {med[today] * 1e3:.2f} ms, "
                         f"x{med[today] / med['fused']:.2f}; GATConv ops x"
                         f"{med['dgl_gatconv'] / med['fused']:.2f} ({time.perf_counter() - t0:.1f} s)")
        bench_primitives(name, gi, el, er, threads, budget, big, prim_rows)


def bench_primitives(name, gi, el, er, threads, budget, big, prim_rows):
    """``sddmm_add`` (el + er per edge) and ``edge_softmax`` (of those scores), each implementation."""
    scores = kernels.get("sddmm_add", "dgl")(gi, el, er).detach()
    gy = torch.randn_like(scores)
    for backward in (False, True):
        mode = "fwd+bwd" if backward else "fwd"
        fns = {}
        for prim, args in (("sddmm_add", (el, er)), ("edge_softmax", (scores,))):
            for impl in kernels.implementations(prim):
                leaves = tuple(t.clone().requires_grad_(backward) for t in args)
                f = kernels.get(prim, impl)
                fns[prim, impl] = _runner(lambda gi, *a, f=f: f(gi, *a), (gi, *leaves), backward, gy)
        samples = side_by_side(fns, 3 if big else 5, 7 if big else 25, budget / 2)
        for (prim, impl), s in samples.items():
            ref = statistics.median(samples[prim, "dgl"])
            prim_rows.append({
                "graph": name, "edges": gi.num_edges, "heads": el.shape[1], "threads": threads,
                "mode": mode, "primitive": prim, "impl": impl,
                "median_ms": round(statistics.median(s) * 1e3, 4), "min_ms": round(min(s) * 1e3, 4),
                "dgl_over_this": round(ref / statistics.median(s), 3),
            })


# -- sampled blocks --------------------------------------------------------------------------------
def bench_blocks(g, name, heads, width, threads, rounds, rows, batch=1024, fanout=10):
    """Per minibatch block of DGL's neighbour sampler: building the index structures the fused
    kernel needs (CSR of A, and for the backward A^T and the A^T -> A positions) against the
    fused forward and backward on that block, and today's cheaper composition beside it."""
    from granii.graph import GraphInfo
    torch.set_num_threads(threads)
    sampler = dgl.dataloading.NeighborSampler([fanout])
    gen_ = torch.Generator().manual_seed(0)
    today = implementations()
    acc = {k: [] for k in ("build_a", "build_at", "fused_fwd", "fused_bwd", "today_fwd_bwd")}
    for r in range(rounds + 1):
        seeds = torch.randperm(g.num_nodes(), generator=gen_)[:batch]
        dgl.seed(r)
        blk = sampler.sample_blocks(g, seeds)[2][0]
        n_src, n_dst = blk.num_src_nodes(), blk.num_dst_nodes()
        el = torch.randn(n_src, heads, 1, requires_grad=True)
        er = torch.randn(n_dst, heads, 1, requires_grad=True)
        feat = torch.randn(n_src, heads, width, requires_grad=True)
        gy = torch.randn(n_dst, heads, width)
        gi = GraphInfo(blk)
        t = {"build_a": _wall(lambda: native_gat._csr(gi, "a"))}
        y = None

        def fwd():
            nonlocal y
            y = native_gat.gat_fused_native(gi, el, er, feat, SLOPE)
        t["fused_fwd"] = _wall(fwd)
        t["build_at"] = _wall(lambda: (native_gat._csr(gi, "at"), native_gat._t2in(gi)))
        t["fused_bwd"] = _wall(lambda: y.backward(gy))
        gi2 = GraphInfo(blk)
        best = None
        for k in TODAY:
            cost = _wall(lambda: today[k](gi2, el, er, feat).backward(gy))
            best = cost if best is None else min(best, cost)
        t["today_fwd_bwd"] = best
        if r:                                          # the first round warms up
            for k, v in t.items():
                acc[k].append(v)
    med = {k: statistics.median(v) for k, v in acc.items()}
    rows.append({"graph": name, "batch": batch, "fanout": fanout, "heads": heads, "features": width,
                 "threads": threads, "edges": blk.num_edges(), "rounds": rounds,
                 **{f"{k}_ms": round(v * 1e3, 4) for k, v in med.items()},
                 "build_over_fused": round((med["build_a"] + med["build_at"])
                                           / (med["fused_fwd"] + med["fused_bwd"]), 3)})
    progress(f"  blocks of {name} (batch {batch}, fanout {fanout}), {threads} threads: build "
             f"{(med['build_a'] + med['build_at']) * 1e3:.2f} ms vs fused fwd+bwd "
             f"{(med['fused_fwd'] + med['fused_bwd']) * 1e3:.2f} ms (today {med['today_fwd_bwd'] * 1e3:.2f} ms)")


# -- output ------------------------------------------------------------------------------------------


def _cell(rows, graph, threads, mode, impl):
    for r in rows:
        if (r["graph"], r["threads"], r["mode"], r["impl"]) == (graph, threads, mode, impl):
            return r
    return None


def write_markdown(rows, prim_rows, path, meta, block_rows=()):
    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    impls = [k for k in IMPLS if any(r["impl"] == k for r in rows)]
    lines = ["# GAT attention + aggregation: fused native kernel vs today's plan and DGL", "",
             f"Machine: {meta['machine']}; torch {torch.__version__}, DGL {dgl.__version__}; "
             f"OMP_WAIT_POLICY {meta['wait_policy']}; load average {meta['load']:.1f} at the start; "
             f"run of {meta['minutes']:.1f} min. Written by "
             f"`{' '.join(['python -m scripts.bench_gat', meta['argv']]).strip()}`.", "",
             "Median wall time per call in ms (min over the rounds in brackets). *today* is the "
             "faster of the two granii compositions (`granii_dgl`, `granii_torch`: sddmm_add + "
             "leaky_relu + edge_softmax + spmm_weighted torch_csr); **fused/today** is today's "
             "median over the fused one's (target: at least 1.5x). fwd: forward without autograd; "
             "fwd+bwd: forward and backward with gradients to el, er and feat.", ""]
    head = "| graph | H x F | edges | threads | mode | " + " | ".join(impls) + " | fused vs today | fused vs GATConv ops |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for g in graphs:
        for threads in sorted({r["threads"] for r in rows if r["graph"] == g}):
            for mode in ("fwd", "fwd+bwd"):
                cells = [_cell(rows, g, threads, mode, k) for k in impls]
                if not any(cells):
                    continue
                ref = next(c for c in cells if c)
                fused = _cell(rows, g, threads, mode, "fused")
                conv = _cell(rows, g, threads, mode, "dgl_gatconv")
                vs_today = f"**{fused['today_over_this']:.2f}x**" if fused else "-"
                vs_conv = f"{conv['median_ms'] / fused['median_ms']:.2f}x" if fused and conv else "-"
                lines.append(
                    f"| {g} | {ref['heads']} x {ref['features']} | {ref['edges']:,} | {threads} | {mode} | "
                    + " | ".join(f"{c['median_ms']:.2f} ({c['min_ms']:.2f})" if c else "-" for c in cells)
                    + f" | {vs_today} | {vs_conv} |")
    fused = [r for r in rows if r["impl"] == "fused"]
    if fused:
        worst = min(fused, key=lambda r: r["today_over_this"])
        met = sum(r["today_over_this"] >= 1.5 for r in fused)
        lines += ["", f"Fused at least 1.5x faster than today in {met} of {len(fused)} cells; lowest: "
                  f"{worst['today_over_this']:.2f}x ({worst['graph']}, {worst['threads']} threads, "
                  f"{worst['mode']})."]
    if prim_rows:
        lines += ["", "## Primitives on the same graphs", "",
                  "`sddmm_add` (`el[u] + er[v]` per edge, H heads) and `edge_softmax` of those scores: "
                  "median ms (DGL's median over this one in brackets).", ""]
        keys = list(dict.fromkeys((r["primitive"], r["impl"]) for r in prim_rows))
        head = "| graph | threads | mode | " + " | ".join(f"{p} {i}" for p, i in keys) + " |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for g in dict.fromkeys(r["graph"] for r in prim_rows):
            for threads in sorted({r["threads"] for r in prim_rows if r["graph"] == g}):
                for mode in ("fwd", "fwd+bwd"):
                    cell = {(r["primitive"], r["impl"]): r for r in prim_rows
                            if (r["graph"], r["threads"], r["mode"]) == (g, threads, mode)}
                    lines.append(f"| {g} | {threads} | {mode} | " + " | ".join(
                        f"{cell[k]['median_ms']:.3f} ({cell[k]['dgl_over_this']:.2f}x)" if k in cell else "-"
                        for k in keys) + " |")
    if block_rows:
        lines += ["", "## Sampled blocks", "",
                  "Blocks of DGL's neighbour sampler (one layer; a fresh block each round, each "
                  "structure built on it once): median ms of building the CSR of A (forward) and "
                  "of A^T with the A^T -> A positions (backward), against the fused kernel's forward "
                  "and backward on the same block and today's faster composition (forward + backward, "
                  "its own per-block structures included).", "",
                  "| graph | batch | fanout | H x F | threads | block edges | build A | build A^T | "
                  "fused fwd | fused bwd | today fwd+bwd | build / fused |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in block_rows:
            lines.append(f"| {r['graph']} | {r['batch']} | {r['fanout']} | {r['heads']} x {r['features']} | "
                         f"{r['threads']} | {r['edges']:,} | {r['build_a_ms']:.3f} | {r['build_at_ms']:.3f} | "
                         f"{r['fused_fwd_ms']:.3f} | {r['fused_bwd_ms']:.3f} | {r['today_fwd_bwd_ms']:.3f} | "
                         f"{r['build_over_fused']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    fused = [r for r in rows if r["impl"] == "fused"]
    if not fused:
        return
    labels = [f"{r['graph']}\n{r['threads']}t {r['mode']}" for r in fused]
    conv = {(r["graph"], r["threads"], r["mode"]): r["median_ms"] for r in rows if r["impl"] == "dgl_gatconv"}
    x = range(len(fused))
    fig, ax = plt.subplots(figsize=(max(8, len(fused) * 0.75), 4.5))
    ax.bar([i - 0.2 for i in x], [r["today_over_this"] for r in fused], 0.4, label="today's plan / fused")
    ax.bar([i + 0.2 for i in x], [conv[(r["graph"], r["threads"], r["mode"])] / r["median_ms"] for r in fused],
           0.4, label="GATConv ops / fused")
    ax.axhline(1.5, color="k", ls="--", lw=1, label="target 1.5x")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("speedup of the fused kernel (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("GAT attention + aggregation: fused native kernel")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="cora and ppi-like only, budget 1 s")
    ap.add_argument("--only", default="", help="comma-separated graphs (default: all)")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per cell (at least 3 rounds)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tag", default="", help="suffix of the output files (gat<tag>.csv, ...)")
    args = ap.parse_args(argv)
    if not native_gat.available():
        progress("granii: native kernels not built: only the unfused implementations are timed")
    names = ["cora", "ppi-like"] if args.quick else list(CASES)
    if args.only:
        names = args.only.split(",")
    budget = 1.0 if args.quick else args.budget
    threads_list = [int(t) for t in args.threads.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before = torch.get_num_threads()
    start = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    rows, prim_rows, block_rows = [], [], []
    try:
        for i, name in enumerate(names):
            build, heads, width = CASES[name]
            g = build()
            progress(f"[{i + 1}/{len(names)}] {name}: {g.num_nodes():,} nodes, {g.num_edges():,} edges, "
                     f"{heads} heads x {width}")
            bench_case(name, g, heads, width, threads_list, budget, rows, prim_rows)
            if name in BLOCK_CASES and native_gat.available():
                for threads in threads_list:
                    bench_blocks(g, name, heads, width, threads, 3 if args.quick else 10, block_rows)
    finally:
        torch.set_num_threads(before)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "minutes": (time.perf_counter() - start) / 60, "quick": args.quick,
            "wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"), "argv": " ".join(sys.argv[1:]),
            "load": load_at_start}
    t = args.tag
    write_csv(out / f"gat{t}.csv", rows)
    write_csv(out / f"gat{t}_primitives.csv", prim_rows)
    write_csv(out / f"gat{t}_blocks.csv", block_rows)
    write_markdown(rows, prim_rows, out / f"gat{t}.md", meta, block_rows)
    plot(rows, out / f"gat{t}.png")
    progress(f"wrote {out}/gat{t}.csv, gat{t}_primitives.csv, gat{t}_blocks.csv, gat{t}.md, gat{t}.png")


if __name__ == "__main__":
    main()
