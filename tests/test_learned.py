"""Learned cost models: loading checks, fallback, determinism, agreement with XGBoost.

Models are trained on synthetic records (times from a formula, no measurements), so these tests
are fast and do not depend on the machine's load.
"""
import json
import math
import shutil
import warnings

import numpy as np
import pytest
import torch

from granii import learned
from granii.costmodel import AnalyticalCost
from granii.fingerprint import differences, fingerprint_id, machine_fingerprint
from granii.graph import GraphInfo
from granii.learned import CostModelError, LearnedCost, Trees, load, model_inputs
from profiler import generators as gen
from profiler.harness import GRAPHS, POINTS, _append, graph_record
from profiler.points import point_key
from profiler.train import train

GRAPH_NAMES = ["uniform:n=300,m=2400,seed=1,undirected=0", "grid2d:rows=12,cols=15",
               "rmat:scale=8,edge_factor=8,a=0.57,b=0.19,c=0.19,seed=2,undirected=1",
               "community:n=400,blocks=4,degree=8.0,mix=0.8,seed=3,permute=0"]
SPEED = {"dgl": 1.0, "torch_csr": 1.7, "torch": 1.2}


def _fake_seconds(prim, impl, gi, sizes):
    """A smooth made-up time: the baseline times an implementation factor and a size effect."""
    dims = dict(sizes)
    if prim.startswith("spmm"):
        dims["n"] = gi.num_dst
    base = learned.baseline_seconds(prim, dims, gi.num_src, gi.num_dst, gi.num_edges) \
        if gi is not None else learned.baseline_seconds(prim, dims)
    return base * SPEED[impl] * (1 + 0.1 * math.log2(sizes.get("k", 2)))


