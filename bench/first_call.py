"""The first call of a fresh process: ``granii(model, g, x); model(g, x)`` for one layer on Cora.

    python -m bench.first_call [--revs BEFORE AFTER] [--repeat 5] [--scenarios own shipped]

Each measurement is a process of its own (``python -c``), as a user's script runs: it imports
torch and DGL, loads Cora from ``data/`` and builds the layer (GraphConv, GATConv with one head,
SAGEConv mean, GINConv sum; 32 -> 32 features, seeded, eval mode, no gradients), then times

    import      ``from granii import granii``
    models      ``granii.learned.default_cost_model()``: reading this machine's cost models
    granii      ``granii(model, g, x)``: parsing the layer's forward, enumeration, deciding
                (the cost models' first predictions), the run on this input that decides
    call        the first ``model(g, x)`` after it

and DGL's own first ``model(g, x)`` in a process without granii (``dgl`` rows). A revision (``--revs``,
default ``HEAD``) is exported with ``git archive`` (its ``granii/`` and ``costmodels/``, the
native build and ``data/`` of this checkout beside it) and its processes run in that folder, so
two revisions are compared on the same machine, interleaved: for each repeat, every revision's
process of every layer in turn. One unmeasured process per revision and layer first fills the
caches a machine keeps after its first run (parsed cost models, the calibration, Python's byte
code, granii's store of enumerated plans and compiled code: ``granii/diskcache.py``), as later
processes find them.

Scenarios: ``own``: this machine has its own cost models (a shipped folder copied under this
machine's fingerprint, ``GRANII_COSTMODELS``); ``cold``: the same, with granii's store of plans
and code turned off (``GRANII_DISK_CACHE=0``): a layer configuration this machine never ran,
its plans enumerated and its code compiled in the process; ``shipped``: the checkout's
``costmodels/`` as is (on a machine without its own models the closest shipped folder, rescaled
by a calibration).

Writes ``results/first_call/first_call.csv`` (one row per process) and ``first_call.md``
(medians). Timings need a quiet machine: run it under ``flock -x /tmp/granii-cpu.lock``.
"""
import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "first_call"
LAYERS = ("gcn", "gat", "sage", "gin")
PHASES = ("import", "models", "granii", "call")

CHILD = r"""
import importlib.util, json, os, sys, time
t0 = time.perf_counter()
import torch, dgl
from dgl.nn import GATConv, GINConv, GraphConv, SAGEConv
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
t_torch = time.perf_counter() - t0
spec = importlib.util.spec_from_file_location("datasets_by_path", "granii/datasets.py")
ds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ds)             # the graph loader alone: no granii import yet
layer, mode = sys.argv[1], sys.argv[2]
g = ds.load_graph("cora")
k = 32
torch.manual_seed(0)
x = torch.randn(g.num_nodes(), k)
model = {"gcn": lambda: GraphConv(k, k, allow_zero_in_degree=True),
         "gat": lambda: GATConv(k, k, 1, allow_zero_in_degree=True),
         "sage": lambda: SAGEConv(k, k, "mean"),
         "gin": lambda: GINConv(torch.nn.Linear(k, k), "sum")}[layer]().eval()
out = {"torch_dgl_import": t_torch}
with torch.no_grad():
    if mode == "dgl":
        t0 = time.perf_counter()
        model(g, x)
        out["call"] = time.perf_counter() - t0
    else:
        import warnings
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        from granii import granii
        t1 = time.perf_counter()
        from granii import learned
        learned.default_cost_model()
        t2 = time.perf_counter()
        granii(model, g, x)
        t3 = time.perf_counter()
        model(g, x)
        t4 = time.perf_counter()
        out.update({"import": t1 - t0, "models": t2 - t1, "granii": t3 - t2, "call": t4 - t3})
print("RESULT " + json.dumps(out))
"""


