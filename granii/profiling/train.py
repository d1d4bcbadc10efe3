"""Training: one XGBoost regressor per (primitive, implementation, phase) from a profiling run's
records: phase "forward" (one call without autograd) and "train" (forward and backward).

Target ``log(seconds)`` (``target_seconds``: the fastest of a point's rounds) with base margin ``log(baseline seconds)`` (``granii.learned``);
features ``granii.learned.model_features``, computed for the recorded graphs from their stored
graph features so training and prediction share one code path. Scores: the points are split by
graph (``GroupShuffleSplit``, a quarter of the graphs held out; for the dense primitives by ``m``
resp. ``n``) so validation graphs are unseen; a model is fit on the training part and scored on
the held-out part (MAPE of seconds, Spearman rank correlation), then refit on all points with the
same parameters; that model is saved, with its scores on all points as the training scores.
Everything is seeded: the same records give the same models.
"""
import datetime
import json
import math
import shutil
from pathlib import Path

import numpy as np

from granii.calibration import prediction_record
from granii.featurize import FEATURE_NAMES
from granii.learned import (BASELINE, FORMAT, MANIFEST, MODEL_SIZES, file_sha256, load,
                            model_feature_names, model_file, model_inputs, model_key,
                            parse_model_key)
from granii.fingerprint import fingerprint_id
from granii.graph import GraphInfo
from granii.profiling import generators as gen
from granii.profiling.harness import (GRAPHS, POINTS, _append, graph_record, graph_table,
                                      read_jsonl, unsettled)
from granii.profiling.points import DENSE

PARAMS = dict(n_estimators=160, max_depth=5, learning_rate=0.1, min_child_weight=2.0,
              subsample=0.85, colsample_bytree=0.85, reg_lambda=1.0, tree_method="hist",
              max_bin=128, random_state=0, n_jobs=1)
HOLDOUT = 0.25


class StoredGraph:
    """A profiled graph known by its recorded sizes and features: what ``featurize`` and the
    baseline read from a ``GraphInfo``."""

    def __init__(self, rec):
        self.num_src, self.num_dst, self.num_edges = rec["num_src"], rec["num_dst"], rec["num_edges"]
        self.is_block = rec.get("is_block", False)
        self.cache = {"graph_features": dict(rec["features"])}

    def memo(self, key, compute):
        if key not in self.cache:
            if key == "graph_features":
                raise KeyError(f"granii: a stored graph has no {key!r}; only its features")
            self.cache[key] = compute()          # what featurize derives from the features
        return self.cache[key]


def graph_views(run_dir, names, log=print):
    """``{name: StoredGraph}``; graphs recorded with another feature set are rebuilt and
    featurized again (and the new record appended)."""
    table = graph_table(run_dir)
    views = {}
    for name in names:
        rec = table.get(name)
        if rec is None or rec.get("feature_names") != list(FEATURE_NAMES):
            log(f"granii: recomputing the features of {name[:60]} (feature set changed)")
            g = gen.build(name)
            rec = graph_record(name, GraphInfo(g))
            _append(Path(run_dir) / GRAPHS, [rec])
        views[name] = StoredGraph(rec)
    return views


def ok_records(run_dir):
    """The measured points of a run (the last record of a (key, impl) wins)."""
    recs = {}
    for r in read_jsonl(Path(run_dir) / POINTS):
        if r.get("status") == "ok" and r.get("median") and r["median"] > 0:
            recs[(r["key"], r["impl"])] = r
    return list(recs.values())


def _group(r):
    if r["graph"] != DENSE:
        return r["graph"]
    s = r["sizes"]
    return f"m={s['m']}" if "m" in s else f"n={s['n']}"


def phase_of(r):
    return r.get("phase", "forward")