def write_synthetic_run(run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in GRAPH_NAMES:
        g = gen.build(name)
        gi = GraphInfo(g)
        _append(run_dir / GRAPHS, [graph_record(name, gi)])
        for prim, impls in (("spmm", ("dgl", "torch_csr")), ("sddmm_scale", ("dgl", "torch"))):
            for sizes in ([{"k": k} for k in (16, 32, 64, 128)] if prim == "spmm" else [{}]):
                for impl in impls:
                    rows.append({"key": point_key(prim, name, sizes), "prim": prim, "impl": impl,
                                 "graph": name, "sizes": sizes, "num_src": gi.num_src,
                                 "num_dst": gi.num_dst, "num_edges": gi.num_edges,
                                 "status": "ok", "median": _fake_seconds(prim, impl, gi, sizes)})
    for m in (64, 256, 1024, 4096):
        for k in (16, 64, 256):
            for n in (16, 64, 256):
                sizes = {"m": m, "k": k, "n": n}
                rows.append({"key": point_key("gemm", "dense", sizes), "prim": "gemm",
                             "impl": "torch", "graph": "dense", "sizes": sizes, "num_src": 0,
                             "num_dst": 0, "num_edges": 0, "status": "ok",
                             "median": _fake_seconds("gemm", "torch", None, sizes)})
    _append(run_dir / POINTS, rows)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("learned")
    write_synthetic_run(base / "run")
    out = base / "models" / fingerprint_id(machine_fingerprint())
    train(base / "run", out, machine_fingerprint(), log=lambda *a: None)
    return out


@pytest.fixture
def copy_dir(model_dir, tmp_path):
    dst = tmp_path / model_dir.name
    shutil.copytree(model_dir, dst)
    return dst


_KEEP = []


def _info():
    """A fresh ``GraphInfo`` of the same test graph (kept alive: it holds a weak reference)."""
    g = gen.build("uniform:n=500,m=4000,seed=7,undirected=0")
    _KEEP.append(g)
    return GraphInfo(g)


def test_loads_and_predicts(model_dir):
    lc = load(model_dir)
    assert isinstance(lc, LearnedCost)
    assert {("spmm", "dgl"), ("spmm", "torch_csr"), ("sddmm_scale", "dgl"),
            ("gemm", "torch")} <= set(lc.trees)
    gi = _info()
    for prim, impl, dims in [("spmm", "dgl", {"n": gi.num_dst, "k": 64}),
                             ("sddmm_scale", "torch", {}), ("gemm", "torch",
                                                            {"m": 500, "k": 64, "n": 32})]:
        t = lc.predict(prim, impl, gi, dims)
        assert math.isfinite(t) and t > 0


def test_learns_the_implementation_ratio(model_dir):
    lc = load(model_dir)
    gi = _info()
    dims = {"n": gi.num_dst, "k": 64}
    assert lc.predict("spmm", "dgl", gi, dims) < lc.predict("spmm", "torch_csr", gi, dims)


def test_larger_than_trained_sizes_still_grow(model_dir):
    """The baseline margin carries the scaling beyond the profiled sizes (trees alone saturate)."""
    lc = load(model_dir)
    gi = _info()
    small = lc.predict("spmm", "dgl", gi, {"n": gi.num_dst, "k": 128})
    big = lc.predict("spmm", "dgl", gi, {"n": gi.num_dst, "k": 4096})
    assert big > 10 * small


def test_prediction_is_deterministic(model_dir):
    gi1, gi2 = _info(), _info()
    a, b = load(model_dir), load(model_dir)
    dims = {"n": gi1.num_dst, "k": 48}
    first = a.predict("spmm", "torch_csr", gi1, dims)
    assert a.predict("spmm", "torch_csr", gi1, dims) == first        # cached
    assert a.predict("spmm", "torch_csr", gi2, dims) == first        # fresh features
    assert b.predict("spmm", "torch_csr", gi1, dims) == first        # second load
    g = {"m": 777, "k": 100, "n": 30}
    assert a.predict("gemm", "torch", gi1, g) == b.predict("gemm", "torch", gi2, g)


def test_numpy_trees_match_xgboost(model_dir):
    import xgboost as xgb
    booster = xgb.Booster()
    booster.load_model(str(model_dir / "spmm__dgl.json"))
    trees = Trees(json.loads((model_dir / "spmm__dgl.json").read_text()))
    gi = _info()
    rows = [model_inputs("spmm", gi, {"n": gi.num_dst, "k": k}) for k in (8, 16, 40, 100, 3000)]
    X = np.vstack([r[0] for r in rows])
    margin = np.array([r[1] for r in rows])
    rng = np.random.default_rng(0)
    X = np.vstack([X, X * np.exp(rng.normal(0, 1, X.shape))])
    margin = np.concatenate([margin, margin])
    np.testing.assert_allclose(trees.predict(X, margin),
                               booster.inplace_predict(X, base_margin=margin), rtol=0, atol=1e-4)


def test_unmodelled_primitive_falls_back_to_analytical(model_dir):
    lc = load(model_dir)
    gi = _info()
    dims = {"n": gi.num_dst, "k": 16}
    assert lc.predict("spmm_max", "dgl", gi, dims) == AnalyticalCost().predict(
        "spmm_max", "dgl", gi, dims)
    assert lc.predict("diag_mul", "torch", gi, {"n": 5}) > 0


def test_foreign_fingerprint_is_refused(copy_dir):
    manifest = json.loads((copy_dir / "manifest.json").read_text())
    manifest["fingerprint"]["threads"] = manifest["fingerprint"]["threads"] + 6
    (copy_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CostModelError) as err:
        load(copy_dir)
    msg = str(err.value)
    assert "another machine" in msg and "threads" in msg
    assert "scripts/init.sh" in msg and "granii-init" in msg


def test_other_cpu_is_refused(model_dir):
    other = dict(machine_fingerprint(), cpu_model="Some Other CPU")
    assert differences(other, machine_fingerprint())
    with pytest.raises(CostModelError, match="cpu_model"):
        load(model_dir, fingerprint=other)


def test_corrupt_model_file_is_refused(copy_dir):
    bad = copy_dir / "spmm__dgl.json"
    bad.write_text(bad.read_text()[:500])
    with pytest.raises(CostModelError) as err:
        load(copy_dir)
    assert str(bad) in str(err.value) and "re-run" in str(err.value)


def test_missing_model_file_is_refused(copy_dir):
    (copy_dir / "gemm__torch.json").unlink()
    with pytest.raises(CostModelError, match="gemm__torch.json"):
        load(copy_dir)


def test_feature_set_mismatch_is_refused(copy_dir):
    manifest = json.loads((copy_dir / "manifest.json").read_text())
    manifest["models"]["spmm/dgl"]["features"] = manifest["models"]["spmm/dgl"]["features"][:-1]
    (copy_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CostModelError, match="another feature set"):
        load(copy_dir)


def test_missing_or_broken_manifest_is_refused(copy_dir, tmp_path):
    with pytest.raises(CostModelError, match="no cost-model folder"):
        load(tmp_path / "nothing")
    (copy_dir / "manifest.json").write_text("{not json")
    with pytest.raises(CostModelError, match="not readable JSON"):
        load(copy_dir)
    (copy_dir / "manifest.json").unlink()
    with pytest.raises(CostModelError, match="manifest.json"):
        load(copy_dir)


def test_default_cost_model_warns_once_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(learned, "_WARNED", set())
    monkeypatch.setattr(learned, "_LOADED", {})
    with pytest.warns(learned.CostModelWarning, match="scripts/init.sh"):
        model = learned.default_cost_model(tmp_path)
    assert isinstance(model, AnalyticalCost)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(learned.default_cost_model(tmp_path), AnalyticalCost)


def test_default_cost_model_loads_this_machines_models(model_dir, monkeypatch):
    monkeypatch.setattr(learned, "_WARNED", set())
    monkeypatch.setattr(learned, "_LOADED", {})
    model = learned.default_cost_model(model_dir.parent)
    assert isinstance(model, LearnedCost)
    assert learned.default_cost_model(model_dir.parent) is model


def test_default_cost_model_refuses_a_damaged_folder_with_a_warning(copy_dir, monkeypatch):
    monkeypatch.setattr(learned, "_WARNED", set())
    monkeypatch.setattr(learned, "_LOADED", {})
    (copy_dir / "spmm__dgl.json").write_text("garbage")
    with pytest.warns(learned.CostModelWarning, match="spmm__dgl.json"):
        assert isinstance(learned.default_cost_model(copy_dir.parent), AnalyticalCost)


def test_fingerprint_is_stable_and_thread_specific():
    a, b = machine_fingerprint(2), machine_fingerprint(2)
    assert fingerprint_id(a) == fingerprint_id(b) and len(fingerprint_id(a)) == 12
    assert fingerprint_id(machine_fingerprint(8)) != fingerprint_id(a)
    assert a["cpu_model"] and a["cores"] >= 1


def test_selection_ranks_graphconv_plans_with_learned_models(model_dir):
    """The plans of a real layer price through the learned models (dims conventions agree)."""
    import inspect

    from dgl.nn import GraphConv

    from granii.dispatch import new_state, prepare
    from granii.select import rank
    lc = load(model_dir)
    g = gen.build("uniform:n=500,m=4000,seed=7,undirected=0")
    layer = GraphConv(32, 16, norm="both", allow_zero_in_degree=True)
    state = new_state(layer, "conv")
    with torch.no_grad():
        call = prepare(state, layer, (g, torch.randn(g.num_nodes(), 32)), {})
    ranking = rank(call.compiled.plans, call.gi, call.symbols, lc)
    assert ranking and all(math.isfinite(c.cost) and c.cost > 0 for c in ranking)