def export(rev, dest):
    """``git archive`` of ``rev``'s ``granii/`` and ``costmodels/`` into ``dest``, with this
    checkout's native builds and ``data/`` (a link) beside them. Returns the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "granii", "costmodels"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    builds = ROOT / "granii" / "_native_builds"
    if builds.is_dir():
        shutil.copytree(builds, dest / "granii" / "_native_builds")
    for lib in (ROOT / "granii").glob("_native*.so"):
        shutil.copy2(lib, dest / "granii" / lib.name)
    (dest / "data").symlink_to(ROOT / "data")
    return commit


def own_models(tree, dest):
    """A copy of a shipped folder relabelled with this machine's fingerprint: a machine with its
    own models, whatever machine this is."""
    code = ("import json, shutil, sys, torch; from pathlib import Path;"
            "from granii.fingerprint import machine_fingerprint, fingerprint_id;"
            "torch.set_num_threads(2); fp = machine_fingerprint(); fid = fingerprint_id(fp);"
            "found = sorted(Path('costmodels').glob('*/manifest.json'));"
            "same = [p for p in found if json.loads(p.read_text())['fingerprint'].get('isa')"
            " == fp['isa']];"
            "src = (same or found)[-1].parent;"
            "dst = Path(sys.argv[1]) / fid; shutil.copytree(src, dst);"
            "m = json.loads((dst / 'manifest.json').read_text());"
            "m['fingerprint'] = dict(m['fingerprint'], **fp); m['fingerprint_id'] = fid;"
            "(dst / 'manifest.json').write_text(json.dumps(m)); print(src.name)")
    return subprocess.run([sys.executable, "-c", code, str(dest)], cwd=tree, check=True,
                          capture_output=True, text=True).stdout.strip()


def run_child(tree, layer, mode, env):
    proc = subprocess.run([sys.executable, "-c", CHILD, layer, mode], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{layer} {mode} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", nargs="+", default=["HEAD"])
    ap.add_argument("--repeat", type=int, default=5, help="processes per layer and revision")
    ap.add_argument("--scenarios", nargs="+", default=["own", "cold", "shipped"],
                    choices=["own", "cold", "shipped"])
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    ap.add_argument("--dgl", action=argparse.BooleanOptionalAction, default=True,
                    help="also time DGL's own first call (processes without granii)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="granii-first-call-") as tmp:
        tmp = Path(tmp)
        trees = {rev: tmp / f"tree{i}" for i, rev in enumerate(args.revs)}
        commits = {rev: export(rev, tree) for rev, tree in trees.items()}
        base = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
                    GRANII_CACHE=str(tmp / "cache"))
        base.pop("GRANII_COSTMODELS", None)
        # as an installed package: byte code written by the first process, read by the later
        base.pop("PYTHONDONTWRITEBYTECODE", None)
        for scenario in args.scenarios:
            envs = {}
            for rev, tree in trees.items():
                env = dict(base)
                if scenario == "cold":
                    env["GRANII_DISK_CACHE"] = "0"
                if scenario in ("own", "cold"):
                    folder = tmp / f"own-{commits[rev]}"
                    if not folder.exists():
                        src = own_models(tree, folder)
                        print(f"{commits[rev]} with {src} as this machine's models", flush=True)
                    env["GRANII_COSTMODELS"] = str(folder)
                envs[rev] = env
                for layer in args.layers:                             # fills the caches
                    run_child(tree, layer, "granii", env)
            for r in range(args.repeat):
                for layer in args.layers:
                    start = len(rows)
                    for rev, tree in trees.items():
                        t = run_child(tree, layer, "granii", envs[rev])
                        rows.append({"scenario": scenario, "rev": commits[rev], "layer": layer,
                                     "mode": "granii", "process": r, **t})
                    if args.dgl and scenario == args.scenarios[0]:
                        rev = args.revs[-1]
                        t = run_child(trees[rev], layer, "dgl", envs[rev])
                        rows.append({"scenario": "-", "rev": commits[rev], "layer": layer,
                                     "mode": "dgl", "process": r, **t})
                    print(f"{scenario} {r + 1}/{args.repeat} {layer}: " + ", ".join(
                        f"{row['mode']} {row['rev']} {1e3 * _total(row):.0f} ms"
                        for row in rows[start:]), flush=True)
    write(rows, args, commits)
    return 0


def _total(row):
    return sum(row.get(p, 0.0) for p in PHASES)


def write(rows, args, commits):
    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["scenario", "rev", "layer", "mode", "process", "torch_dgl_import", *PHASES, "total"]
    with open(args.out / "first_call.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: (round(v * 1e3, 2) if isinstance(v, float) else v)
                        for k, v in dict(row, total=_total(row)).items()})
    med = lambda xs: statistics.median(xs) * 1e3
    lines = ["# First call in a fresh process", "",
             f"`python -m bench.first_call --revs {' '.join(args.revs)} --repeat {args.repeat}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; revisions "
             f"{', '.join(commits.values())}). Milliseconds, median of {args.repeat} processes "
             "each (one process per measurement); Cora, 32 -> 32 features, inference. "
             "`import`: `from granii import granii`; `models`: loading this machine's cost "
             "models; `granii`: `granii(model, g, x)` (parse, enumerate, decide, the deciding "
             "run); `call`: the first `model(g, x)` after it; `total`: their sum (torch and DGL "
             "imported before). `dgl`: DGL's own first `model(g, x)` in a process without granii. "
             "`own`: this machine's own cost models; `cold`: the same with granii's store of "
             "enumerated plans and compiled code off (a layer configuration the machine never "
             "ran); `shipped`: the checkout's cost models as they are.",
             "", "| scenario | layer | revision | import | models | granii | call | total |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["scenario"], r["layer"], r["rev"], r["mode"]) for r in rows},
                  key=lambda k: (k[3] == "dgl", k[0], LAYERS.index(k[1]),
                                 list(commits.values()).index(k[2])))
    for scenario, layer, rev, mode in keys:
        sel = [r for r in rows if (r["scenario"], r["layer"], r["rev"], r["mode"]) ==
               (scenario, layer, rev, mode)]
        cells = [f"{med([r[p] for r in sel]):.1f}" if p in sel[0] else "" for p in PHASES]
        lines.append(f"| {scenario if mode == 'granii' else 'dgl'} | {layer} | {rev} | "
                     + " | ".join(cells) + f" | {med([_total(r) for r in sel]):.1f} |")
    (args.out / "first_call.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
