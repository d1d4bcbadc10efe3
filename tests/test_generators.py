import dgl
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from granii.profiling import generators as gen


def _edge_keys(g):
    u, v = g.edges()
    return u.numpy() * g.num_src_nodes() + v.numpy()


def _is_simple(g):
    u, v = g.edges()
    keys = _edge_keys(g)
    return not bool((u == v).any()) and len(np.unique(keys)) == len(keys)


def _is_symmetric(g):
    u, v = (t.numpy() for t in g.edges())
    n = g.num_nodes()
    return np.array_equal(np.sort(u * n + v), np.sort(v * n + u))


def _same_graph(g, h):
    return (g.num_src_nodes(), g.num_dst_nodes()) == (h.num_src_nodes(), h.num_dst_nodes()) \
        and np.array_equal(_edge_keys(g), _edge_keys(h))


def _cv(deg):
    deg = deg.float()
    return float(deg.std(unbiased=False) / deg.mean())


@pytest.mark.parametrize("k", range(2, 9))
def test_mycielskian_sizes(k):
    n, m = gen.mycielskian_size(k)
    g = gen.mycielskian(k)
    assert g.idtype == torch.int64
    assert (g.num_nodes(), g.num_edges()) == (n, 2 * m)
    assert _is_simple(g) and _is_symmetric(g)
    if k > 2:
        n0, m0 = gen.mycielskian_size(k - 1)
        assert (n, m) == (2 * n0 + 1, 3 * m0 + n0)


def test_mycielskian_known_members():
    assert [gen.mycielskian_size(k) for k in (2, 3, 4)] == [(2, 1), (5, 5), (11, 20)]
    assert gen.mycielskian_size(17)[0] == 98303
    c5 = gen.mycielskian(3)
    assert c5.in_degrees().tolist() == [2] * 5
    g = gen.mycielskian(6)
    u, v = g.edges()
    a = sp.csr_matrix((np.ones(g.num_edges()), (u.numpy(), v.numpy())), shape=(47, 47))
    assert (a @ a @ a).diagonal().sum() == 0  # triangle-free
    # SuiteSparse block layout [[A, A, 0], [A, 0, 1], [0, 1^T, 0]] over M_5.
    n = 23
    prev = gen.mycielskian(5)
    pu, pv = (t.numpy() for t in prev.edges())
    a5 = sp.csr_matrix((np.ones(len(pu)), (pu, pv)), shape=(n, n)).toarray()
    full = a.toarray()
    assert np.array_equal(full[:n, :n], a5)
    assert np.array_equal(full[:n, n:2 * n], a5)
    assert np.array_equal(full[n:2 * n, n:2 * n], np.zeros((n, n)))
    assert np.array_equal(full[2 * n, n:2 * n], np.ones(n))
    assert full[2 * n, :n].sum() == 0 and full[2 * n, 2 * n] == 0


def test_grid_degrees():
    g = gen.grid2d(4, 5)
    assert (g.num_nodes(), g.num_edges()) == (20, 2 * (4 * 4 + 3 * 5))
    assert _is_simple(g) and _is_symmetric(g)
    deg = g.in_degrees()
    assert torch.bincount(deg).tolist() == [0, 0, 4, 10, 6]
    assert deg[0] == 2 and deg[6] == 4 and deg[1] == 3
    directed = gen.grid2d(4, 5, undirected=False)
    assert directed.num_edges() == 31
    u, v = directed.edges()
    assert bool(((v - u == 1) | (v - u == 5)).all())


def test_road_like():
    n = 20000
    g = gen.road_like(n, seed=3)
    assert g.num_nodes() == n
    assert _is_simple(g) and _is_symmetric(g)
    deg = g.in_degrees().float()
    assert 2.0 < float(deg.mean()) < 4.0
    assert int(deg.max()) <= 12
    u, v = g.edges()
    # most edges join nearby ids (grid rows are about sqrt(n) = 141 ids apart)
    assert float(((u - v).abs() <= 150).float().mean()) > 0.95


