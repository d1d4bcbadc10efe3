"""Learned cost models: loading checks, fallback, determinism, agreement with XGBoost.

Models are trained on synthetic records (times from a formula, no measurements), so these tests
are fast and do not depend on the machine's load.
"""
import json
import math
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from granii import learned
from granii.costmodel import AnalyticalCost
from granii.fingerprint import differences, fingerprint_id, machine_fingerprint
from granii.graph import GraphInfo
from granii.learned import MANIFEST, CostModelError, LearnedCost, Trees, load, model_inputs
from granii.profiling import generators as gen
from granii.profiling.harness import GRAPHS, POINTS, _append, graph_record
from granii.profiling.points import point_key
from granii.profiling.train import train

GRAPH_NAMES = ["uniform:n=300,m=2400,seed=1,undirected=0", "grid2d:rows=12,cols=15",
               "rmat:scale=8,edge_factor=8,a=0.57,b=0.19,c=0.19,seed=2,undirected=1",
               "community:n=400,blocks=4,degree=8.0,mix=0.8,seed=3,permute=0"]
SPEED = {"dgl": 1.0, "torch_csr": 1.7, "torch": 1.2, "native": 0.6}
BACKWARD = {"dgl": 3.0, "torch_csr": 2.0, "native": 1.5}    # train / forward in the fake times


def _fake_seconds(prim, impl, gi, sizes, phase="forward"):
    """A smooth made-up time: the baseline times an implementation factor and a size effect
    (a training call: times ``BACKWARD[impl]``)."""
    dims = dict(sizes)
    if prim.startswith("spmm"):
        dims["n"] = gi.num_dst
    base = learned.baseline_seconds(prim, dims, gi.num_src, gi.num_dst, gi.num_edges) \
        if gi is not None else learned.baseline_seconds(prim, dims)
    t = base * SPEED[impl] * (1 + 0.1 * math.log2(sizes.get("k", 2)))
    return t * BACKWARD.get(impl, 2.0) if phase == "train" else t


GRAPH_POINTS = [
    ("spmm", ("dgl", "torch_csr"), [{"k": k} for k in (16, 32, 64, 128)], ("forward", "train")),
    ("sddmm_scale", ("dgl", "torch"), [{}], ("forward",)),
    ("spmm_norm", ("native", "dgl"), [{"k": k} for k in (16, 64, 256)], ("forward", "train")),
    ("gat_aggregate", ("native", "dgl"), [{"heads": h, "k": h * f} for h in (1, 4)
                                          for f in (8, 32)], ("forward",)),
]


def write_synthetic_run(run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in GRAPH_NAMES:
        g = gen.build(name)
        gi = GraphInfo(g)
        _append(run_dir / GRAPHS, [graph_record(name, gi)])
        for prim, impls, series, phases in GRAPH_POINTS:
            for sizes in series:
                for impl in impls:
                    for phase in phases:
                        rows.append({"key": point_key(prim, name, sizes, phase), "prim": prim,
                                     "impl": impl, "phase": phase, "graph": name, "sizes": sizes,
                                     "num_src": gi.num_src, "num_dst": gi.num_dst,
                                     "num_edges": gi.num_edges, "status": "ok",
                                     "median": _fake_seconds(prim, impl, gi, sizes, phase)})
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


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    """Each test parses and caches models under a cache of its own (a model cached by another
    test, or by the user's runs, is not read from its file at load)."""
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "granii-cache"))


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


def test_model_files_are_checked_and_parsed_on_first_use(copy_dir):
    """The manifest keeps each file's SHA-256: a file is checked against it and parsed when a
    prediction first needs its model (a damaged one is then priced as missing, see below); a
    folder whose manifest has no hashes (made before) is parsed whole at load, as it was."""
    from granii.learned import _LazyTrees
    manifest = json.loads((copy_dir / MANIFEST).read_text())
    assert all(len(e["sha256"]) == 64 for e in manifest["models"].values())
    lc = load(copy_dir)
    stored = lambda: dict.__getitem__(lc.trees, ("gemm", "torch"))     # noqa: E731
    assert isinstance(stored(), _LazyTrees)
    t = lc.predict("gemm", "torch", _info(), {"m": 500, "k": 64, "n": 32})
    assert isinstance(stored(), Trees) and math.isfinite(t)
    for e in manifest["models"].values():
        del e["sha256"]
    (copy_dir / MANIFEST).write_text(json.dumps(manifest))
    old = load(copy_dir)
    assert all(isinstance(dict.__getitem__(old.trees, k), Trees) for k in old.trees)
    assert old.predict("gemm", "torch", _info(), {"m": 500, "k": 64, "n": 32}) == t


def test_a_file_damaged_after_its_hash_was_written_is_priced_as_missing(copy_dir):
    """A model file that matches the manifest's hash but does not parse (damaged before the
    manifest was written) cannot be refused at load: on first use it warns once, naming the
    file and the fix, and the primitive is priced as one without a model, call after call."""
    path = copy_dir / "gemm__torch.json"
    path.write_text(path.read_text()[:500])
    manifest = json.loads((copy_dir / MANIFEST).read_text())
    manifest["models"]["gemm/torch"]["sha256"] = learned.file_sha256(path)
    (copy_dir / MANIFEST).write_text(json.dumps(manifest))
    lc = load(copy_dir)
    assert ("gemm", "torch") in lc.trees
    dims = {"m": 500, "k": 64, "n": 32}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = lc.predict("gemm", "torch", _info(), dims)
        again = lc.predict("gemm", "torch", _info(), dims)
    said = [str(w.message) for w in caught if "gemm__torch.json" in str(w.message)]
    assert len(said) == 1 and "damaged" in said[0] and "re-run" in said[0]
    assert ("gemm", "torch") not in lc.trees and ("gemm", "torch") not in dict(lc.trees.items())
    assert first == again == lc.fallback.predict("gemm", "torch", _info(), dims)
    assert math.isfinite(first) and first > 0


