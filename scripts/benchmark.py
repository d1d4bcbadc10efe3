"""The benchmark: granii against DGL on what users run, and the report.

    python -m scripts.benchmark [--quick] [--parts models,minibatch,layers] [--minutes 20]
                                [--models gcn,gat,...] [--graphs cora,...] [--out DIR]
                                [--no-fresh] [--no-ablations] [--no-passive] [--levels 0,1]
                                [--report-only]

The full run, as the committed results were made (about 20 minutes on 2 cores)::

    env -u OMP_WAIT_POLICY flock -x /tmp/granii-cpu.lock .venv/bin/python -m scripts.benchmark

Parts (see the modules of ``bench/`` for what each measures and how):

* ``models``     DGL's example models (GCN, GAT, GraphSAGE, GIN, SGC, TAGCN) with their dropout on
                 the real graphs: full-batch training epochs and inference on new features at
                 every call (``bench/fullbatch.py``) -> ``models.csv``;
* ``minibatch``  GraphSAGE, GCN and GAT trained with a neighbour sampler, per epoch of a 10-epoch
                 run (``bench/minibatch.py``) -> rows of ``models.csv``;
* ``layers``     single layers on new features each call and on the same features again
                 (``bench/single.py``) -> ``layers.csv``.

The environment is the user's: ``OMP_WAIT_POLICY`` is not set here (unset, the OpenMP runtime's
workers spin a while after each parallel region). ``--passive`` (on unless ``--no-passive``) runs
the first size level of the single layers again in a child process with
``OMP_WAIT_POLICY=PASSIVE`` -> ``passive/``, an extra row of the report.

Each configuration's first calls (DGL's first forward; ``granii(...)`` with its default cost model
plus its first forward) are also timed in a fresh process (``bench/fresh.py``), and the totals
use those: the benchmark's own process has loaded the cost models and run correctness checks, so
a first call timed there is a warm process's (kept as ``*_first_warm_ms``). ``--no-fresh`` skips
them (the rows then say ``first_call = warm process``).

Each configuration also runs a copy whose selection is restricted to DGL's and torch's kernels
(``bench/restrict.py``: the gain of joint selection) and, unless ``--no-ablations``, DGL with
granii's allocator and granii without it (``bench/ablation.py``). Single layers on new features
get a true lower bound (``bench/bounds.py``, from this machine's rates measured at the start);
the report refuses to be written when a measured time beats one. Then ``report.md`` +
``headline.png`` and ``machine.json`` in ``--out`` (default ``results/bench``).

``--quick``: Cora and CiteSeer, two sizes, short budgets: a few minutes. A full run fits in
``--minutes`` (20 by default): the parts run in the order above and the single layers, run last
level by level of sizes, stop when the time is spent (3 minutes are kept for the PASSIVE row).

The earlier suite (every promoted plan of a layer timed, PyG, overheads vs graph size, peak memory)
is still available as the parts ``sweep``, ``overhead``, ``memory`` and ``e2e``; it writes
``sweep.md`` beside the report.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
# OMP_WAIT_POLICY is left as the user's environment has it (unset: the OpenMP runtime's default,
# workers spin a while after each parallel region): the headline is what a user gets. The
# ``--passive`` row runs the single layers again in a child process with OMP_WAIT_POLICY=PASSIVE.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

with warnings.catch_warnings(record=True) as IMPORT_WARNINGS:     # what granii said at import
    warnings.simplefilter("always")
    from bench import (bounds, examples, fresh, fullbatch, inputs, minibatch, single,  # noqa: E402
                       summary)
    from bench.csvfile import write_csv  # noqa: E402
    from bench.restrict import WithoutNative  # noqa: E402

PARTS = ("models", "minibatch", "layers")
LEGACY = ("sweep", "overhead", "memory", "e2e")
# per-configuration round budgets (seconds): full run, quick run
BUDGET = {"train": (3.0, 0.4), "infer": (2.5, 0.4), "minibatch": (12.0, 2.0), "layers": (0.5, 0.2)}
MINIBATCH_GRAPHS = (("pubmed", "github-social"), ("cora",))
LAYER_GRAPHS = (("cora", "pubmed", "github-social"), ("cora",))


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def native_primitives():
    """The primitives that have a ``native`` implementation registered in this process."""
    from granii.kernels import REGISTRY
    return sorted(p for p, impls in REGISTRY.items() if "native" in impls)


def native_status():
    from granii.kernels import native
    have = native_primitives()
    said = [" ".join(str(w.message).split()) for w in IMPORT_WARNINGS
            if "native" in str(w.message).lower()]
    note = f" (at import: {'; '.join(said)})" if said else ""
    if not have:
        return "not available (restricted selection is then the same as granii's)" + note
    return ("available for " + ", ".join(have)
            + ("" if native.AVAILABLE else "; SpMM extension not loaded") + note)


def machine_info(cost_model, command):
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import dgl
    commit = _git("rev-parse", "--short", "HEAD")
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes in the working tree)"
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "omp": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "dgl": dgl.__version__},
            "commit": commit, "cost_model": getattr(cost_model, "name", type(cost_model).__name__),
            "native": native_status(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "load_start": round(os.getloadavg()[0], 2), "command": command}


# rough seconds per configuration on this machine under load, for the progress bar
WEIGHT = {"train": 18, "infer": 10, "minibatch": 40, "layers": {"cora": 4, "pubmed": 7}}


def plan(args):
    """``[(part, key, weight)]``: every configuration of the run, in order, with a rough cost
    (seconds) for the progress bar."""
    q = 1 if args.quick else 0
    scale = 0.25 if args.quick else 1.0
    graphs = [g for g in (args.graphs.split(",") if args.graphs else
                          (inputs.QUICK_GRAPHS if args.quick else inputs.FULL_GRAPHS))]
    todo = []
    if "models" in args.parts:
        for gname in graphs:
            for task in ("train", "infer"):
                for m in args.models:
                    if m in examples.FULL:
                        todo.append(("models", (m, gname, task), WEIGHT[task] * scale))
    if "minibatch" in args.parts:
        mb = ([g for g in graphs if g in MINIBATCH_GRAPHS[0]] if args.graphs
              else MINIBATCH_GRAPHS[q])
        for gname in mb:
            for m in examples.SAMPLED:
                if m in args.models:
                    todo.append(("minibatch", (m, gname), WEIGHT["minibatch"] * scale))
    if "layers" in args.parts:
        lg = [g for g in graphs if g in LAYER_GRAPHS[0]] if args.graphs else LAYER_GRAPHS[q]
        levels = getattr(args, "levels", None)
        for level, m, gname, ki, ko in single.configs(lg, args.quick,
                                                       [m for m in single.LAYERS
                                                        if m in args.models]):
            if levels is not None and level not in levels:
                continue
            w = WEIGHT["layers"].get(gname, 9) * (0.75 + max(ki, ko) / 512) * scale
            todo.append(("layers", (m, gname, ki, ko), w))
    return todo


def fresh_firsts(zygote, part, key):
    """First calls of DGL and granii for one configuration, each in a fresh process
    (``bench.fresh``): ``{candidate: s}`` (models, minibatch) or ``{(features, candidate): s}``
    (layers: those on new features stand for both rows, see ``README`` of the report)."""
    if zygote is None:
        return None
    if part == "models":
        m, gname, task = key
        return zygote.firsts(("dgl", "granii"), kind="model", model=m, graph=gname, task=task)
    if part == "minibatch":
        m, gname = key
        return zygote.firsts(("dgl", "granii"), kind="minibatch", model=m, graph=gname)
    m, gname, ki, ko = key
    got = zygote.firsts(("dgl", "granii"), kind="layer", model=m, graph=gname, k_in=ki, k_out=ko,
                        features="new")
    return {(f, c): v for f in ("new", "same") for c, v in got.items()}


def run(args, cost_model, out, log, rates=None):
    cms = {"granii": cost_model}
    if native_primitives():
        cms["restricted"] = WithoutNative(cost_model)
    todo = plan(args)
    # the PASSIVE row runs after the single layers: about 3 minutes of the budget are kept for it
    reserve = 45 + (180 if args.passive and "layers" in args.parts else 0)
    deadline = time.time() + 60 * args.minutes - reserve if args.minutes else None
    budget = {k: v[1 if args.quick else 0] for k, v in BUDGET.items()}
    loaded, model_rows, layer_rows = {}, [], []
    bar = tqdm(total=sum(w for *_, w in todo), unit="s", unit_scale=False, smoothing=0.1,
               bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}] {postfix}",
               mininterval=1.0, file=sys.stderr)
    skipped = 0
    zygote = fresh.Zygote() if args.fresh else None
    for i, (part, key, weight) in enumerate(todo):
        if deadline is not None and time.time() > deadline and part == "layers":
            skipped = len(todo) - i
            log(f"time budget spent: {skipped} single-layer configurations left out")
            break
        ends = (f", ends by {time.strftime('%H:%M', time.localtime(deadline + reserve))}"
                if deadline else "")
        bar.set_postfix_str(f"{part} {' '.join(map(str, key))}{ends}")
        gname = key[1]
        if gname not in loaded:
            loaded[gname] = inputs.load(gname)
        inp = loaded[gname]
        try:
            first = fresh_firsts(zygote, part, key)
            if part == "models":
                m, _, task = key
                row = fullbatch.measure(examples.FULL[m], inp, task, cms, budget=budget[task],
                                        fresh=first, ablations=args.ablations)
                model_rows.append(row)
                write_csv(out / "models.csv", model_rows)
                log(_line(row))
            elif part == "minibatch":
                spec, fanouts = examples.SAMPLED[key[0]]
                row = minibatch.measure(spec, fanouts, inp, cms, budget=budget["minibatch"],
                                        max_rounds=3 if args.quick else minibatch.RUN_EPOCHS - 1,
                                        fresh=first)
                model_rows.append(row)
                write_csv(out / "models.csv", model_rows)
                log(_line(row))
            else:
                m, _, ki, ko = key
                rows = single.measure(m, gname, inp.g, ki, ko, cms, budget=budget["layers"],
                                      max_rounds=args.calls - 1, fresh=first,
                                      ablations=args.ablations, rates=rates)
                layer_rows.extend(rows)
                write_csv(out / "layers.csv", layer_rows)
                log(_layer_line(rows))
        except Exception:                      # noqa: BLE001 - one configuration, the run goes on
            log(f"  {part} {key}: error\n{traceback.format_exc()}")
        bar.update(weight)
    bar.close()
    if zygote is not None:
        zygote.close()
    errors = fullbatch.ERRORS + minibatch.ERRORS + single.ERRORS
    if zygote is not None:
        errors += [(req, f"{err}\n{tb}") for req, err, tb in zygote.errors]
    if errors:
        (out / "errors.txt").write_text("\n".join(
            f"== {' '.join(str(v) for v in b.values() if isinstance(v, (str, int)))[:200]}\n{tb}"
            for b, tb in errors))
    return skipped


def _line(r):
    if r.get("status") != "ok":
        return f"  {r['task']:9} {r['model']:6} {r['graph']:14} {r['status']}"
    return (f"  {r['task']:9} {r['model']:6} {r['graph']:14} DGL {r.get('dgl_ms', 0):8.2f} ms  "
            f"granii {r.get('granii_ms', 0):8.2f} ms  -> {r.get('speedup', 0):5.2f}x "
            f"(joint gain {r.get('joint_gain', float('nan')):.2f}x)  check {r.get('check')}")


def _layer_line(rows):
    cells = []
    for r in rows:
        if r.get("status") != "ok":
            cells.append(f"{r['features']}: {r['status']}")
        else:
            cells.append(f"{r['features']} {r.get('speedup', 0):.2f}x")
    r = rows[0]
    return (f"  layer     {r['model']:6} {r['graph']:14} {r['k_in']}->{r['k_out']}: "
            + ", ".join(cells) + f"  check {r.get('check')}")


def legacy(parts, args, cost_model, out):
    """The earlier suite's parts (``sweep`` = its layer sweep), report in ``sweep.md``."""
    from bench import graphs, models, overhead, report, runs
    if "sweep" in parts:
        specs = graphs.suite(args.quick)
        runs.sweep(out / "runs.csv", list(models.DEFAULT_MODELS), specs, cost_model,
                   quick=args.quick, repeat=7 if args.quick else 15,
                   budget=0.25 if args.quick else 0.5)
    if "overhead" in parts:
        write_csv(out / "overhead.csv", overhead.sweep(cost_model, max_edges=1e5 if args.quick
                                                       else 1e7, runs=2 if args.quick else 3))
    if "e2e" in parts:
        from bench import e2e
        write_csv(out / "e2e.csv", [e2e.run(d, m, epochs=30 if args.quick else 200)
                                    for d in ("cora", "citeseer") for m in ("gcn", "gat")])
    if "memory" in parts:
        print("memory: run the earlier suite's memory part with an older checkout")
    if (out / "runs.csv").exists():
        report.write(out, name="sweep.md")


