"""Profiling a GPU: time the GPU path's kernels on generated graphs and fit its cost model.

    python -m granii.profiling.gpu --out DIR [--budget SECONDS]

Graphs, made on the device: ``N`` nodes and ``N d`` edges, uniform sources, destinations uniform
or skewed (``floor(N u^3)``, a hub of about ``N^(2/3) d`` in-edges, as the GPU check's graph),
for ``N`` in ``NODES`` and mean degree ``d`` in ``DEGREES``. On each, every (primitive,
implementation) of the GPU path (``granii.device.GPU_IMPLS``) is timed at the widths ``WIDTHS``
(heads and per-head widths ``HEADS`` for the edge scores and GAT), in the phases ``forward`` and
``train`` (``points.runners``: the backward of the gradients ``learned.TRAIN_GRADS`` names),
after a warm-up, as the median of ``REPEAT`` calls between CUDA events; the dense primitives on
the sizes ``GEMM``. Points are visited smallest first and stop at the budget.

Writes ``DIR/gpu_points.csv`` (one row per timing) and ``DIR/gpu_model.json``, the cost model
fitted to them (``granii.gpu_costmodel``), named by the GPU's description. A folder of such
models under ``costmodels/gpu/`` is what the GPU path loads (``granii.device.gpu_cost_model``).
"""
import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

NODES = (1 << 12, 1 << 15, 1 << 18, 1 << 20)
DEGREES = (4, 24)
WIDTHS = (16, 64, 256)
HEADS = ((1, 64), (8, 16))
GEMM = [(m, k, n) for m in (1 << 12, 1 << 16, 1 << 20) for k in (16, 128) for n in (16, 128)]
ROWS = [(n, k) for n in (1 << 12, 1 << 16, 1 << 20) for k in (16, 128)]
REPEAT = 5
GRAPH_PRIMS = ("spmm", "spmm_weighted", "spmm_mean", "spmm_norm", "sddmm_add", "edge_softmax",
               "gat_aggregate")


def make_graph(n, degree, skewed, device, seed=0):
    """``GraphInfo`` of an index graph on ``device`` (module docstring)."""
    from granii.graph import graph_info
    from granii.index_graph import IndexGraph
    gen = torch.Generator(device=device).manual_seed(seed)
    e = n * degree
    src = torch.randint(0, n, (e,), device=device, generator=gen)
    u = torch.rand(e, device=device, generator=gen)
    dst = ((n * u ** 3).long() if skewed else (n * u).long()).clamp_(max=n - 1)
    return graph_info(IndexGraph(src, dst, n))


def timed(fn, gpu, repeat=REPEAT, warmup=1):
    """Median seconds of ``fn()`` over ``repeat`` calls after ``warmup`` calls: CUDA events on a
    GPU, else the host clock."""
    for _ in range(warmup):
        fn()
    if gpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def gpu_impls(prim):
    from granii import kernels
    from granii.device import GPU_IMPLS
    return [i for i in kernels.implementations(prim) if i in GPU_IMPLS]


def _sizes(prim, widths, heads):
    if prim in ("sddmm_add", "edge_softmax"):
        return [{"heads": h} for h, _ in heads]
    if prim == "gat_aggregate":
        return [{"heads": h, "k": h * f} for h, f in heads]
    return [{"k": k} for k in widths]


def profile(device, out, budget=120.0, nodes=NODES, degrees=DEGREES, widths=WIDTHS,
            heads=HEADS, gemm=GEMM, rows_grid=ROWS, prims=GRAPH_PRIMS, log=print):
    """Time the points (module docstring; the grids are arguments) on ``device`` within
    ``budget`` seconds; write ``out/gpu_points.csv`` and ``out/gpu_model.json``. Returns the
    fitted coefficients."""
    from granii import device as dev_mod
    from granii.gpu_costmodel import fit, save
    from granii.profiling.points import runners
    dev_mod.gpu_unavailable(device)             # registers the Triton kernels
    gpu = device.type == "cuda"
    t0 = time.monotonic()
    rows = []

    def left():
        return budget - (time.monotonic() - t0)

    def measure(prim, gi, sizes, dims):
        for phase in ("forward", "train"):
            try:
                fns = runners(prim, gi, sizes, gpu_impls(prim), phase, device=device)
            except (KeyError, ValueError, RuntimeError) as ex:
                log(f"  {prim} {sizes}: no inputs ({ex})")
                return
            for impl, fn in fns.items():
                try:
                    sec = timed(fn, gpu)
                except Exception as ex:         # noqa: BLE001 (out of memory, unsupported)
                    log(f"  {prim}/{impl} {phase} {sizes}: {type(ex).__name__}")
                    continue
                n_src, n_dst, e = (0, 0, 0) if gi is None else (gi.num_src, gi.num_dst,
                                                                gi.num_edges)
                dmax = 0.0 if gi is None or not n_dst else float(gi.in_degrees().max())
                rows.append((prim, impl, phase, n_src, n_dst, e, dmax, dims, sec))

    for m, k, n in gemm:
        if left() > 0:
            measure("gemm", None, {"m": m, "k": k, "n": n}, {"m": m, "k": k, "n": n})
    for n, k in rows_grid:
        if left() > 0:
            measure("row_scale", None, {"n": n, "k": k}, {"n": n, "k": k})
    for n in nodes:
        for degree in degrees:
            for skewed in (False, True):
                if left() <= 0:
                    break
                gi = make_graph(n, degree, skewed, device)
                log(f"[{time.monotonic() - t0:5.0f} s] graph N={n} d={degree} "
                    f"{'skewed' if skewed else 'uniform'}: {gi.num_edges} edges")
                for prim in prims:
                    for sizes in _sizes(prim, widths, heads):
                        if left() > 0:
                            measure(prim, gi, sizes, sizes)
                del gi
                if gpu:
                    torch.cuda.empty_cache()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_points.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prim", "impl", "phase", "num_src", "num_dst", "num_edges", "max_in_degree",
                    "dims", "seconds"])
        for r in rows:
            w.writerow(list(r[:7]) + [json.dumps(r[7], sort_keys=True), f"{r[8]:.9f}"])
    coefs = fit(rows)
    save(out / "gpu_model.json", coefs, dev_mod.describe(device), len(rows))
    log(f"[{time.monotonic() - t0:5.0f} s] {len(rows)} timings, {len(coefs)} models -> {out}")
    return coefs


def read_points(path):
    """The rows of a ``gpu_points.csv`` as ``fit`` takes them."""
    with open(path) as f:
        return [(r["prim"], r["impl"], r["phase"], int(r["num_src"]), int(r["num_dst"]),
                 int(r["num_edges"]), float(r["max_in_degree"]), json.loads(r["dims"]),
                 float(r["seconds"])) for r in csv.DictReader(f)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, default=120.0, help="seconds of timing")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device")
    profile(torch.device(args.device), args.out, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