def test_parsed_models_are_cached_by_hash_and_a_bad_cache_file_is_parsed_again(
        copy_dir, tmp_path, monkeypatch):
    """A model file parsed once is kept as arrays under ``GRANII_CACHE``, named by its SHA-256:
    the next process reads those and never parses the JSON; a damaged cache file is parsed from
    the JSON again and rewritten; an unwritable cache only costs the parsing."""
    from granii.learned import trees_cache
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "cache"))
    sha = json.loads((copy_dir / MANIFEST).read_text())["models"]["gemm/torch"]["sha256"]
    args = ("gemm", "torch", _info(), {"m": 500, "k": 64, "n": 32})
    want = load(copy_dir).predict(*args)
    assert trees_cache(sha).is_file()

    def no_parsing(*a, **k):
        raise AssertionError("the model file was parsed")
    with monkeypatch.context() as m:
        m.setattr(Trees, "__init__", no_parsing)
        assert load(copy_dir).predict(*args) == want                   # from the cache file
    good = trees_cache(sha).read_bytes()
    other_format = np.fromfile(trees_cache(sha), dtype="<i4")
    other_format[1] += 1
    for damaged in (b"not a cache file", good[: len(good) // 2], good[:-1],
                    other_format.tobytes()):
        trees_cache(sha).write_bytes(damaged)
        assert learned._cached_trees(sha) is None
        assert load(copy_dir).predict(*args) == want
        assert trees_cache(sha).read_bytes() == good                    # rewritten whole
    monkeypatch.setenv("GRANII_CACHE", str(copy_dir / MANIFEST))        # a file, not a folder
    assert load(copy_dir).predict(*args) == want


def test_cached_arrays_are_read_without_copies_and_a_bad_index_raises_in_either_walk(
        copy_dir, tmp_path, monkeypatch):
    """The cache's int32 arrays are walked as read (no int64 copies), with the same prediction
    as the parsed JSON's int64 arrays; a child index outside its tree, written into a cache
    file whose header is intact, raises in the native walk and in numpy's, never reads past
    the arrays."""
    from granii.learned import trees_cache
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "cache"))
    sha = json.loads((copy_dir / MANIFEST).read_text())["models"]["gemm/torch"]["sha256"]
    parsed = Trees(json.loads((copy_dir / "gemm__torch.json").read_text()))
    args = ("gemm", "torch", _info(), {"m": 500, "k": 64, "n": 32})
    want = load(copy_dir).predict(*args)
    cached = learned._cached_trees(sha)
    assert cached.left.dtype == np.int32 and cached.cond.dtype == np.float32
    x = np.random.default_rng(0).random((5, cached.num_features), dtype=np.float32)
    assert parsed.left.dtype == np.int64
    assert np.array_equal(cached.predict(x, 0.5), parsed.predict(x, 0.5))
    assert np.allclose(cached.predict(x, 0.5), cached.predict_numpy(x, 0.5))
    assert load(copy_dir).predict(*args) == want
    flat = np.fromfile(trees_cache(sha), dtype="<i4")
    t, w = int(flat[4]), int(flat[5])
    left = flat[6:6 + t * w].reshape(t, w)
    left[0, 0] = w + 7                                # the root's left child: outside its tree
    flat.tofile(trees_cache(sha))
    bad = learned._cached_trees(sha)
    with pytest.raises(RuntimeError, match="points to node"):
        bad.predict(x, 0.5)
    with pytest.raises(ValueError, match="outside its tree"):
        bad.predict_numpy(x, 0.5)


def test_a_cached_model_is_walked_as_one_array(copy_dir, tmp_path, monkeypatch):
    """A cached model is walked by ``forest_predict_flat`` over its file's one int32 array
    (no tensor per array), with the leaves the per-array walk reaches; its arrays are made
    only when numpy reads them; a header that does not match the array's length is refused."""
    import torch
    if learned._native_flat_walk() is None:
        pytest.skip("needs granii's native kernels")
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "cache"))
    sha = json.loads((copy_dir / MANIFEST).read_text())["models"]["spmm/dgl"]["sha256"]
    load(copy_dir).predict("spmm", "dgl", _info(), {"k": 32})
    cached = learned._cached_trees(sha)
    assert "left" not in cached.__dict__ and "_tensors" not in cached.__dict__
    x = np.random.default_rng(2).random((6, cached.num_features), dtype=np.float32)
    calls = []
    real = learned._native_flat_walk()
    monkeypatch.setattr(learned, "_native_flat_walk",
                        lambda: lambda *a: calls.append(1) or real(*a))
    got = cached.predict(x, 0.25)
    assert calls == [1] and "_tensors" not in cached.__dict__
    per_array = learned._native_walk()(*(torch.from_numpy(np.ascontiguousarray(getattr(cached, n)))
                                         for n in Trees.ARRAYS), torch.from_numpy(x),
                                       cached.depth)
    assert np.array_equal(got, 0.25 + per_array.numpy())
    assert np.allclose(got, cached.predict_numpy(x, 0.25))
    short = torch.from_numpy(np.fromfile(learned.trees_cache(sha), dtype="<i4")[:-1].copy())
    with pytest.raises(RuntimeError, match="header does not match"):
        real(short, torch.from_numpy(x))