def test_rmat_properties():
    g = gen.rmat(12, 8, seed=1)
    assert g.num_nodes() == 4096
    assert 0 < g.num_edges() <= 2 * 8 * 4096
    assert _is_simple(g) and _is_symmetric(g)
    d = gen.rmat(12, 8, seed=1, undirected=False)
    assert d.num_edges() <= 8 * 4096
    assert not _is_symmetric(d)
    u = gen.uniform(4096, g.num_edges() // 2, seed=1, undirected=True)
    assert _cv(g.in_degrees()) > 2 * _cv(u.in_degrees())
    assert int(g.in_degrees().max()) > 5 * int(u.in_degrees().max())


def test_rmat_skew_grows_with_a():
    low = gen.rmat(12, 8, a=0.3, b=0.25, c=0.25, seed=2)
    high = gen.rmat(12, 8, a=0.7, b=0.1, c=0.1, seed=2)
    assert _cv(high.in_degrees()) > _cv(low.in_degrees())
    with pytest.raises(ValueError):
        gen.rmat(8, 4, a=0.6, b=0.3, c=0.3)


def test_uniform_exact_counts():
    g = gen.uniform(1000, 5000, seed=4)
    assert (g.num_nodes(), g.num_edges()) == (1000, 5000)
    assert _is_simple(g)
    h = gen.uniform(1000, 5000, seed=4, undirected=True)
    assert h.num_edges() == 10000
    assert _is_simple(h) and _is_symmetric(h)
    dense = gen.uniform(10, 90, seed=0)
    assert dense.num_edges() == 90 and _is_simple(dense)
    with pytest.raises(ValueError):
        gen.uniform(10, 46, undirected=True)


def test_sbm_block_densities():
    sizes = [300, 200, 100]
    p_in = [0.5, 0.2, 0.05]
    g = gen.sbm(sizes, p_in, 0.01, seed=1)
    assert g.num_nodes() == 600
    assert _is_simple(g) and _is_symmetric(g)
    u, v = (t.numpy() for t in g.edges())
    block = np.repeat(np.arange(3), sizes)
    for b, (size, p) in enumerate(zip(sizes, p_in)):
        pairs = size * (size - 1)
        hits = ((block[u] == b) & (block[v] == b)).sum()
        assert abs(hits / pairs - p) < 4 * np.sqrt(2 * p * (1 - p) / pairs) + 1e-9
    cross_pairs = 600 ** 2 - sum(s * s for s in sizes)
    cross = (block[u] != block[v]).sum() / cross_pairs
    assert abs(cross - 0.01) < 0.002


def test_sbm_directed_and_large():
    g = gen.sbm([300, 200], [0.9, 0.3], 0.1, seed=2, undirected=False)
    u, v = (t.numpy() for t in g.edges())
    block = np.repeat([0, 1], [300, 200])
    assert abs(((block[u] == 0) & (block[v] == 0)).sum() / (300 * 299) - 0.9) < 0.01
    assert not _is_symmetric(g)
    big = gen.sbm([100_000] * 4, 1e-4, 1e-6, seed=0)  # never densifies 400k x 400k
    assert big.num_nodes() == 400_000
    expected = 4 * 100_000 * 99_999 * 1e-4 + (400_000 ** 2 - 4 * 100_000 ** 2) * 1e-6
    assert abs(big.num_edges() / expected - 1) < 0.01


def test_community_degree():
    g = gen.community(50_000, 32, 12.0, mix=0.8, seed=5)
    assert g.num_nodes() == 50_000
    assert abs(g.num_edges() / g.num_nodes() - 12.0) < 1.0
    assert _is_simple(g) and _is_symmetric(g)


@pytest.mark.parametrize("factory", [
    lambda s: gen.rmat(10, 4, seed=s),
    lambda s: gen.uniform(500, 2000, seed=s),
    lambda s: gen.road_like(2000, seed=s),
    lambda s: gen.sbm([100, 100], 0.1, 0.01, seed=s),
    lambda s: gen.community(3000, 8, 6.0, seed=s),
])
def test_seed_determinism(factory):
    assert _same_graph(factory(7), factory(7))
    assert not _same_graph(factory(7), factory(8))


def test_simplify():
    g = dgl.graph((torch.tensor([0, 0, 1, 2, 2]), torch.tensor([1, 1, 1, 0, 3])), num_nodes=4)
    s = gen.simplify(g)
    assert sorted(zip(*[t.tolist() for t in s.edges()])) == [(0, 1), (2, 0), (2, 3)]
    both = gen.simplify(g, undirected=True)
    assert both.num_edges() == 6 and _is_symmetric(both)
    keep = gen.simplify(g, remove_self_loops=False, dedupe=False)
    assert keep.num_edges() == 5


def test_sample_node_induced():
    g = gen.rmat(11, 8, seed=3)
    sub = gen.sample_subgraph(g, fraction=0.25, seed=1)
    nid = sub.ndata[dgl.NID]
    assert sub.num_nodes() == 512
    assert bool((nid[1:] > nid[:-1]).all())
    ref = dgl.node_subgraph(g, nid)
    assert np.array_equal(np.sort(_edge_keys(sub)), np.sort(_edge_keys(ref)))
    assert _same_graph(sub, gen.sample_subgraph(g, fraction=0.25, seed=1))
    assert sub.num_nodes() == gen.sample_subgraph(g, num_seeds=512, seed=2).num_nodes()


def test_sample_fanout_subgraph():
    g = gen.rmat(12, 16, seed=4)
    sub = gen.sample_subgraph(g, num_seeds=100, fanout=[5, 3], seed=2)
    nid = sub.ndata[dgl.NID]
    assert len(torch.unique(nid)) == sub.num_nodes()
    u, v = sub.edges()
    assert g.has_edges_between(nid[u], nid[v]).all()
    assert int(sub.in_degrees().max()) <= 5
    assert int(sub.in_degrees()[100:].max()) <= 3  # second hop: fanout 3
    assert _same_graph(sub, gen.sample_subgraph(g, num_seeds=100, fanout=[5, 3], seed=2))


def test_sample_block():
    g = gen.rmat(12, 16, seed=4)
    blk = gen.sample_subgraph(g, num_seeds=200, fanout=10, block=True, seed=3)
    assert blk.is_block
    assert blk.num_dst_nodes() == 200
    src_ids, dst_ids = blk.srcdata[dgl.NID], blk.dstdata[dgl.NID]
    assert torch.equal(src_ids[:200], dst_ids)
    expected = torch.clamp(g.in_degrees(dst_ids), max=10)
    assert torch.equal(blk.in_degrees(), expected)
    u, v = blk.edges()
    assert g.has_edges_between(src_ids[u], dst_ids[v]).all()
    with pytest.raises(ValueError):
        gen.sample_subgraph(g, num_seeds=10, fanout=[3, 3], block=True)


def test_names_round_trip():
    name = gen.spec_name("rmat", scale=10, edge_factor=4, a=0.57, b=0.19, c=0.19, seed=3,
                         undirected=True)
    assert name == "rmat:scale=10,edge_factor=4,a=0.57,b=0.19,c=0.19,seed=3,undirected=1"
    assert _same_graph(gen.build(name), gen.rmat(10, 4, seed=3))
    sub = gen.spec_name("sample", num_seeds=50, fanout=[4, 2], seed=1, block=False, base=name)
    family, params = gen.parse_name(sub)
    assert family == "sample" and params["base"] == name and params["fanout"] == [4, 2]
    expected = gen.sample_subgraph(gen.rmat(10, 4, seed=3), num_seeds=50, fanout=[4, 2], seed=1)
    assert _same_graph(gen.build(sub), expected)


def test_quick_corpus():
    items = list(gen.corpus("quick", seed=0))
    names = [name for name, _ in items]
    assert len(set(names)) == len(names)
    assert names == [name for name, _ in gen.corpus("quick", seed=0)]
    assert names != [name for name, _ in gen.corpus("quick", seed=1)]
    families = {gen.parse_name(name)[0] for name in names}
    assert families == {"rmat", "uniform", "grid2d", "road", "community", "mycielskian", "sample"}
    blocks = 0
    edges = []
    for name, factory in items:
        g = factory()
        blocks += g.is_block
        edges.append(g.num_edges())
    assert blocks >= 1
    assert 3e3 <= min(edges) <= 2e4 and 3e5 <= max(edges) <= 1e6


def test_full_corpus_names():
    names = [name for name, _ in gen.corpus("full", seed=0)]
    assert len(set(names)) == len(names) >= 60
    assert "mycielskian:k=15" in names
    rmat_sizes = [gen.parse_name(n)[1] for n in names if n.startswith("rmat:")]
    assert max(2 ** p["scale"] * p["edge_factor"] * (1 + p["undirected"])
               for p in rmat_sizes) >= 5e6
