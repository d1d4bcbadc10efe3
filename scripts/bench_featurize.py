"""Featurizer cost vs graph size on generated graphs (up to about 10 M edges), 2 threads.

For each graph: ``graph_info_ms`` is the one-off ``GraphInfo`` work the features need (destination
CSR and out-degrees, built from a fresh COO-only copy of the graph; median of ``--csr-runs``);
``features_ms`` the graph features from those structures (cache entry dropped before each run);
``cached_ms`` a second ``graph_features`` call (lookup); ``featurize_ms`` the full feature vector
with two embedding sizes once the graph features are cached. Medians of ``--runs`` runs.

Writes ``results/featurize/featurize_time.csv`` and ``featurize_time.md``.
Usage: ``python scripts/bench_featurize.py [--max-edges 1e7] [--runs 7]``.
"""
import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dgl  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from granii.featurize import featurize, graph_features  # noqa: E402
from granii.graph import GraphInfo  # noqa: E402
from granii.profiling import generators as gen  # noqa: E402

TARGETS = [1e4, 1e5, 1e6, 3e6, 1e7]


def graphs(max_edges):
    """``(family, name, factory)`` for R-MAT, uniform and road-like graphs near each target size."""
    for target in (t for t in TARGETS if t <= max_edges * 1.01):
        scale = int(round(np.log2(target / 16)))
        ef = int(np.ceil(1.05 * target / 2 ** (scale + 1)))
        yield "rmat", f"rmat(scale={scale}, ef={ef})", lambda s=scale, f=ef: gen.rmat(s, f, seed=1)
        n = int(target / 10)
        yield "uniform", f"uniform(n={n}, m={int(target)})", \
            lambda n=n, m=int(target): gen.uniform(n, m, seed=1)
        n = int(target / 2.8)
        yield "road", f"road_like(n={n})", lambda n=n: gen.road_like(n, seed=1)


def median_ms(fn, runs, setup=None):
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def bench_one(g, runs, csr_runs):
    u, v = g.edges()

    def build_info():
        fresh = dgl.graph((u, v), num_nodes=g.num_nodes())
        t = time.perf_counter()
        gi = GraphInfo(fresh)
        gi.csr_in()
        gi.out_degrees()
        return time.perf_counter() - t, gi, fresh

    info_times = []
    for _ in range(csr_runs):
        dt, gi, keep = build_info()
        info_times.append(dt)
    features_ms = median_ms(lambda: graph_features(gi), runs,
                            setup=lambda: gi.cache.pop("graph_features", None))
    cached_ms = median_ms(lambda: graph_features(gi), runs)
    sizes = {"k_in": 64, "k_out": 256}
    featurize_ms = median_ms(lambda: featurize(gi, sizes), runs)
    del keep
    return {
        "graph_info_ms": 1e3 * float(np.median(info_times)),
        "features_ms": features_ms,
        "cached_ms": cached_ms,
        "featurize_ms": featurize_ms,
    }


def to_markdown(df):
    cols = ["family", "graph", "nodes", "edges", "graph_info_ms", "features_ms", "cached_ms",
            "featurize_ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df[cols].iterrows():
        cells = [str(r["family"]), str(r["graph"]), f"{int(r['nodes']):,}", f"{int(r['edges']):,}"]
        cells += [f"{r[c]:.3f}" if r[c] < 1 else f"{r[c]:.1f}" for c in cols[4:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-edges", type=float, default=1e7)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--csr-runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "featurize"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    load_start = os.getloadavg()[0]
    rows = []
    for family, name, factory in graphs(args.max_edges):
        g = factory()
        row = {"family": family, "graph": name, "nodes": g.num_nodes(), "edges": g.num_edges()}
        row.update(bench_one(g, args.runs, args.csr_runs))
        rows.append(row)
        print(f"{name:32s} E={row['edges']:>10,}  graph_info {row['graph_info_ms']:8.1f} ms  "
              f"features {row['features_ms']:6.2f} ms  cached {row['cached_ms']:.4f} ms  "
              f"featurize {row['featurize_ms']:.4f} ms", flush=True)
        del g
    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "featurize_time.csv", index=False)
    header = (f"# Featurizer time ({torch.get_num_threads()} threads, median of {args.runs} runs; "
              f"graph_info: median of {args.csr_runs}; 1-minute load average "
              f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end on "
              f"{os.cpu_count()} cores)\n\n"
              "`graph_info_ms`: one-off GraphInfo work the features use (destination CSR and "
              "out-degrees) from a COO-only graph. `features_ms`: graph features from those. "
              "`cached_ms`: repeated call (cache lookup). `featurize_ms`: full vector with two "
              "embedding sizes, graph features cached.\n\n")
    (out / "featurize_time.md").write_text(header + to_markdown(df))
    print(f"wrote {out / 'featurize_time.csv'} and {out / 'featurize_time.md'}")


if __name__ == "__main__":
    main()