def test_cached_models_are_mapped_and_a_rewritten_cache_leaves_the_mapping_whole(
        copy_dir, tmp_path, monkeypatch):
    """A cached model's arrays are the file's pages mapped (a first call reads a dozen models and
    walks a few nodes of each), privately: torch takes them without a warning, and a write would
    not reach the file; a cache file written again meanwhile is renamed over the old one, so the
    models already mapped keep predicting what they did."""
    import mmap
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "cache"))
    sha = json.loads((copy_dir / MANIFEST).read_text())["models"]["gemm/torch"]["sha256"]
    args = ("gemm", "torch", _info(), {"m": 500, "k": 64, "n": 32})
    want = load(copy_dir).predict(*args)
    cached = learned._cached_trees(sha)
    base = cached.left
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(getattr(base, "obj", base), mmap.mmap)
    x = np.random.default_rng(1).random((4, cached.num_features), dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = cached.predict(x, 0.5)
    on_disk = learned.trees_cache(sha).read_bytes()
    cached.left[0, 0] += 1                            # a write to the mapping: not to the file
    assert learned.trees_cache(sha).read_bytes() == on_disk
    assert learned._cached_trees(sha).left[0, 0] == cached.left[0, 0] - 1
    cached.left[0, 0] -= 1
    other = Trees(json.loads((copy_dir / "spmm__dgl.json").read_text()))
    learned._cache_trees(sha, other)                  # another model under the same name
    assert np.array_equal(cached.predict(x, 0.5), before)
    assert learned._cached_trees(sha).left.shape == other.left.shape
    learned.trees_cache(sha).unlink()
    assert load(copy_dir).predict(*args) == want     # parsed from the JSON again


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


def test_corrupt_model_file_is_priced_as_missing_on_first_use(copy_dir):
    """A file whose bytes differ from the manifest's hash is never parsed: its first use says so
    once (the file and the fix) and the pair is priced as one without a model."""
    bad = copy_dir / "spmm__dgl.json"
    bad.write_text(bad.read_text()[:500])
    lc = load(copy_dir)
    gi = _info()
    dims = {"n": gi.num_dst, "k": 64}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = lc.predict("spmm", "dgl", gi, dims)
    said = [str(w.message) for w in caught if str(bad) in str(w.message)]
    assert len(said) == 1 and "damaged" in said[0] and "re-run" in said[0]
    assert ("spmm", "dgl") not in lc.trees and t == lc.fallback.predict("spmm", "dgl", gi, dims)


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


@pytest.fixture
def fake_calibration(monkeypatch, tmp_path):
    """This machine's calibration measured as ``here`` (no timing), cached under ``tmp_path``;
    ``calls`` counts the measurements."""
    from granii import calibration
    here = {"stream": 2e-3, "gemm": 4e-3, "sparse": 6e-3, "small": 1e-4}
    calls = []

    def measure(repeat=7):
        calls.append(1)
        return dict(here)
    monkeypatch.setattr(calibration, "measure", measure)
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(learned, "_WARNED", set())
    monkeypatch.setattr(learned, "_LOADED", {})
    return here, calls


def _as_foreign(copy_dir, times=None):
    """Make the copied folder look trained on another processor (with reference times)."""
    manifest = json.loads((copy_dir / "manifest.json").read_text())
    manifest["fingerprint"]["cpu_model"] = "Some Other CPU"
    manifest["fingerprint_id"] = "0123456789ab"
    manifest.pop("calibration", None)            # an older folder: no stored predictions either
    if times is not None:
        manifest["calibration"] = {"times": times}
    (copy_dir / "manifest.json").write_text(json.dumps(manifest))
    target = copy_dir.parent / "0123456789ab"
    copy_dir.rename(target)
    return target


def test_default_cost_model_warns_once_and_falls_back(tmp_path, fake_calibration):
    here, _ = fake_calibration
    with pytest.warns(learned.CostModelWarning, match="scripts/init.sh"):
        model = learned.default_cost_model(tmp_path)
    assert isinstance(model, AnalyticalCost) and "calibrated" in model.name
    # the rates come from this machine's calibration: a slower GEMM reference, a slower GEMM
    from granii.calibration import REFERENCE
    s = REFERENCE["gemm"][3]
    assert model.flop_rate == pytest.approx(2 * s["m"] * s["k"] * s["n"] / here["gemm"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert learned.default_cost_model(tmp_path) is model


def test_default_cost_model_loads_this_machines_models(model_dir, monkeypatch):
    monkeypatch.setattr(learned, "_WARNED", set())
    monkeypatch.setattr(learned, "_LOADED", {})
    model = learned.default_cost_model(model_dir.parent)
    assert isinstance(model, LearnedCost)
    assert learned.default_cost_model(model_dir.parent) is model


def test_default_cost_model_refuses_a_damaged_folder_with_a_warning(copy_dir, fake_calibration):
    """A folder that cannot be this machine's (a manifest that does not parse) is refused with a
    warning; a damaged model file is refused when first needed, with a warning naming it."""
    manifest = (copy_dir / MANIFEST).read_text()
    (copy_dir / MANIFEST).write_text("garbage")
    with pytest.warns(learned.CostModelWarning, match="manifest.json"):
        assert isinstance(learned.default_cost_model(copy_dir.parent), AnalyticalCost)
    (copy_dir / MANIFEST).write_text(manifest)
    learned._LOADED.clear()
    (copy_dir / "spmm__dgl.json").write_text("garbage")
    model = learned.default_cost_model(copy_dir.parent)
    gi = _info()
    with pytest.warns(learned.CostModelWarning, match="spmm__dgl.json is damaged"):
        model.predict("spmm", "dgl", gi, {"n": gi.num_dst, "k": 8})


def test_foreign_models_are_used_with_this_machines_calibration(copy_dir, fake_calibration,
                                                                monkeypatch):
    """On a machine without its own models, the shipped ones of another machine price calls,
    rescaled by the ratio of the two calibrations; said once."""
    here, calls = fake_calibration
    theirs = {k: v / 2 for k, v in here.items()}          # this machine: twice as slow
    monkeypatch.setattr(learned, "model_calibration", lambda m: dict(theirs))
    folder = _as_foreign(copy_dir, theirs)
    with pytest.warns(learned.CostModelWarning, match="rescaled by a calibration"):
        model = learned.default_cost_model(folder.parent)
    assert isinstance(model, LearnedCost) and model.transfer is not None
    assert "transferred" in model.name and calls == [1]
    plain = load(folder, check=False)
    gi = _info()
    for prim, impl, dims in [("spmm", "dgl", {"n": gi.num_dst, "k": 64}),
                             ("gemm", "torch", {"m": 500, "k": 64, "n": 32}),
                             ("spmm_norm", "native", {"n": gi.num_dst, "k": 64})]:
        assert model.predict(prim, impl, gi, dims) == pytest.approx(
            2 * plain.predict(prim, impl, gi, dims), rel=1e-9)
    # the calibration is measured once per machine and read back from the cache
    learned._LOADED.clear()
    learned.default_cost_model(folder.parent).predict("spmm", "dgl", gi, {"n": 9, "k": 8})
    assert calls == [1]


def test_foreign_models_without_a_calibration_derive_it_from_their_predictions(
        copy_dir, fake_calibration):
    from granii import calibration
    folder = _as_foreign(copy_dir)                         # an older folder: no calibration
    with pytest.warns(learned.CostModelWarning):
        model = learned.default_cost_model(folder.parent)
    theirs = learned.model_calibration(load(folder, check=False))
    # row_scale/torch and the native SpMM have no model here
    assert set(theirs) == {"gemm", "sparse", "small", "sparse_torch_csr", "small_torch_csr"}
    assert theirs == calibration.predicted(load(folder, check=False))
    # a measured calibration fills in only what the models cannot predict
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["calibration"] = {"times": {"stream": 0.5, "gemm": 123.0}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    both = learned.model_calibration(load(folder, check=False))
    assert both["stream"] == 0.5 and both["gemm"] == theirs["gemm"]
    here, _ = fake_calibration
    assert model.transfer.ratio("gemm") == pytest.approx(here["gemm"] / theirs["gemm"])


def test_a_trained_folder_stores_its_predictions_of_the_reference_calls(copy_dir, monkeypatch):
    """``train`` keeps the models' predictions of the calibration's reference calls in the
    manifest; a process transferring the folder reads them instead of building the reference
    graphs, as long as the reference calls and the models are those they were made for."""
    from granii import calibration
    manifest = json.loads((copy_dir / MANIFEST).read_text())
    stored = calibration.stored_prediction(manifest)
    want = calibration.predicted(load(copy_dir, check=False))
    assert stored is not None and set(stored) == set(want) == {
        "gemm", "sparse", "small", "sparse_torch_csr", "small_torch_csr"}
    assert stored == pytest.approx(want, rel=1e-6)
    calls = []
    real = calibration.predicted
    monkeypatch.setattr(calibration, "predicted", lambda m: calls.append(1) or real(m))
    assert learned.model_calibration(load(copy_dir, check=False)) == stored
    assert calls == []
    # other models under the same manifest: the stored predictions no longer hold
    changed = json.loads(json.dumps(manifest))
    changed["models"]["spmm/dgl"]["sha256"] = "0" * 64
    assert calibration.stored_prediction(changed) is None
    # other reference calls: neither
    monkeypatch.setitem(calibration.REFERENCE, "small",
                        ("spmm", "dgl", (2000, 8000, 13), {"k": 32}))
    assert calibration.stored_prediction(manifest) is None
    theirs = learned.model_calibration(load(copy_dir, check=False))
    assert calls == [1] and set(theirs) == set(stored)


def test_shipped_folders_store_what_their_models_predict():
    """The predictions stored in the shipped manifests are what their models predict now (so a
    change of the features, the baseline or the reference graphs that moves them is caught)."""
    from granii import calibration
    root = learned.DEFAULT_DIR
    folders = sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))
    assert folders
    for folder in folders:
        stored = calibration.stored_prediction(json.loads((folder / MANIFEST).read_text()))
        assert stored is not None, f"{folder.name} stores no predictions of the reference calls"
        assert stored == pytest.approx(calibration.predicted(load(folder, check=False)),
                                       rel=1e-6)


def test_loading_reads_no_model_file_and_a_later_load_reads_the_cache(
        copy_dir, tmp_path, monkeypatch):
    """Loading reads none of the model files (it only looks for them); the first use of a model
    checks its file against the manifest hash and caches the parse under that hash, so a later
    load reads none of the JSON at all. A file damaged after its model was cached is not read
    again while the cache holds it; without the cache it is refused on first use."""
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "cache"))
    args = ("gemm", "torch", _info(), {"m": 500, "k": 64, "n": 32})
    read = []
    real_read = learned.Path.read_bytes
    monkeypatch.setattr(learned.Path, "read_bytes",
                        lambda self: read.append(self.name) or real_read(self))
    lc = load(copy_dir)
    assert read == []
    want = lc.predict(*args)
    assert read == ["gemm__torch.json"]
    del read[:]
    again = load(copy_dir)
    assert again.predict(*args) == want and read == []
    path = copy_dir / "gemm__torch.json"
    path.write_text(path.read_text()[:-10] + "1" * 10)            # damaged, same size
    assert load(copy_dir).predict(*args) == want and read == []   # the cache holds the model
    sha = json.loads((copy_dir / MANIFEST).read_text())["models"]["gemm/torch"]["sha256"]
    learned.trees_cache(sha).unlink()
    later = load(copy_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = later.predict(*args)
    assert any("gemm__torch.json is damaged" in str(w.message) for w in caught)
    assert t == later.fallback.predict(*args) and not learned.trees_cache(sha).exists()


def test_a_changed_model_file_is_not_read_from_the_cache_of_the_old_one(
        copy_dir, tmp_path, monkeypatch):
    """The cache of parsed models is keyed by the JSON's SHA-256: a model file replaced (and its
    hash in the manifest) is parsed anew, never read from the old file's cache."""
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path / "cache"))
    args = ("gemm", "torch", _info(), {"m": 500, "k": 64, "n": 32})
    before = load(copy_dir).predict(*args)
    manifest = json.loads((copy_dir / MANIFEST).read_text())
    entry = manifest["models"]["gemm/torch"]
    model = json.loads((copy_dir / entry["file"]).read_text())
    for tree in model["learner"]["gradient_booster"]["model"]["trees"]:
        tree["split_conditions"] = [c + 0.5 if l == -1 else c
                                    for c, l in zip(tree["split_conditions"],
                                                    tree["left_children"])]
    (copy_dir / entry["file"]).write_text(json.dumps(model))
    entry["sha256"] = learned.file_sha256(copy_dir / entry["file"])
    (copy_dir / MANIFEST).write_text(json.dumps(manifest))
    trees = len(model["learner"]["gradient_booster"]["model"]["trees"])
    after = load(copy_dir).predict(*args)
    assert after == pytest.approx(before * math.exp(0.5 * trees), rel=1e-4)
    assert len(list((tmp_path / "cache" / "trees").glob("*.i32"))) == 2