def passive_row(args, out):
    """The single layers of the first size level again, in a child process whose environment
    has ``OMP_WAIT_POLICY=PASSIVE`` (it must be set before torch loads), into ``out/passive``;
    the report sets them beside the same configurations of this run. Returns its exit code."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "scripts.benchmark", "--parts", "layers", "--levels", "0",
           "--out", str(out / "passive"), "--no-fresh", "--no-ablations", "--no-passive",
           "--models", ",".join(args.models), "--calls", str(args.calls),
           "--note", "OMP_WAIT_POLICY=PASSIVE row of the main run"]
    if args.quick:
        cmd.append("--quick")
    if args.graphs:
        cmd += ["--graphs", args.graphs]
    print("OMP_WAIT_POLICY=PASSIVE row: " + " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Cora and CiteSeer, short: a few minutes")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"from {', '.join(PARTS + LEGACY)}")
    ap.add_argument("--models", default="gcn,gat,sage,gin,sgc,tagcn")
    ap.add_argument("--graphs", default="", help="comma-separated (default: the suite's)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="time budget (default 20; none with --quick); single layers stop then")
    ap.add_argument("--calls", type=int, default=100,
                    help="calls per single-layer configuration at most (first included)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench"))
    ap.add_argument("--note", default="", help="a note for the report (e.g. the machine's load)")
    ap.add_argument("--report-only", action="store_true", help="only rebuild report.md")
    ap.add_argument("--no-fresh", dest="fresh", action="store_false",
                    help="time first calls in this process only (warm: not what a user's first "
                         "call costs; the totals then say so)")
    ap.add_argument("--no-ablations", dest="ablations", action="store_false",
                    help="skip the allocator ablation (dgl_pool, granii_nopool)")
    ap.add_argument("--no-passive", dest="passive", action="store_false",
                    help="skip the OMP_WAIT_POLICY=PASSIVE row (single layers of the first level "
                         "again, in a child process)")
    ap.add_argument("--levels", default="",
                    help="single layers: only these size levels (comma-separated, from 0)")
    args = ap.parse_args(argv)
    args.levels = [int(v) for v in args.levels.split(",") if v.strip()] or None
    args.parts = [p for p in args.parts.split(",") if p]
    args.models = [m for m in args.models.split(",") if m]
    if args.minutes is None:
        args.minutes = 0 if args.quick else 20
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m scripts.benchmark " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_only:
        h = summary.write(out)
        print(json.dumps(h, indent=1))
        return h
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")
    from granii.learned import default_cost_model
    cost_model = default_cost_model()
    started = time.time()
    info = machine_info(cost_model, command)
    if args.note:
        info["note"] = args.note
    print(f"granii benchmark: {info['cpu']}, {info['threads']} threads, cost model "
          f"{info['cost_model']}, native kernels {info['native']}; writing to {out}", flush=True)
    parts = [p for p in args.parts if p in PARTS]
    rates = None
    if "layers" in parts:
        rates = bounds.measure_rates()
        info["rates"] = {"gemm_macs": rates["gemm_macs"],
                         "bandwidth": {str(k): v for k, v in rates["bandwidth"].items()}}
        print(f"machine rates: GEMM {rates['gemm_macs'] / 1e9:.1f} G multiply-adds/s, streaming "
              f"{min(rates['bandwidth'].values()) / 1e9:.1f}-"
              f"{max(rates['bandwidth'].values()) / 1e9:.1f} GB/s", flush=True)
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    if parts:
        for name in ("models.csv", "layers.csv", "errors.txt"):
            (out / name).unlink(missing_ok=True)
        info["left_for_time"] = run(args, cost_model, out, lambda s: tqdm.write(s), rates)
    if rates is not None:           # again at the end: the best of both makes the bounds
        rates = bounds.best_of(rates, bounds.measure_rates())
        info["rates"] = {"gemm_macs": rates["gemm_macs"],
                         "bandwidth": {str(k): v for k, v in rates["bandwidth"].items()}}
    if "layers" in parts and args.passive:
        info["passive"] = passive_row(args, out)
    legacy_parts = [p for p in args.parts if p in LEGACY]
    if legacy_parts:
        legacy(legacy_parts, args, cost_model, out)
    info["load_end"] = round(os.getloadavg()[0], 2)
    info["duration_min"] = round((time.time() - started) / 60, 1)
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    try:
        h = summary.write(out, command)
    except AssertionError:
        print(f"the report was not written: a measured time beats a true bound (below). The "
              f"CSVs and machine.json in {out} are kept: find the harness bug, then "
              f"python -m scripts.benchmark --report-only --out {out}", file=sys.stderr)
        raise
    print(f"wrote {out / 'report.md'}")
    for k, v in h.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    return h


if __name__ == "__main__":
    main()
