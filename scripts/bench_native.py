"""Kernel benchmark of granii's native SpMM family against DGL and torch CSR.

For each graph (the real graphs of ``data/`` and generated graphs of 1 M to 5 M edges), feature
width ``k`` (16, 32, 128, 512; 512 only up to 1 M edges), thread count (1, 2) and mode (forward;
forward + backward with a gradient to ``x``), every implementation of

    spmm           Y = A X                          dgl (copy_u_sum), torch_csr, native
    spmm_weighted  Y = A_w X, w constant            dgl (u_mul_e_sum), torch_csr, native
    spmm_mean      Y = D_in^-1 A X                  dgl (copy_u_mean), torch_csr, native
    spmm_norm      Y = D_in^-1/2 A D_out^-1/2 X     dgl (GraphConv's row scale, copy_u_sum,
                                                    row scale), torch (same with torch_csr), native (fused)

runs interleaved with the others of its cell (so background load hits them alike); the median
and the minimum over the rounds are reported, with the ratio to DGL's unweighted ``copy_u_sum``
in the same cell (the targets: weighted and normalised SpMM within 1.15x of it) and the achieved
bandwidth, ``(E k + N_dst k) * bytes + E * 4`` per forward (twice that with the backward), against
this machine's copy bandwidth (``torch`` copy of 512 MB, read + write) measured at the start of
the same run. Timing is wall clock of the calling process, so with other work on the machine the
medians rise; the min column is the less disturbed figure.

Sampled blocks: on minibatches of DGL's neighbour sampler, what building the CSR of a block and
its transpose costs against the block's aggregation (forward, and forward + backward), with DGL's
first call on a fresh block (which builds DGL's own formats) beside it.

Usage: ``python -m scripts.bench_native [--quick]``; writes ``results/kernels/native.csv``,
``native_blocks.csv``, ``native.md`` and ``native.png``.
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
from granii.datasets import load_graph  # noqa: E402
from granii.graph import graph_info, GraphInfo  # noqa: E402
from granii.kernels import native  # noqa: E402
from granii.profiling import generators as gen  # noqa: E402

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
OUT = ROOT / "results" / "kernels"

REAL = ["cora", "citeseer", "pubmed", "pgp-giantcompo", "us-power-grid", "deezer-europe",
        "astro-ph", "wing-mesh", "github-social"]
# name: builder; R-MAT (power-law degrees) and uniform (flat degrees)
GENERATED = {
    "rmat-1M": lambda: gen.rmat(16, 8, seed=1),
    "uniform-2M": lambda: gen.uniform(100_000, 2_000_000, seed=2),
    "rmat-5M": lambda: gen.rmat(18, 10, seed=3),
}
KS = [16, 32, 128, 512]
K512_MAX_EDGES = 1_100_000
PRIMS = {
    "spmm": ["dgl", "torch_csr", "native"],
    "spmm_weighted": ["dgl", "torch_csr", "native"],
    "spmm_mean": ["dgl", "torch_csr", "native"],
    "spmm_norm": ["dgl", "torch", "native"],
}
QUICK = {"graphs": ["cora", "github-social", "rmat-1M"], "ks": [32, 128], "threads": [1, 2],
         "prims": PRIMS}


def progress(msg):
    print(msg, file=sys.stderr, flush=True)


def copy_bandwidth(threads, mb=512, rounds=5):
    """GB/s of a torch copy (bytes read + written) of ``mb`` MB with ``threads`` threads."""
    torch.set_num_threads(threads)
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_wall(lambda: b.copy_(a)) for _ in range(rounds))
    return 2 * a.numel() * 4 / best / 1e9


def _wall(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def runner(prim, impl, gi, x, w, dd, ds, backward, gy):
    fn = kernels.get(prim, impl)
    if prim == "spmm_weighted":
        call = lambda: fn(gi, w, x)
    elif prim == "spmm_norm":
        call = lambda: fn(gi, dd, ds, x)
    else:
        call = lambda: fn(gi, x)
    if not backward:
        def run():
            with torch.no_grad():
                call()
        return run

    def run_bwd():
        x.grad = None
        call().backward(gy)
    return run_bwd


def side_by_side(fns, min_rounds=3, max_rounds=7, budget=2.0):
    """Rounds of every candidate in turn (after one warm-up call each) until ``max_rounds`` or
    ``budget`` seconds have passed (at least ``min_rounds``)."""
    for fn in fns.values():
        fn()
    samples = {k: [] for k in fns}
    start = time.perf_counter()
    for r in range(max_rounds):
        for k, fn in fns.items():
            samples[k].append(_wall(fn))
        if r + 1 >= min_rounds and time.perf_counter() - start > budget:
            break
    return samples


def bench_graph(name, g, ks, threads_list, prims, copy_bw, rows, budget):
    gi = graph_info(g)
    n_src, n_dst, e = g.num_src_nodes(), g.num_dst_nodes(), g.num_edges()
    torch.manual_seed(0)
    w = (torch.rand(e) + 0.1)
    dd, ds = native.degree_scales(gi, -0.5, -0.5)
    for k in ks:
        if k == 512 and e > K512_MAX_EDGES:
            continue
        x = torch.randn(n_src, k)
        gy = torch.randn(n_dst, k)
        for threads in threads_list:
            torch.set_num_threads(threads)
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"
                xx = x.clone().requires_grad_(backward)
                fns = {(p, i): runner(p, i, gi, xx, w, dd, ds, backward, gy)
                       for p, impls in prims.items() for i in impls}
                t0 = time.perf_counter()
                samples = side_by_side(fns, min_rounds=3 if e <= 2_100_000 else 2, budget=budget)
                ref = statistics.median(samples[("spmm", "dgl")])
                ref_min = min(samples[("spmm", "dgl")])
                for (p, i), s in samples.items():
                    med = statistics.median(s)
                    moved = ((e + n_dst) * k * 4 + e * 4) * (2 if backward else 1)
                    rows.append({
                        "graph": name, "n_src": n_src, "n_dst": n_dst, "edges": e, "k": k,
                        "threads": threads, "mode": mode, "primitive": p, "impl": i,
                        "median_ms": round(med * 1e3, 4), "min_ms": round(min(s) * 1e3, 4),
                        "rounds": len(s),
                        "vs_copy_u_sum": round(med / ref, 3),
                        "vs_copy_u_sum_min": round(min(s) / ref_min, 3),
                        "gbps": round(moved / med / 1e9, 2),
                        "frac_copy_bw": round(moved / med / 1e9 / copy_bw[threads], 3),
                    })
                nat = {p: statistics.median(samples[(p, "native")]) / ref for p in prims}
                progress(f"  {name} k={k} threads={threads} {mode}: "
                         + " ".join(f"{p} native/copy_u_sum={r:.2f}" for p, r in nat.items())
                         + f" ({time.perf_counter() - t0:.1f} s)")


# -- sampled blocks ------------------------------------------------------------------------------
def bench_blocks(g, name, ks, threads, rounds, rows, batch=1024, fanouts=(10, 10)):
    """Per minibatch: build the CSR of the first (largest) block and its transpose, aggregate
    (native spmm_norm), against DGL's GraphConv-style sequence on a fresh copy of the block."""
    torch.set_num_threads(threads)
    sampler = dgl.dataloading.NeighborSampler(list(fanouts))
    gen_ = torch.Generator().manual_seed(0)
    for k in ks:
        acc = {key: [] for key in ("build_a", "build_at", "nat_fwd", "nat_bwd", "dgl_fwd_first",
                                   "dgl_bwd_first", "dgl_fwd", "nat_fwd_again")}
        for r in range(rounds + 1):
            seeds = torch.randperm(g.num_nodes(), generator=gen_)[:batch]
            dgl.seed(r)
            _, _, blocks = sampler.sample_blocks(g, seeds)
            dgl.seed(r)
            _, _, blocks2 = sampler.sample_blocks(g, seeds)
            blk, blk2 = blocks[0], blocks2[0]
            x = torch.randn(blk.num_src_nodes(), k, requires_grad=True)
            gy = torch.randn(blk.num_dst_nodes(), k)
            gi = GraphInfo(blk)
            t = {}
            t["build_a"] = _wall(lambda: (native.csr_index(gi, "a"),
                                          native.degree_scales(gi, -0.5, -0.5)))
            dd, ds = native.degree_scales(gi, -0.5, -0.5)
            y = None

            def fwd():
                nonlocal y
                y = native.spmm_norm_native(gi, dd, ds, x)
            t["nat_fwd"] = _wall(fwd)
            t["build_at"] = _wall(lambda: native.csr_index(gi, "at"))
            t["nat_bwd"] = _wall(lambda: y.backward(gy))
            t["nat_fwd_again"] = _wall(lambda: native.spmm_norm_native(gi, dd, ds, x))
            gi2 = GraphInfo(blk2)
            x2 = torch.randn(blk2.num_src_nodes(), k, requires_grad=True)
            gy2 = torch.randn(blk2.num_dst_nodes(), k)

            def dgl_fwd():       # the degree vectors as GraphConv computes them, then its sequence
                nonlocal y
                ds2 = blk2.out_degrees().float().clamp(min=1).pow(-0.5)
                dd2 = blk2.in_degrees().float().clamp(min=1).pow(-0.5)
                y = kernels.get("spmm_norm", "dgl")(gi2, dd2, ds2, x2)
            t["dgl_fwd_first"] = _wall(dgl_fwd)
            t["dgl_bwd_first"] = _wall(lambda: y.backward(gy2))
            t["dgl_fwd"] = _wall(dgl_fwd)
            if r == 0:
                continue       # warm-up
            for key, v in t.items():
                acc[key].append(v)
        med = {key: statistics.median(v) * 1e3 for key, v in acc.items()}
        rows.append({"graph": name, "k": k, "threads": threads, "batch": batch,
                     "fanouts": "/".join(map(str, fanouts)), "block_src": blk.num_src_nodes(),
                     "block_dst": blk.num_dst_nodes(), "block_edges": blk.num_edges(),
                     **{f"{key}_ms": round(v, 4) for key, v in med.items()},
                     "build_over_fwd": round((med["build_a"]) / med["nat_fwd"], 3),
                     "build_over_fwd_bwd": round((med["build_a"] + med["build_at"])
                                                 / (med["nat_fwd"] + med["nat_bwd"]), 3),
                     "native_total_ms": round(med["build_a"] + med["build_at"] + med["nat_fwd"]
                                              + med["nat_bwd"], 4),
                     "dgl_total_ms": round(med["dgl_fwd_first"] + med["dgl_bwd_first"], 4)})
        row = rows[-1]
        progress(f"  blocks of {name} k={k} threads={threads}: {row['block_edges']} edges; build "
                 f"A {med['build_a']:.2f} ms, A^T {med['build_at']:.2f} ms; native fwd "
                 f"{med['nat_fwd']:.2f} ms, bwd {med['nat_bwd']:.2f} ms; DGL first fwd+bwd "
                 f"{row['dgl_total_ms']:.2f} ms")