def test_transfer_scales_small_calls_by_the_small_reference_and_large_by_their_class():
    from granii.calibration import Transfer
    t = Transfer({"small": 1e-4, "sparse": 1e-2, "gemm": 1e-2, "stream": 1e-2},
                 {"small": 3e-4, "sparse": 2e-2, "gemm": 5e-3, "stream": 1e-2})
    assert t.scale("spmm", 1e-5) == pytest.approx(3e-5)          # below the small reference
    assert t.scale("spmm", 1.0) == pytest.approx(2.0)            # above the class reference
    assert t.scale("gemm", 1.0) == pytest.approx(0.5)
    mid = t.scale("spmm", 1e-3)                                  # halfway in log time
    assert mid == pytest.approx(1e-3 * math.sqrt(3 * 2))
    assert t.scale("gat_aggregate", 1.0) == pytest.approx(2.0)   # sparse class


def test_transfer_scales_a_sparse_kernel_by_the_references_of_its_own_implementation():
    """Sparse kernels of different libraries change speed differently between processors (on
    an Intel machine against the models' AMD one: DGL's SpMM 2.0x, the native one 3.0x): a
    native kernel scales by the native references where both machines have them, by DGL's
    otherwise, and a dense primitive by its class whatever its implementation."""
    from granii.calibration import Transfer
    theirs = {"small": 1e-4, "sparse": 1e-2, "gemm": 1e-2, "stream": 1e-2,
              "small_native": 1e-4, "sparse_native": 1e-2}
    here = {"small": 2e-4, "sparse": 2e-2, "gemm": 1e-2, "stream": 1e-2,
            "small_native": 1e-4, "sparse_native": 3e-2}
    t = Transfer(theirs, here)
    assert t.scale("spmm", 1.0, "dgl") == pytest.approx(2.0)
    assert t.scale("spmm", 1.0, "native") == pytest.approx(3.0)
    assert t.scale("spmm", 1e-5, "native") == pytest.approx(1e-5)      # its small reference
    assert t.scale("gat_aggregate", 1.0, "native") == pytest.approx(3.0)
    assert t.scale("spmm", 1.0, "torch_csr") == pytest.approx(2.0)     # no references of its own
    assert t.scale("gemm", 1.0, "native") == pytest.approx(1.0)
    partial = Transfer({k: v for k, v in theirs.items() if k != "small_native"}, here)
    assert partial.scale("spmm", 1.0, "native") == pytest.approx(2.0)  # both ends, or DGL's


