"""The benchmark suite: granii against DGL (and PyG) on this machine, and the report.

    python -m scripts.benchmark [--quick] [--models gcn,gin,...] [--graphs cora,...] [--out DIR]
                                [--parts layers,e2e,overhead,memory] [--fresh] [--report-only]

Parts (see the modules of ``bench/`` for what each measures and how):

* ``e2e``       2-layer GCN and GAT on Cora and CiteSeer, times and test accuracy -> ``e2e.csv``;
* ``overhead``  featurize/select/first-call time vs graph size up to 1e7 edges -> ``overhead.csv``;
* ``memory``    peak memory of DGL's layer and granii's (a process per model and sizes) ->
                ``memory.csv``;
* ``layers``    single layers, every model x graph x (k_in, k_out) x inference/training: DGL,
                granii (overheads included), PyG and every promoted plan -> ``runs.csv``. Run
                last, level by level of sizes, until the time of ``--minutes`` is spent.

Then ``report.md`` (+ PNG plots) and ``machine.json`` in ``--out`` (default ``results/bench``).
The layer sweep is resumable: configurations already in ``runs.csv`` are skipped (``--fresh``
deletes the CSVs first). ``--quick`` runs three small real graphs at sizes {32, 256} and shortened
other parts: a few minutes. A full run takes ``--minutes`` (45 by default) on 2 cores: the
fixed parts first (about 10 minutes), then as many levels of the layer sweep as fit;
``--parts layers --minutes N`` continues a sweep that stopped for time (``--minutes 0``: no limit).
"""
import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
# Threads that wait at an OpenMP barrier sleep instead of spinning: with spinning, another busy
# process on this 2-core machine makes 2-thread runs up to ~40x slower (a spinning thread holds
# the core its descheduled sibling needs). Set before torch and DGL load their OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import e2e, graphs, memory, models, overhead, report, runs  # noqa: E402

PARTS = ("layers", "e2e", "overhead", "memory")
OUTPUTS = ("runs.csv", "e2e.csv", "overhead.csv", "memory.csv", "report.md", "configs.csv",
           "errors.txt")