def usable(records, prim, impl, phase="forward", clean_only=True):
    """The points of one (primitive, implementation) to train on, and how many of them were
    measured while the machine was contended or whose rounds disagree (``harness.unsettled``):
    those are left out unless fewer than 8 points remain (a time taken while another process
    held a core can be 100 times the kernel's)."""
    rows = sorted((r for r in records if r["prim"] == prim and r["impl"] == impl
                   and phase_of(r) == phase),
                  key=lambda r: r["key"])
    clean = [r for r in rows if not unsettled(r)]
    if len(clean) >= 8 and clean_only:
        return clean, 0
    return rows, len(rows) - len(clean)


def target_seconds(r):
    """What a model learns from a record: its fastest round. A round is the kernel's time plus
    any wait for a core another process held (a descheduled thread of a parallel region waits a
    scheduler slice); waits only add, so the fastest round is closest to the kernel's own time,
    and it is biased alike at every point, which keeps the comparisons the models make."""
    samples = r.get("samples") or []
    return max(min(samples), 1e-9) if samples else r["median"]


def dataset(records, views, prim, impl, phase="forward", clean_only=True):
    """``(X, y, margin, groups)`` of one (primitive, implementation, phase): features, log
    seconds, log baseline seconds, and the group (graph) of each point (see ``usable``)."""
    rows, _ = usable(records, prim, impl, phase, clean_only)
    X, y, margin, groups = [], [], [], []
    for r in rows:
        gi = None if r["graph"] == DENSE else views[r["graph"]]
        x, m = model_inputs(prim, gi, dict(r["sizes"]), phase)
        X.append(x)
        margin.append(m)
        y.append(math.log(target_seconds(r)))
        groups.append(_group(r))
    return np.vstack(X), np.array(y), np.array(margin), np.array(groups)


def fit(X, y, margin, params=None):
    import xgboost as xgb
    model = xgb.XGBRegressor(**(params or PARAMS))
    model.fit(X, y, base_margin=margin, verbose=False)
    return model.get_booster()


def predict_log(booster, X, margin):
    return np.asarray(booster.inplace_predict(X, base_margin=margin), dtype=np.float64)


def scores(pred_log, true_log):
    """``{"mape", "spearman", "n"}`` of predicted vs measured seconds."""
    from scipy.stats import spearmanr
    pred, true = np.exp(pred_log), np.exp(true_log)
    out = {"n": int(len(true)), "mape": float(np.mean(np.abs(pred - true) / true))}
    rho = spearmanr(pred, true).statistic if len(true) > 2 else float("nan")
    out["spearman"] = None if not np.isfinite(rho) else float(rho)
    return out


def split(groups, seed=0):
    """Train and held-out indices, whole groups on one side; ``None`` with fewer than 2 groups."""
    from sklearn.model_selection import GroupShuffleSplit
    if len(set(groups)) < 2:
        return None
    gss = GroupShuffleSplit(n_splits=1, test_size=HOLDOUT, random_state=seed)
    return next(gss.split(np.zeros(len(groups)), groups=groups))


def train_one(X, y, margin, groups, params=None):
    """``(booster fit on all points, training scores, validation scores or None)``."""
    val = None
    parts = split(groups)
    if parts is not None:
        tr, te = parts
        b = fit(X[tr], y[tr], margin[tr], params)
        val = scores(predict_log(b, X[te], margin[te]), y[te])
        val["graphs"] = int(len(set(groups[te])))
    booster = fit(X, y, margin, params)
    return booster, scores(predict_log(booster, X, margin), y), val