def test_without_dgls_references_a_sparse_kernel_scales_by_the_native_then_torch_csr_ones():
    """Where DGL is not installed its reference calls are not timed here: a sparse kernel
    without references of its own scales by the native kernels', then torch's CSR product's,
    instead of going unscaled."""
    from granii.calibration import Transfer
    theirs = {"small": 1e-4, "sparse": 1e-2, "gemm": 1e-2, "stream": 1e-2,
              "small_native": 1e-4, "sparse_native": 1e-2,
              "small_torch_csr": 1e-4, "sparse_torch_csr": 1e-2}
    here = {"gemm": 1e-2, "stream": 1e-2, "small_native": 1e-4, "sparse_native": 3e-2,
            "small_torch_csr": 1e-4, "sparse_torch_csr": 1.5e-2}
    t = Transfer(theirs, here)
    assert t.sparse_references("dgl") == ("sparse_native", "small_native")
    assert t.scale("spmm", 1.0, "dgl") == pytest.approx(3.0)
    assert t.scale("spmm", 1.0, "torch_csr") == pytest.approx(1.5)     # its own
    assert t.scale("edge_softmax", 1.0, "torch") == pytest.approx(3.0)
    no_native = Transfer(theirs, {k: v for k, v in here.items() if "native" not in k})
    assert no_native.scale("spmm", 1.0, "native") == pytest.approx(1.5)
    assert Transfer(theirs, {"gemm": 1e-2}).scale("spmm", 1.0, "native") == 1.0