# -- report ---------------------------------------------------------------------------------------


def _geomean(v):
    v = [x for x in v if x > 0]
    return float(torch.tensor(v, dtype=torch.float64).log().mean().exp()) if v else float("nan")


def blocks_markdown(block_rows):
    """The table of ``bench_blocks``'s rows, with its heading."""
    lines = ["## Sampled blocks: building the CSR and its transpose per block", "",
             "Median over minibatches of DGL's NeighborSampler; the first (largest) block of "
             "each minibatch. build A: CSR of the block in the kernels' index type and the "
             "degree vectors of a normalised SpMM; build A^T: the transpose for the "
             "backward; native: fused normalised SpMM; DGL first: GraphConv's sequence on a "
             "fresh copy of the block, its degree vectors included (its first call builds "
             "DGL's own formats).", "",
             "| graph | k | thr | block edges | build A ms | build A^T ms | native fwd ms | "
             "native bwd ms | build / fwd | build / (fwd+bwd) | native total ms | "
             "DGL first fwd+bwd ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in block_rows:
        lines.append(f"| {r['graph']} | {r['k']} | {r['threads']} | {r['block_edges']} | "
                     f"{r['build_a_ms']:.3f} | {r['build_at_ms']:.3f} | {r['nat_fwd_ms']:.3f} | "
                     f"{r['nat_bwd_ms']:.3f} | {r['build_over_fwd']:.2f} | "
                     f"{r['build_over_fwd_bwd']:.2f} | {r['native_total_ms']:.3f} | "
                     f"{r['dgl_total_ms']:.3f} |")
    return lines


def write_markdown(rows, block_rows, path, header):
    lines = [f"# Native SpMM kernels: median milliseconds per call\n", header, ""]
    # summary: geomean ratio to copy_u_sum per primitive x impl x mode x threads
    lines += ["## Summary: time / DGL copy_u_sum on the same graph, k, threads and mode "
              "(geometric mean over cells; target for spmm_weighted and spmm_norm native: <= 1.15)",
              "", "| primitive | impl | mode | threads | geomean | worst | cells <= 1.15 |",
              "|---|---|---|---:|---:|---:|---:|"]
    keys = sorted({(r["primitive"], r["impl"], r["mode"], r["threads"]) for r in rows},
                  key=lambda t: (list(PRIMS).index(t[0]), t[1], t[2], t[3]))
    for p, i, m, t in keys:
        v = [r["vs_copy_u_sum"] for r in rows
             if (r["primitive"], r["impl"], r["mode"], r["threads"]) == (p, i, m, t)]
        ok = sum(x <= 1.15 for x in v)
        lines.append(f"| {p} | {i} | {m} | {t} | {_geomean(v):.2f} | {max(v):.2f} | {ok}/{len(v)} |")
    lines += ["", "## Per k (geometric mean over graphs, both modes, both thread counts)", "",
              "| primitive | impl | " + " | ".join(f"k={k}" for k in KS) + " |",
              "|---|---|" + "---:|" * len(KS)]
    for p, impls in PRIMS.items():
        for i in impls:
            cells = []
            for k in KS:
                v = [r["vs_copy_u_sum"] for r in rows
                     if r["primitive"] == p and r["impl"] == i and r["k"] == k]
                cells.append(f"{_geomean(v):.2f}" if v else "-")
            lines.append(f"| {p} | {i} | " + " | ".join(cells) + " |")
    lines += ["", "## Every cell", "",
              "ratio: median / median of DGL's copy_u_sum in the same cell (min: ratio of the "
              "fastest rounds); GB/s: achieved bandwidth, % copy: of this machine's copy bandwidth "
              "at the same thread count.", "",
              "| graph | edges | k | thr | mode | primitive | dgl ms | torch ms | native ms | "
              "native / copy_u_sum | (min) | native GB/s | % copy | fastest |",
              "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    cells = {}
    for r in rows:
        cells.setdefault((r["graph"], r["edges"], r["k"], r["threads"], r["mode"], r["primitive"]),
                         {})[r["impl"]] = r
    for (gname, e, k, t, m, p), c in cells.items():
        nat = c["native"]
        tor = c.get("torch_csr") or c.get("torch")
        fastest = min(c.values(), key=lambda r: r["median_ms"])["impl"]
        lines.append(f"| {gname} | {e} | {k} | {t} | {m} | {p} | {c['dgl']['median_ms']:.3f} | "
                     f"{tor['median_ms']:.3f} | {nat['median_ms']:.3f} | "
                     f"{nat['vs_copy_u_sum']:.2f} | {nat['vs_copy_u_sum_min']:.2f} | "
                     f"{nat['gbps']:.1f} | {100 * nat['frac_copy_bw']:.0f} | {fastest} |")
    if block_rows:
        lines += [""] + blocks_markdown(block_rows)
    path.write_text("\n".join(lines) + "\n")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    series = [(p, i) for p, impls in PRIMS.items() for i in impls if (p, i) != ("spmm", "dgl")]
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for xi, (p, i) in enumerate(series):
            for t, marker in ((1, "o"), (2, "^")):
                v = [(r["vs_copy_u_sum"], r["k"]) for r in rows
                     if r["primitive"] == p and r["impl"] == i and r["mode"] == mode
                     and r["threads"] == t]
                if not v:
                    continue
                off = -0.15 if t == 1 else 0.15
                ax.scatter([xi + off] * len(v), [a for a, _ in v], c=[KS.index(k) for _, k in v],
                           cmap="viridis", vmin=0, vmax=len(KS) - 1, marker=marker, s=14,
                           alpha=0.8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(1.15, color="red", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(series)))
        ax.set_xticklabels([f"{p}\n{i}" for p, i in series], rotation=60, fontsize=7)
        ax.set_title(f"{mode}: time / DGL copy_u_sum (o 1 thread, ^ 2 threads; colour: k "
                     f"{KS[0]}..{KS[-1]})", fontsize=9)
    axes[0].set_ylabel("ratio (log); red: 1.15 target")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 graphs, k 32/128: a few minutes")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--budget", type=float, default=None, help="seconds of rounds per cell")
    ap.add_argument("--blocks-only", action="store_true",
                    help="only the sampled blocks (native_blocks.{csv,md}): a minute")
    args = ap.parse_args(argv)
    if not native.AVAILABLE:
        sys.exit(f"granii: native kernels are not built ({native.LOAD_ERROR})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    load0 = os.getloadavg()[0]
    threads_list = QUICK["threads"] if args.quick else [1, 2]
    names = QUICK["graphs"] if args.quick else REAL + list(GENERATED)
    ks = QUICK["ks"] if args.quick else KS
    budget = args.budget if args.budget is not None else 2.0
    copy_bw = {t: copy_bandwidth(t) for t in threads_list}
    progress(f"copy bandwidth: " + ", ".join(f"{t} thread(s) {b:.1f} GB/s"
                                             for t, b in copy_bw.items()))
    rows, block_rows = [], []
    for gi_, name in enumerate([] if args.blocks_only else names):
        g = GENERATED[name]() if name in GENERATED else load_graph(name)
        progress(f"[{gi_ + 1}/{len(names)}] {name}: {g.num_nodes()} nodes, {g.num_edges()} edges "
                 f"({time.time() - start:.0f} s so far)")
        bench_graph(name, g, ks, threads_list, PRIMS, copy_bw, rows, budget)
    progress("sampled blocks")
    for name in (["github-social"] if args.quick else ["github-social", "rmat-1M"]):
        g = GENERATED[name]() if name in GENERATED else load_graph(name)
        for t in threads_list:
            bench_blocks(g, name, [32, 128], t, 5 if args.quick else 10, block_rows)
    copy_end = copy_bandwidth(threads_list[-1])
    load1 = os.getloadavg()[0]
    elapsed = time.time() - start
    header = (f"torch {torch.__version__}, dgl {dgl.__version__}, {platform.machine()} "
              f"({platform.processor() or 'cpu'}), {os.cpu_count()} cores; "
              f"{'blocks-only' if args.blocks_only else 'quick' if args.quick else 'full'} run "
              f"of {elapsed / 60:.1f} minutes; "
              f"1-minute load average {load0:.2f} at start, {load1:.2f} at the end (above 2: other "
              f"work was running on this 2-core machine and the medians are inflated). Copy "
              f"bandwidth (torch copy of 512 MB, read + write): "
              + ", ".join(f"{t} thread(s) {b:.1f} GB/s" for t, b in copy_bw.items())
              + f" at the start, {copy_end:.1f} GB/s at the end. `python -m scripts.bench_native"
              f"{' --quick' if args.quick else ''}{' --blocks-only' if args.blocks_only else ''}`.")
    suffix = "_quick" if args.quick else ""
    write_csv(out / f"native_blocks{suffix}.csv", block_rows)
    if args.blocks_only:
        lines = ["# Native SpMM kernels: sampled blocks\n", header, ""] + blocks_markdown(block_rows)
        (out / f"native_blocks{suffix}.md").write_text("\n".join(lines) + "\n")
        progress(f"wrote {out}/native_blocks{suffix}.{{csv,md}} in {elapsed / 60:.1f} minutes")
        return
    write_csv(out / f"native{suffix}.csv", rows)
    write_markdown(rows, block_rows, out / f"native{suffix}.md", header)
    plot(rows, out / f"native{suffix}.png")
    progress(f"wrote {out}/native{suffix}.{{csv,md,png}} in {elapsed / 60:.1f} minutes")


if __name__ == "__main__":
    main()
