import math

import dgl
import numpy as np
import pytest
import torch

from granii import featurize as fz
from granii.graph import GraphInfo, graph_info
from granii.profiling import generators as gen


def _graph(u, v, n):
    return dgl.graph((torch.tensor(u), torch.tensor(v)), num_nodes=n, idtype=torch.int64)


def _features(g):
    return fz.graph_features(GraphInfo(g))


def test_names_are_ordered_and_complete():
    g = _graph([0], [1], 2)
    f = _features(g)
    assert list(f) == fz.FEATURE_NAMES
    assert len(set(fz.FEATURE_NAMES)) == len(fz.FEATURE_NAMES)
    for side in ("in", "out"):
        for stat in ("max", "std", "cv", "skew", "gini", "entropy", "empty_frac"):
            assert f"{side}_deg_{stat}" in f


def test_star_into_center():
    """Leaves 1..4 point at node 0: in-degrees (4,0,0,0,0), out-degrees (0,1,1,1,1)."""
    f = _features(_graph([1, 2, 3, 4], [0, 0, 0, 0], 5))
    expected = {
        "num_src": 5, "num_dst": 5, "num_edges": 4, "density": 4 / 25,
        "avg_in_degree": 0.8, "avg_out_degree": 0.8, "log2_num_edges": math.log2(5),
        # in: mean 0.8, deviations (3.2, -0.8 x4)
        "in_deg_max": 4, "in_deg_max_over_avg": 5, "in_deg_std": 1.6, "in_deg_cv": 2.0,
        "in_deg_skew": (3.2 ** 3 - 4 * 0.8 ** 3) / 5 / 1.6 ** 3,  # 1.5
        "in_deg_gini": 0.8, "in_deg_entropy": 0.0, "in_deg_empty_frac": 0.8,
        # out: deviations (-0.8, 0.2 x4)
        "out_deg_max": 1, "out_deg_std": 0.4, "out_deg_cv": 0.5, "out_deg_skew": -1.5,
        "out_deg_gini": 0.2, "out_deg_entropy": math.log(4) / math.log(5),
        "out_deg_empty_frac": 0.2,
        # |u - v| = 1, 2, 3, 4 over n = 5
        "locality_dist": 2.5 / 5,
        "locality_log_dist": (1 + math.log2(3) + 2 + math.log2(5)) / 4 / math.log2(6),
    }
    for key, val in expected.items():
        assert f[key] == pytest.approx(val, abs=1e-12), key


def test_undirected_path():
    """Path 0-1-2-3 in both directions: degrees (1,2,2,1) on both sides."""
    f = _features(_graph([0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2], 4))
    p = np.array([1, 2, 2, 1]) / 6
    for side in ("in", "out"):
        assert f[f"{side}_deg_max"] == 2
        assert f[f"{side}_deg_std"] == pytest.approx(0.5)
        assert f[f"{side}_deg_cv"] == pytest.approx(1 / 3)
        assert f[f"{side}_deg_skew"] == pytest.approx(0.0, abs=1e-12)
        assert f[f"{side}_deg_gini"] == pytest.approx(1 / 6)
        assert f[f"{side}_deg_entropy"] == pytest.approx(-(p * np.log(p)).sum() / math.log(4))
        assert f[f"{side}_deg_empty_frac"] == 0
    assert f["density"] == pytest.approx(6 / 16)
    assert f["locality_dist"] == pytest.approx(1 / 4)
    assert f["locality_log_dist"] == pytest.approx(1 / math.log2(5))


def test_directed_in_out_differ():
    """0->1, 0->2, 0->3, 1->2: in-degrees (0,1,2,1), out-degrees (3,1,0,0)."""
    f = _features(_graph([0, 0, 0, 1], [1, 2, 3, 2], 4))
    assert (f["in_deg_max"], f["out_deg_max"]) == (2, 3)
    assert f["in_deg_empty_frac"] == 0.25 and f["out_deg_empty_frac"] == 0.5
    assert f["in_deg_std"] == pytest.approx(math.sqrt(0.5))
    assert f["out_deg_std"] == pytest.approx(math.sqrt(1.5))
    # sorted in (0,1,1,2): 2*(2+3+8)/(4*4) - 5/4; sorted out (0,0,1,3): 2*(3+12)/16 - 5/4
    assert f["in_deg_gini"] == pytest.approx(26 / 16 - 1.25)
    assert f["out_deg_gini"] == pytest.approx(30 / 16 - 1.25)
    # |u - v| over edges: 1, 2, 3, 1 -> 7/4 over n = 4
    assert f["locality_dist"] == pytest.approx(7 / 16)


def test_block_sizes():
    blk = dgl.create_block((torch.tensor([0, 2, 3, 4, 1]), torch.tensor([0, 0, 1, 1, 1])),
                           num_src_nodes=5, num_dst_nodes=2, idtype=torch.int64)
    f = _features(blk)
    assert (f["num_src"], f["num_dst"], f["num_edges"]) == (5, 2, 5)
    assert f["density"] == pytest.approx(0.5)
    assert f["avg_in_degree"] == 2.5 and f["avg_out_degree"] == 1.0
    assert f["in_deg_max"] == 3 and f["out_deg_max"] == 1 and f["out_deg_std"] == 0
    assert f["out_deg_skew"] == 0 and f["out_deg_gini"] == 0
    assert f["out_deg_entropy"] == pytest.approx(1.0)