def test_calibration_measures_each_sparse_implementation_it_has():
    """The calibration's reference calls include the native and torch CSR SpMM where those
    kernels exist, with the same graphs and sizes as DGL's, and DGL's own where DGL is
    installed (on either stack)."""
    import importlib.util
    from granii import calibration, kernels
    ref = calibration.REFERENCE
    for impl, suffix in calibration.IMPL_REFERENCE.items():
        for name in ("sparse", "small"):
            assert ref[name + suffix][:2] == ("spmm", impl)
            assert ref[name + suffix][2:] == ref[name][2:]
    have_dgl = importlib.util.find_spec("dgl") is not None
    times = calibration.measure(repeat=1)
    want = {n for n, (p, i, _, _) in ref.items()
            if i in kernels.implementations(p) and (i != "dgl" or have_dgl)}
    assert set(times) == want == set(calibration.measurable())
    assert {"stream", "gemm", "sparse_torch_csr", "small_torch_csr"} <= want
    assert ("sparse" in want) == have_dgl
    assert all(t > 0 for t in times.values())


def test_models_of_this_machine_are_preferred_and_need_no_calibration(copy_dir, fake_calibration):
    _, calls = fake_calibration
    foreign = copy_dir.parent / "0123456789ab"
    shutil.copytree(copy_dir, foreign)
    model = learned.default_cost_model(copy_dir.parent)
    assert model.path == copy_dir and model.transfer is None
    gi = _info()
    model.predict("spmm", "dgl", gi, {"n": gi.num_dst, "k": 32})
    assert calls == []


def test_asking_whether_a_pair_is_learned_measures_no_calibration(copy_dir, fake_calibration):
    """Selection asks whether a pair has a learned model anywhere in the chain (this machine's,
    then other setups'). Answering no must not build the analytical model at the chain's end:
    that measures this machine's calibration, a second or more on a process's first call. A
    prediction that does need it still measures it, once."""
    from granii.select import _learned
    _, calls = fake_calibration
    shutil.copytree(copy_dir, copy_dir.parent / "0123456789ab")
    model = learned.default_cost_model(copy_dir.parent)
    assert model.path == copy_dir and model.transfer is None
    assert not _learned(model, "add", "torch", "train")
    assert not _learned(model, "spmm", "no-such-kernel", "forward")
    assert _learned(model, "spmm", "dgl", "forward")
    assert calls == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.predict("spmm", "no-such-kernel", _info(), {"n": 500, "k": 32})
    assert len(calls) == 1


def test_a_pair_without_a_model_falls_back_with_one_warning_naming_it(model_dir, monkeypatch):
    monkeypatch.setattr(learned, "_WARNED", set())
    lc = load(model_dir)
    gi = _info()
    dims = {"n": gi.num_dst, "k": 16}
    with pytest.warns(learned.CostModelWarning, match="spmm_max/dgl") as rec:
        t = lc.predict("spmm_max", "dgl", gi, dims)
        lc.predict("spmm_max", "dgl", gi, dict(dims, k=32))
    assert len([w for w in rec if "spmm_max/dgl" in str(w.message)]) == 1
    assert t == AnalyticalCost().predict("spmm_max", "dgl", gi, dims)
    assert lc.pricer("spmm_max", "dgl") == "analytical"
    assert lc.pricer("spmm", "dgl") == lc.name


def test_new_primitives_are_priced_by_their_models(model_dir):
    """The fused normalised SpMM (dims like spmm's) and the fused GAT aggregation (heads and
    k = heads x F) have models; they grow with k and tell their implementations apart."""
    from granii.costmodel import concrete_dims
    lc = load(model_dir)
    gi = _info()
    assert lc.has_model("spmm_norm", "native") and lc.has_model("gat_aggregate", "native")
    dims = concrete_dims(("spmm_norm", False, ("E", "k_in")),
                         {"N": gi.num_dst, "E": gi.num_edges, "k_in": 64})
    assert dims == {"n": gi.num_dst, "k": 64}
    assert lc.predict("spmm_norm", "native", gi, dims) < lc.predict("spmm_norm", "dgl", gi, dims)
    gdims = concrete_dims(("gat_aggregate", False, ("E", "H", "k_out")),
                          {"N": gi.num_dst, "E": gi.num_edges, "H": 4, "k_out": 128})
    assert gdims == {"heads": 4, "k": 128}
    small = lc.predict("gat_aggregate", "native", gi, {"heads": 4, "k": 32})
    big = lc.predict("gat_aggregate", "native", gi, gdims)
    assert 0 < small < big
    assert big < lc.predict("gat_aggregate", "dgl", gi, gdims)
    # the analytical model prices them too (a pair without a model)
    assert AnalyticalCost().predict("gat_aggregate", "native", gi, gdims) > \
        AnalyticalCost().predict("gat_aggregate", "native", gi, {"heads": 4, "k": 32})