def machine_info(cost_model, command):
    """CPU, threads, library versions, commit and date of this run."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import dgl
    import numpy
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "dgl": dgl.__version__, "numpy": numpy.__version__,
                "torch_geometric": models.pyg_version() or f"not available ({models.PYG_ERROR})"}
    commit = _git("rev-parse", "--short", "HEAD")
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem,
            "threads": torch.get_num_threads(), "platform": platform.platform(),
            "omp": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
            "versions": versions, "commit": commit,
            "cost_model": getattr(cost_model, "name", type(cost_model).__name__),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_start": round(os.getloadavg()[0], 2),
            "command": command,
            "pyg": None if models.PYG_ERROR is None else f"skipped: {models.PYG_ERROR}"}


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def write_csv(path, rows):
    if not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def run_e2e(out, quick, log):
    rows = []
    epochs = 30 if quick else 200
    for dataset in ("cora",) if quick else ("cora", "citeseer"):
        for name in ("gcn", "gat"):
            r = e2e.run(dataset, name, epochs=epochs)
            rows.append(r)
            log(f"  e2e {name} {dataset}: epoch {r['train_ms_dgl']:.2f} ms DGL vs "
                f"{r['train_ms_granii']:.2f} ms granii; forward {r['forward_ms_dgl']:.2f} vs "
                f"{r['forward_ms_granii']:.2f} ms; test acc {r['test_acc_dgl']:.3f} vs "
                f"{r['test_acc_granii']:.3f}; {r['status']}")
    write_csv(out / "e2e.csv", rows)


def run_memory(out, quick, model_names, log):
    """Peak memory for each model at one increasing and one decreasing pair on one graph."""
    from granii.datasets import load_graph
    import dgl
    gname = "cora" if quick else "github-social"
    pairs = [(32, 256)] if quick else [(32, 512), (512, 32)]
    names = ["gcn"] if quick else [m for m in model_names if m != "gat4"]
    base = load_graph(gname)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for loops in (False, True):
            g = graphs.with_self_loops(base) if loops else base
            files[loops] = Path(tmp) / f"{gname}-{int(loops)}.bin"
            dgl.save_graphs(str(files[loops]), [g])
        for model in names:
            for k_in, k_out in pairs:
                got = memory.measure(files[models.MODELS[model].self_loops], model, k_in, k_out)
                for r in got:
                    rows.append(dict(model=model, graph=gname, k_in=k_in, k_out=k_out, **r))
                cells = [f"{r['mode'][:5]} {r['candidate']} "
                         + (f"{r['extra_mb']:.0f} MB" if r.get("status") == "ok" else r["status"])
                         for r in got]
                log(f"  memory {model} {k_in}->{k_out}: " + "; ".join(cells))
    write_csv(out / "memory.csv", rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small graphs and sizes: a few minutes")
    ap.add_argument("--models", default=",".join(models.DEFAULT_MODELS),
                    help=f"comma-separated, from {', '.join(models.MODELS)}")
    ap.add_argument("--graphs", default="", help="comma-separated graph names (default: suite)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"from {', '.join(PARTS)}")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench"))
    ap.add_argument("--fresh", action="store_true", help="delete previous results in --out first")
    ap.add_argument("--report-only", action="store_true", help="only rebuild report.md")
    ap.add_argument("--minutes", type=float, default=None,
                    help="time budget of the whole run; the layer sweep (run last) stops when it "
                         "is spent, between levels of sizes (default 45, none with --quick; 0: none)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="max rounds per configuration (default 15, 7 with --quick)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed rounds per configuration after the third round "
                         "(default 0.5, 0.25 with --quick)")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each layer configuration wait up to this many seconds for other "
                         "processes to use less than a third of a core")
    ap.add_argument("--no-pyg", action="store_true", help="leave out the PyG column")
    args = ap.parse_args(argv)
    if args.repeat is None:
        args.repeat = 7 if args.quick else 15
    if args.budget is None:
        args.budget = 0.25 if args.quick else 0.5
    command = "python -m scripts.benchmark " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        h = report.write(out)
        print(json.dumps(h, indent=1))
        return h

    torch.set_num_threads(2)
    warnings.simplefilter("ignore")
    from granii.learned import default_cost_model
    cost_model = default_cost_model()
    model_names = [m for m in args.models.split(",") if m]
    unknown = [m for m in model_names if m not in models.MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(models.MODELS)}")
    parts = [p for p in args.parts.split(",") if p]
    if args.fresh:
        for name in OUTPUTS:
            (out / name).unlink(missing_ok=True)
    started = time.time()
    info = machine_info(cost_model, command)
    print(f"granii benchmark: {info['cpu']}, {info['threads']} threads, cost model "
          f"{info['cost_model']}, PyG {info['versions']['torch_geometric']}; writing to {out}")
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    if "e2e" in parts:
        print("end to end (2-layer models, Planetoid):")
        run_e2e(out, args.quick, print)
    if "overhead" in parts:
        print("overhead vs graph size:")
        rows = overhead.sweep(cost_model, max_edges=1e5 if args.quick else 1e7,
                              runs=2 if args.quick else 3)
        write_csv(out / "overhead.csv", rows)
    if "memory" in parts:
        print("peak memory (one process per measurement):")
        run_memory(out, args.quick, model_names, print)
    if "layers" in parts:
        specs = graphs.suite(args.quick, [g for g in args.graphs.split(",") if g])
        minutes = args.minutes if args.minutes is not None else (0 if args.quick else 45)
        deadline = started + 60 * minutes - 60 if minutes else None
        print(f"layer sweep: {len(model_names)} models x {len(specs)} graphs x sizes x 2 modes"
              + (f", until {minutes} min after the start" if deadline else ""))
        n, left = runs.sweep(out / "runs.csv", model_names, specs, cost_model, quick=args.quick,
                             repeat=args.repeat, budget=args.budget, with_pyg=not args.no_pyg,
                             deadline=deadline, quiet_wait=args.quiet_wait)
        info["configs_left_for_time"] = left
        print(f"layer sweep: {n} configurations measured" + (f", {left} left" if left else ""))
    info["load_end"] = round(os.getloadavg()[0], 2)
    info["duration_min"] = round((time.time() - started) / 60, 1)
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    h = report.write(out, command)
    print(f"wrote {out / 'report.md'}")
    for k, v in h.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    return h


if __name__ == "__main__":
    main()