def test_empty_graph_is_finite():
    for g in (_graph([], [], 3), _graph([], [], 0)):
        x = fz.featurize(GraphInfo(g), {"k": 8})
        assert np.isfinite(x).all()


def test_degree_stats_against_brute_force():
    rng = np.random.default_rng(0)
    deg = rng.zipf(2.0, 5000).clip(max=10_000) * (rng.random(5000) > 0.1)
    s = fz.degree_stats(deg)
    x = deg.astype(np.float64)
    n, mu = len(x), x.mean()
    assert s["std"] == pytest.approx(x.std())
    assert s["skew"] == pytest.approx(((x - mu) ** 3).mean() / x.std() ** 3)
    gini = np.abs(x[:, None] - x[None, :]).sum() / (2 * n * n * mu)
    assert s["gini"] == pytest.approx(gini)
    p = x[x > 0] / x.sum()
    assert s["entropy"] == pytest.approx(-(p * np.log(p)).sum() / math.log(n))
    assert s["empty_frac"] == pytest.approx((x == 0).mean())
    assert s["max"] == x.max()


def test_chunked_histogram_and_csr_out_path(monkeypatch):
    monkeypatch.setattr(fz, "_CHUNK", 100)
    g = gen.rmat(11, 8, seed=3, undirected=False)
    gi = GraphInfo(g)
    f = fz.graph_features(gi)
    ref_in = fz.degree_stats(g.in_degrees().numpy())
    ref_out = fz.degree_stats(g.out_degrees().numpy())
    for key, val in ref_in.items():
        assert f[f"in_deg_{key}"] == pytest.approx(val)
    for key, val in ref_out.items():
        assert f[f"out_deg_{key}"] == pytest.approx(val)
    other = GraphInfo(g)
    other.csr_out()
    assert fz.graph_features(other) == pytest.approx(f)


def test_locality_sampling_close_to_exact():
    g = gen.uniform(50_000, 400_000, seed=1)
    u, v = (t.numpy().astype(np.float64) for t in g.edges())
    exact = np.abs(u - v).mean() / 50_000
    exact_log = np.log2(1 + np.abs(u - v)).mean() / math.log2(50_001)
    f = _features(g)
    assert g.num_edges() > fz.LOCALITY_SAMPLES
    assert f["locality_dist"] == pytest.approx(exact, rel=0.03)
    assert f["locality_log_dist"] == pytest.approx(exact_log, rel=0.01)
    assert f["locality_dist"] == pytest.approx(1 / 3, rel=0.05)
    grid = _features(gen.grid2d(300, 300))
    assert grid["locality_dist"] < 0.01 < f["locality_dist"]


def test_skew_features_rank_graph_families():
    power = _features(gen.rmat(12, 8, seed=1))
    flat = _features(gen.uniform(4096, 30_000, seed=1, undirected=True))
    for key in ("in_deg_cv", "in_deg_gini", "in_deg_skew", "in_deg_max_over_avg"):
        assert power[key] > flat[key]
    assert power["in_deg_entropy"] < flat["in_deg_entropy"]


def test_cached_in_graph_info():
    g = gen.rmat(10, 4, seed=0)
    gi = graph_info(g)
    first = fz.graph_features(gi)
    assert "graph_features" in gi.cache
    gi.cache["graph_features"]["num_edges"] = -1.0  # a second call must be a lookup
    assert fz.graph_features(gi)["num_edges"] == -1.0
    first["num_src"] = -5.0  # callers get a copy
    assert gi.cache["graph_features"]["num_src"] != -5.0


def test_featurize_vector():
    g = gen.rmat(10, 4, seed=0)
    gi = GraphInfo(g)
    sizes = {"k_out": 256, "k_in": 32}
    x = fz.featurize(gi, sizes)
    names = fz.feature_names(list(sizes))
    assert x.dtype == np.float64 and x.shape == (len(names),)
    assert np.array_equal(x, fz.featurize(gi, {"k_in": 32, "k_out": 256}))
    assert np.array_equal(x, fz.featurize(GraphInfo(g), sizes))  # deterministic
    row = dict(zip(names, x))
    e, n = g.num_edges(), g.num_nodes()
    assert row["num_edges"] == e
    assert row["k_in"] == 32 and row["log2_k_out"] == 8
    assert row["E*k_in"] == e * 32 and row["dst*k_out"] == n * 256
    assert row["k_in*k_out"] == 32 * 256 and row["dst*k_in*k_out"] == n * 32 * 256
    assert names[: len(fz.FEATURE_NAMES)] == fz.FEATURE_NAMES
    assert len(fz.featurize(gi, {"k": 16})) == len(fz.FEATURE_NAMES) + 6


def test_features_same_from_the_counted_index_and_from_dgls():
    # a new graph holding only its edges is counted once into an int32 index, which the
    # features read as it is; a graph DGL has indexed is read through DGL's int64 index
    rng = torch.Generator().manual_seed(3)
    u, v = torch.randint(0, 3000, (2, 40_000), generator=rng)
    fresh = dgl.graph((u, v), num_nodes=3100)
    indexed = dgl.graph((u, v), num_nodes=3100)
    indexed.create_formats_()
    a, b = GraphInfo(fresh), GraphInfo(indexed)
    assert a.counted() is not None and a.counted()[1].dtype == torch.int32
    assert b.counted() is None
    assert fz.graph_features(a) == fz.graph_features(b)