def test_training_models_load_and_predict_forward_plus_backward(model_dir):
    lc = load(model_dir)
    gi = _info()
    dims = {"n": gi.num_dst, "k": 64}
    assert lc.has_model("spmm", "dgl", "train") and not lc.has_model("gat_aggregate", "dgl",
                                                                     "train")
    f, b = lc.predict("spmm", "dgl", gi, dims), lc.predict_train("spmm", "dgl", gi, dims)
    assert b > 1.5 * f                         # the fake backward triples the time
    assert lc.predict_train("gat_aggregate", "dgl", gi, {"heads": 1, "k": 8}) is None


class _Fixed:
    """A cost model with set forward and training times, counting its calls."""
    name = "fixed"

    def __init__(self, fwd, train):
        self.fwd, self.train, self.calls = fwd, train, []

    def predict(self, prim, impl, gi, dims):
        self.calls.append(("forward", prim, impl))
        return self.fwd[impl]

    def predict_train(self, prim, impl, gi, dims):
        self.calls.append(("train", prim, impl))
        return self.train.get(impl)


def test_training_price_uses_the_measured_backward():
    from granii.select import step_seconds
    m = _Fixed({"a": 1.0, "b": 1.0}, {"a": 5.0})
    # spmm: the feature gradient is the one profiled: forward + backward as measured
    assert step_seconds(m, "spmm", "a", None, {}, needed=(0,)) == 5.0
    # no training model for b: one more forward per gradient
    assert step_seconds(m, "spmm", "b", None, {}, needed=(0,)) == 2.0
    # gemm profiles both gradients; one of them needed: half the measured backward
    assert step_seconds(m, "gemm", "a", None, {}, needed=(1,)) == pytest.approx(1 + 4 / 2)
    assert step_seconds(m, "spmm", "a", None, {}, needed=()) == 1.0
    assert ("train", "spmm", "a") in m.calls


def test_training_selection_follows_the_backward_models(model_dir):
    """Two implementations alike in the forward but not in the backward: training picks the one
    whose measured backward is cheaper, inference does not care."""
    from dgl.nn import GraphConv

    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.plan import EVERY, INPUT
    from granii.select import rank
    g = gen.build("uniform:n=500,m=4000,seed=7,undirected=0")
    layer = GraphConv(32, 16, norm="both", allow_zero_in_degree=True)
    with torch.no_grad():
        call = prepare(new_state(layer, "conv"), layer, (g, torch.randn(g.num_nodes(), 32)), {})
    lc = load(model_dir)

    class Skewed:
        name = "skewed"

        def predict(self, prim, impl, gi, dims):
            return lc.predict(prim, impl, gi, dims) if prim == "gemm" else 1e-3

        def predict_train(self, prim, impl, gi, dims):
            if prim == "gemm":
                return lc.predict_train(prim, impl, gi, dims)
            return 1e-3 + (1.0 if impl == "dgl" else 1e-3)
    best_train = rank(call.compiled.plans, call.gi, call.symbols, Skewed(), training=True,
                      input_grad=True)[0]
    # the features need a gradient: steps once per input run on every call too
    sparse = [i for s, i in zip(best_train.plan.steps, best_train.impls)
              if s.prim.startswith("spmm") and s.when in (EVERY, INPUT)]
    assert sparse and "dgl" not in sparse


def test_fingerprint_is_stable_and_thread_specific():
    a, b = machine_fingerprint(2), machine_fingerprint(2)
    assert fingerprint_id(a) == fingerprint_id(b) and len(fingerprint_id(a)) == 12
    assert fingerprint_id(machine_fingerprint(8)) != fingerprint_id(a)
    assert a["cpu_model"] and a["cores"] >= 1


def test_fingerprint_tells_vector_extensions_apart():
    """One processor name covers parts with and without AVX-512: models of one are foreign on
    the other, and models whose manifest predates the field are foreign everywhere."""
    from granii.fingerprint import ISA_ORDER, isa
    here = machine_fingerprint(2)
    assert here["isa"] == isa() and here["isa"]
    other = dict(here, isa=next(x for x in ISA_ORDER if x != here["isa"]))
    assert fingerprint_id(other) != fingerprint_id(here)
    assert any(d.startswith("isa:") for d in differences(here, other))
    older = {k: v for k, v in here.items() if k != "isa"}
    assert any(d.startswith("isa:") for d in differences(here, older))

