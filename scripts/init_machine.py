"""Per-machine setup: profile every kernel implementation on this machine and train its cost models.

    bash scripts/init.sh [--quick]          (sets up the environment first)
    granii-init [--quick]                   (console command of an installed granii)
    python -m scripts.init_machine [--quick] [--no-resume] [--threads 2] [--out costmodels]

Profiles (``profiler.harness``) into ``profiler/runs/<fingerprint id>/``, resuming an interrupted
run by default, then trains one model per (primitive, implementation) (``profiler.train``) into
``<out>/<fingerprint id>/`` and checks that the result loads. ``--quick`` takes a few minutes,
the full run about 30-60 minutes; the full run reuses the points a quick run measured.
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from granii.fingerprint import fingerprint_id, machine_fingerprint  # noqa: E402
from granii.learned import DEFAULT_DIR, load  # noqa: E402
from profiler.harness import profile  # noqa: E402
from profiler.points import CONFIGS  # noqa: E402
from profiler.timing import fix_threads  # noqa: E402
from profiler.train import train  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="granii-init", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a few minutes: fewer graphs and sizes (models are coarser)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="continue a previous run's records (default); --no-resume starts over")
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR,
                    help="folder of the per-machine model folders (default: costmodels/)")
    ap.add_argument("--runs", type=Path, default=ROOT / "profiler" / "runs",
                    help="folder of the profiling records (default: profiler/runs/)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads to profile with")
    ap.add_argument("--retry-contended", action="store_true",
                    help="measure again the points recorded while other processes held the cores")
    ap.add_argument("--train-only", action="store_true",
                    help="skip profiling: train from the records already there")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    threads = fix_threads(args.threads)
    fp = machine_fingerprint(threads)
    fid = fingerprint_id(fp)
    run_dir = args.runs / fid
    config = CONFIGS["quick" if args.quick else "full"]()
    print(f"granii: machine {fid}: {fp['cpu_model']}, {fp['cores']} cores, {threads} threads, "
          f"torch {fp['torch']}, dgl {fp['dgl']}, xgboost {fp['xgboost']}")
    t0 = time.perf_counter()
    summary = None
    if not args.train_only:
        summary = profile(config, run_dir, threads, resume=args.resume,
                          progress=not args.no_progress, retry_contended=args.retry_contended)
    print("granii: training the cost models (log seconds, one XGBoost model per "
          "primitive/implementation):")
    run_info = {"mode": config.name, "profile_seconds": round(summary["seconds"], 1)
                if summary else None, "counts": summary["counts"] if summary else None}
    out = args.out / fid
    manifest = train(run_dir, out, fp, run_info=run_info)
    load(out, fp)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"granii: {len(manifest['models'])} models from {manifest['training_points']} points "
          f"installed in {out} ({size / 1e6:.1f} MB) in {(time.perf_counter() - t0) / 60:.1f} min; "
          "granii(...) now uses them on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
