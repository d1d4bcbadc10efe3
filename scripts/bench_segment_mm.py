"""Typed products (RelGraphConv's ``W_r``, HGT's per-type linears): ``granii::segment_mm`` against
DGL's ``segment_mm`` and the weight gradient ``granii::segment_mm_wgrad`` against one GEMM per
relation.

    python -m scripts.bench_segment_mm [--threads 1 2] [--out results/kernels]

Rows sorted by relation as RGCN's compositions hold them: the distinct (source, relation) pairs of
the graphs generated with the published statistics of AIFB, MUTAG and BGS
(``granii.hetero_graphs``), at k_in = k_out in {16, 64} (and 256 on AIFB), plus a few long
segments of a wide weight (where one library GEMM per relation is at its best). The four
products run side by side (``granii.profiling.timing.side_by_side``: 3 warm-ups, then up to 15 rounds of
the four in turn; medians), at each thread count. ``typed`` is what ``typed.segment_gemm``
and ``typed.segment_weight_grad`` route to. Writes ``segment_mm.csv`` and ``segment_mm.md``.
"""
import argparse
import sys
from pathlib import Path

import dgl
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.csvfile import write_csv  # noqa: E402
from granii import hetero, hetero_graphs  # noqa: E402
from granii.kernels import typed  # noqa: E402
from granii.profiling.timing import side_by_side  # noqa: E402


def inputs():
    """``(name, seglen, k)``: pair rows per relation of the generated RGCN graphs, then long
    segments."""
    for name, ks in (("aifb", (16, 64, 256)), ("mutag", (16, 64)), ("bgs", (16, 64))):
        g, et = hetero_graphs.relational(hetero_graphs.generate(name))
        idx = hetero.relational_index(g, et, int(et.max()) + 1)
        seglen = idx.seglen["1"]
        for k in ks:
            yield f"{name} (src, rel) pairs", seglen, k
    for k in (128, 256):
        yield "8 segments of 12,500 rows", torch.full((8,), 12500, dtype=torch.long), k


def per_relation_wgrad(x, g, seglen):
    sizes = seglen.tolist()
    return torch.stack([a.t() @ b for a, b in zip(x.split(sizes), g.split(sizes))])


def measure(threads):
    torch.set_num_threads(threads)
    rows = []
    for name, seglen, k in inputs():
        n = int(seglen.sum())
        gen = torch.Generator().manual_seed(0)
        x, g = torch.randn(n, k, generator=gen), torch.randn(n, k, generator=gen)
        w = torch.randn(seglen.numel(), k, k, generator=gen)
        t = side_by_side({
            "dgl": lambda: dgl.ops.segment_mm(x, w, seglen),
            "native": lambda: torch.ops.granii.segment_mm(x, w, seglen),
            "loop_wgrad": lambda: per_relation_wgrad(x, g, seglen),
            "native_wgrad": lambda: torch.ops.granii.segment_mm_wgrad(x, g, seglen),
        }, warmup=3, repeat=15, budget=4.0)
        ms = {key: v[0] * 1e3 for key, v in t.items()}
        routed_native = typed.native_wgrad_routed(n, k, k, seglen.numel())
        row = dict(input=name, rows=n, relations=seglen.numel(), k=k, threads=threads,
                   dgl_ms=ms["dgl"], native_ms=ms["native"],
                   forward_speedup=ms["dgl"] / ms["native"],
                   loop_wgrad_ms=ms["loop_wgrad"], native_wgrad_ms=ms["native_wgrad"],
                   wgrad_speedup=ms["loop_wgrad"] / ms["native_wgrad"],
                   wgrad_routed="native" if routed_native else "loop",
                   wgrad_routed_fastest=(routed_native == (ms["native_wgrad"] <= ms["loop_wgrad"])))
        print(f"  {name:28s} k={k:3d} t={threads}: forward {row['forward_speedup']:.2f}x, "
              f"wgrad {row['wgrad_speedup']:.2f}x (routed {row['wgrad_routed']})", flush=True)
        rows.append(row)
    return rows


def write(rows, out):
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "segment_mm.csv", rows)
    lines = [
        "# Typed product: granii::segment_mm vs DGL's segment_mm",
        "",
        "`python -m scripts.bench_segment_mm` (medians of interleaved rounds, ms). Forward: "
        "`Y_r = X_r W_r` for every relation r; weight gradient: `dW_r = X_r^T dY_r`, against one "
        "torch GEMM per relation. `routed`: what `typed.segment_weight_grad` runs, and whether "
        "that was the faster one.",
        "",
        "| input | rows | relations | k | threads | DGL fwd | native fwd | speedup | "
        "GEMM per relation (wgrad) | native wgrad | speedup | routed | routed is faster |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['input']} | {r['rows']} | {r['relations']} | {r['k']} | {r['threads']} | "
            f"{r['dgl_ms']:.2f} | {r['native_ms']:.2f} | **{r['forward_speedup']:.2f}x** | "
            f"{r['loop_wgrad_ms']:.2f} | {r['native_wgrad_ms']:.2f} | "
            f"**{r['wgrad_speedup']:.2f}x** | {r['wgrad_routed']} | "
            f"{'yes' if r['wgrad_routed_fastest'] else 'no'} |")
    fw = [r["forward_speedup"] for r in rows]
    right = sum(r["wgrad_routed_fastest"] for r in rows)
    lines += ["", f"Forward speedup over DGL: {min(fw):.2f}x to {max(fw):.2f}x. The weight "
              f"gradient's routing picks the faster kernel in {right} of {len(rows)} cases.", ""]
    (out / "segment_mm.md").write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(ROOT / "results" / "kernels"))
    a = ap.parse_args(argv)
    rows = []
    for t in a.threads:
        rows += measure(t)
    write(rows, Path(a.out))


if __name__ == "__main__":
    main()