def test_xgboost_version_is_read_without_importing_it():
    """The fingerprint's xgboost version comes from the file xgboost reads its own from (not
    its metadata, which scans every distribution): the installed distribution's version, and
    xgboost stays unimported."""
    import importlib.metadata
    code = ("import sys; from granii.fingerprint import _version, _version_file;"
            "print(_version('xgboost'), _version_file('xgboost'), 'xgboost' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    dists = []
    for name in ("xgboost", "xgboost-cpu"):
        try:
            dists.append(importlib.metadata.version(name).split("+")[0])
        except importlib.metadata.PackageNotFoundError:
            pass
    assert out[0] == out[1] and out[0] in dists
    assert out[2] == "False"



def test_selection_ranks_graphconv_plans_with_learned_models(model_dir):
    """The plans of a real layer price through the learned models (dims conventions agree)."""
    import inspect

    from dgl.nn import GraphConv

    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.select import rank
    lc = load(model_dir)
    g = gen.build("uniform:n=500,m=4000,seed=7,undirected=0")
    layer = GraphConv(32, 16, norm="both", allow_zero_in_degree=True)
    state = new_state(layer, "conv")
    with torch.no_grad():
        call = prepare(state, layer, (g, torch.randn(g.num_nodes(), 32)), {})
    ranking = rank(call.compiled.plans, call.gi, call.symbols, lc)
    assert ranking and all(math.isfinite(c.cost) and c.cost > 0 for c in ranking)


class _PerPrim:
    """Forward 1 s per call (0.01 s for a row scaling), forward + both gradients 5 s."""
    name = "per-prim"

    def predict(self, prim, impl, gi, dims):
        return 0.01 if prim == "row_scale" else 1.0

    def predict_train(self, prim, impl, gi, dims):
        return 5.0


def test_training_prices_a_bias_as_a_column_sum_and_a_packed_gemm_with_its_backward():
    """``X W + b`` with ``X`` needing no gradient: f + (b - f) / 2 for ``dW`` and one pass over
    the result for ``db`` (not one more forward); the packed GEMM of a shared-operand plan reads
    its weights through ``pack[i]`` and is still priced with its backward."""
    from dgl.nn import SAGEConv

    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.select import price
    g = gen.build("uniform:n=300,m=2000,seed=3,undirected=0")
    layer = SAGEConv(16, 8, "mean")
    call = prepare(new_state(layer, "sage"), layer, (g, torch.randn(g.num_nodes(), 16)), {})
    seen_bias = seen_pack = False
    for plan in call.compiled.plans:
        choice = price(plan, call.gi, call.symbols, _PerPrim(), True, False, 100)
        for step, _, t in choice.step_costs:
            if step.prim != "gemm" or step.args[0] != "feat":
                continue
            bias = len(step.args) == 3 and plan.leaves.get(step.args[2]) is not None
            packed = "[" in step.args[1]
            assert t == pytest.approx(1 + 4 / 2 + (0.01 if bias else 0.0)), (plan.index, step)
            seen_bias |= bias
            seen_pack |= packed
    assert seen_bias and seen_pack



def _tree_sets(model_dir):
    """Every ensemble of the synthetic models, both phases, parsed."""
    lc = load(model_dir)
    return lc.trees.items() + lc.train_trees.items()


def test_native_tree_walk_matches_numpy(model_dir):
    if learned._native_walk() is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(1)
    sets = _tree_sets(model_dir)
    assert len(sets) > 4
    for key, trees in sets:
        X = rng.normal(0, 4, (40, trees.num_features)).astype(np.float32)
        X[rng.random(X.shape) < 0.1] = np.nan              # missing values go by default_left
        X[0, trees.feature[0, 0]] = trees.cond[0, 0]       # on the first split's boundary
        margin = rng.normal(size=40)
        np.testing.assert_allclose(trees.predict(X, margin), trees.predict_numpy(X, margin),
                                   rtol=1e-13, atol=0, err_msg=str(key))


def _with_child(model, side, value):
    tree = next(t for t in model["learner"]["gradient_booster"]["model"]["trees"]
                if max(t["left_children"]) >= 0)
    inner = next(i for i, c in enumerate(tree["left_children"]) if c >= 0)
    tree[side][inner] = value
    return model


def test_tree_pointing_outside_its_arrays_is_refused(model_dir):
    text = (model_dir / "spmm__dgl.json").read_text()
    for side, value in (("left_children", 10 ** 6), ("right_children", -7)):
        with pytest.raises(ValueError, match="outside its tree"):
            Trees(_with_child(json.loads(text), side, value))
    good = Trees(json.loads(text))
    arrays = {name: getattr(good, name).copy() for name in Trees.ARRAYS}
    arrays["right"][0, 0] = arrays["right"].shape[1]
    with pytest.raises(ValueError, match="outside its tree"):
        Trees.from_arrays(dict(arrays, num_features=good.num_features, depth=good.depth))


def test_damaged_tree_file_is_a_cost_model_error(copy_dir):
    path = copy_dir / "spmm__dgl.json"
    model = _with_child(json.loads(path.read_text()), "right_children", 10 ** 6)
    path.write_text(json.dumps(model))
    n_features = int(model["learner"]["learner_model_param"]["num_feature"])
    with pytest.raises(CostModelError, match="damaged"):
        learned.read_trees(path, n_features)


def test_models_of_a_full_profile_ask_no_other_folder_about_a_pair_they_lack(copy_dir):
    """``select._learned``: models of a full profile that ran to its end stand alone (a pair
    they lack, an addition, no profile measures: reading other folders' manifests cost a first
    call milliseconds); a quick or stopped profile's models ask their fallback."""
    from granii import select
    lc = load(copy_dir)
    asked = []
    lc.learned_fallback = lambda: asked.append(1) or None
    run = lc.manifest.setdefault("run", {})
    run.update(mode="full", stopped_early=False)
    assert lc.complete
    assert select._learned(lc, "gemm", "torch", "forward") is True
    assert select._learned(lc, "add", "torch", "forward") is False and not asked
    for mode, stopped in (("quick", False), ("full", True)):
        run.update(mode=mode, stopped_early=stopped)
        assert not lc.complete
        assert select._learned(lc, "add", "torch", "forward") is False and asked
        asked.clear()