def train(run_dir, out_dir, fingerprint, params=None, run_info=None, log=print, calibration=None,
          clean_only=True):
    """Train every (primitive, implementation, phase) with measured points in ``run_dir`` and
    write the models and ``manifest.json`` to ``out_dir`` (replaced as a whole at the end), with
    the machine's ``calibration`` (``granii.calibration.this_machine``) when given. Returns the
    manifest."""
    records = ok_records(run_dir)
    if not records:
        raise RuntimeError(f"granii: no measured points in {run_dir}: run the profiler first")
    names = sorted({r["graph"] for r in records if r["graph"] != DENSE})
    views = graph_views(run_dir, names, log)
    pairs = sorted({(r["prim"], r["impl"], phase_of(r)) for r in records
                    if r["prim"] in MODEL_SIZES})
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params = dict(params or PARAMS)
    models = {}
    for prim, impl, phase in pairs:
        X, y, margin, groups = dataset(records, views, prim, impl, phase, clean_only)
        booster, tr, val = train_one(X, y, margin, groups, params)
        fname = model_file(prim, impl, phase)
        booster.save_model(str(tmp / fname))
        key = model_key(prim, impl, phase)
        models[key] = {
            "file": fname, "sha256": file_sha256(tmp / fname),
            "features": model_feature_names(prim),
            "sizes": list(MODEL_SIZES[prim][1]), "baseline": BASELINE,
            "points": int(len(y)), "graphs": int(len(set(groups))),
            "phase": phase,
            "contended_points": usable(records, prim, impl, phase, clean_only)[1],
            "train": tr, "validation": val,
        }
        v = f"MAPE {val['mape']:.1%}, Spearman {val['spearman']:.3f}" if val and \
            val["spearman"] is not None else "no held-out graphs"
        log(f"  {key:<32} {len(y):>5} points  train MAPE {tr['mape']:.1%}  "
            f"held-out: {v}")
    manifest = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "fingerprint_id": fingerprint_id(fingerprint),
        "cpu_model": fingerprint["cpu_model"],
        "threads": fingerprint["threads"],
        "library_versions": {k: fingerprint[k] for k in ("torch", "dgl", "xgboost")},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": "log(seconds) = log(baseline seconds) + sum of trees(features)",
        "baseline": BASELINE,
        "params": params,
        "holdout": {"by": "graph (dense: m or n)", "fraction": HOLDOUT, "seed": 0},
        "contended_points": "trained on" if not clean_only else "left out where 8 clean remain",
        "training_points": int(sum(m["points"] for m in models.values())),
        "run": run_info or {},
        "calibration": calibration,
        "models": models,
    }
    _install(tmp, out_dir, manifest)
    return manifest


def add(part_dir, out_dir, run_info=None):
    """Put the models of ``part_dir`` (``train`` on the records of some primitives only) into
    the model folder ``out_dir``: they replace the models of those primitives, the others are
    kept. The manifest lists each addition under ``run["added"]``. Returns the manifest."""
    part_dir, out_dir = Path(part_dir), Path(out_dir)
    part = json.loads((part_dir / MANIFEST).read_text())
    manifest = json.loads((out_dir / MANIFEST).read_text())
    prims = sorted({parse_model_key(k)[0] for k in part["models"]})
    kept = {k: m for k, m in manifest["models"].items() if parse_model_key(k)[0] not in prims}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src, entries in ((out_dir, kept), (part_dir, part["models"])):
        for m in entries.values():
            shutil.copy2(src / m["file"], tmp / m["file"])
    manifest["models"] = dict(sorted({**kept, **part["models"]}.items()))
    manifest["training_points"] = int(sum(m["points"] for m in manifest["models"].values()))
    run = manifest.setdefault("run", {})
    run["added"] = [a for a in run.get("added", []) if not set(a["primitives"]) & set(prims)] + [{
        "primitives": prims, "created": part["created"],
        "points": int(sum(m["points"] for m in part["models"].values())), **(run_info or {})}]
    _install(tmp, out_dir, manifest)
    return manifest


def _install(tmp, out_dir, manifest):
    """Write ``manifest`` into the finished folder ``tmp`` and put it in place of ``out_dir``.
    The manifest keeps the models' predictions of the calibration's reference calls
    (``granii.calibration.prediction_record``), which a process transferring the folder to another
    machine would otherwise compute."""
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    predicted = prediction_record(load(tmp, check=False))
    manifest["calibration"] = dict(manifest.get("calibration") or {}, predicted=predicted)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
