"""Per-machine setup: profile every kernel implementation on this machine and train its cost models.

    bash scripts/init.sh [--quick]          (sets up the environment first)
    granii-init [--quick]                   (console command of an installed granii)
    python -m granii.profiling.init_machine [--quick] [--no-resume] [--threads 2] [--out costmodels]

Profiles (``granii.profiling.harness``) into ``<cache>/runs/<fingerprint id>/`` (``$GRANII_CACHE``,
default ``~/.cache/granii``), resuming an interrupted run by default, then trains one model per
(primitive, implementation) (``granii.profiling.train``) into ``<out>/<fingerprint id>/`` and
checks that the result loads. Each primitive is profiled in two
phases: the forward alone and the forward with its backward (the gradients a training step
needs). The machine's calibration (``granii.calibration``, a few seconds) is measured too and
stored in the manifest, so the models can be carried to other machines. ``--quick`` takes at
most 3 minutes, the full run about an hour; the full run reuses the points a quick run measured.
``--only PRIMITIVE ...`` profiles those primitives alone and puts their models into the machine's
existing folder in place of theirs (minutes, where a kernel of theirs was added or changed).
The manifest records how loaded the machine was (points measured while other processes held the
cores, load averages).
"""
import argparse
import os
import sys
import time
from pathlib import Path

from granii import calibration
from granii.cli import _positive
from granii.fingerprint import fingerprint_id, machine_fingerprint
from granii.learned import DEFAULT_DIR, MANIFEST, load
from granii.profiling.harness import POINTS, profile, read_jsonl
from granii.profiling.points import CONFIGS
from granii.profiling.timing import fix_threads
from granii.profiling.train import PARAMS, add, train


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="granii-init", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a few minutes: fewer graphs and sizes (models are coarser)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="continue a previous run's records (default); --no-resume starts over")
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR,
                    help="folder of the per-machine model folders (default: costmodels/)")
    ap.add_argument("--runs", type=Path, default=calibration.cache_dir() / "runs",
                    help="folder of the profiling records (default: runs/ in $GRANII_CACHE, "
                         "~/.cache/granii)")
    ap.add_argument("--threads", type=_positive, default=2, help="torch threads to profile with")
    ap.add_argument("--retry-contended", action="store_true",
                    help="measure again the points recorded while other processes held the cores")
    ap.add_argument("--keep-contended", action="store_true",
                    help="train on the points measured while the machine was contended too (their "
                         "fastest round), not only on the clean ones")
    ap.add_argument("--train-only", action="store_true",
                    help="skip profiling: train from the records already there")
    ap.add_argument("--graph-stride", type=int, default=1,
                    help="profile every N-th graph of the corpus only: a broad run over the "
                         "same range of sizes in about 1/N of the time (coarser models)")
    ap.add_argument("--only", nargs="+", metavar="PRIMITIVE", default=None,
                    help="profile these primitives alone (records in <runs>/<machine>/only/) and "
                         "put their models into this machine's model folder, keeping the "
                         "others: after a kernel of these primitives was added or changed")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop profiling after this many minutes and train on what is measured "
                         "(default: 1.65 with --quick, so that profiling, calibration and "
                         "training take at most 3 minutes; none otherwise)")
    return ap.parse_args(argv)


def load_note(run_dir):
    """How loaded the machine was while the records of ``run_dir`` were measured."""
    recs = [r for r in read_jsonl(run_dir / POINTS) if r.get("status") == "ok"]
    contended = sum(1 for r in recs if r.get("contended"))
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"ok_records": len(recs), "contended_records": contended,
            "contended_share": round(contended / len(recs), 3) if recs else None,
            "loadavg_at_end": load,
            "note": ("measured while other processes used the cores: contended points were "
                     "measured again once after waiting, the rest left out of training where "
                     "enough clean points remained") if contended else "measured on a quiet machine"}


def main(argv=None):
    args = parse_args(argv)
    threads = fix_threads(args.threads)
    fp = machine_fingerprint(threads)
    fid = fingerprint_id(fp)
    run_dir = args.runs / fid
    config = CONFIGS["quick" if args.quick else "full"]()
    if args.graph_stride > 1:
        config.graphs = config.graphs[::args.graph_stride]
    out = args.out / fid
    if args.only:
        unknown = sorted(set(args.only) - set(config.prims))
        if unknown:
            raise SystemExit(f"granii-init: --only: no profiled primitive {', '.join(unknown)}; "
                             f"the {config.name} run profiles {', '.join(config.prims)}")
        if not (out / MANIFEST).is_file():
            raise SystemExit(f"granii-init: --only adds models to this machine's folder {out}, "
                             "which has none yet: run granii-init without --only first")
        config.prims = [p for p in config.prims if p in args.only]
        run_dir = run_dir / "only"
    print(f"granii: machine {fid}: {fp['cpu_model']}, {fp['cores']} cores, {threads} threads, "
          f"torch {fp['torch']}, dgl {fp['dgl']}, xgboost {fp['xgboost']}")
    t0 = time.perf_counter()
    summary = None
    if args.train_only and not (run_dir / POINTS).is_file():
        raise SystemExit(f"granii-init: --train-only trains on this machine's profiling records "
                         f"in {run_dir}, and there are none: run granii-init without "
                         "--train-only first")
    limit = args.time_limit if args.time_limit is not None else (1.65 if args.quick else None)
    if not args.train_only:
        summary = profile(config, run_dir, threads, resume=args.resume,
                          progress=not args.no_progress, retry_contended=args.retry_contended,
                          time_limit=None if limit is None else 60 * limit)
    cal = calibration.this_machine(fp, refresh=not (args.train_only or args.only))
    print(f"granii: calibration ({cal['seconds']:.1f} s): " + ", ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in cal["times"].items()))
    print("granii: training the cost models (log seconds, one XGBoost model per "
          "primitive/implementation):")
    run_info = {"mode": config.name, "profile_seconds": round(summary["seconds"], 1)
                if summary else None, "counts": summary["counts"] if summary else None,
                "stopped_early": summary.get("stopped_early") if summary else None,
                "load": load_note(run_dir)}
    manifest = train(run_dir, run_dir / "models" if args.only else out, fp, run_info=run_info,
                     params=dict(PARAMS, n_estimators=config.trees),
                     clean_only=not args.keep_contended,
                     calibration={k: cal[k] for k in ("times", "seconds", "measured_at")})
    if args.only:
        manifest = add(run_dir / "models", out, run_info)
    load(out, fp)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"granii: {len(manifest['models'])} models from {manifest['training_points']} points "
          f"installed in {out} ({size / 1e6:.1f} MB) in {(time.perf_counter() - t0) / 60:.1f} min; "
          "granii(...) now uses them on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
