import numpy as np
import pytest
import torch

from granii import datasets

# (nodes, directed edges as stored, self-loops) from data/PROVENANCE.md: MatrixMarket "stored
# entries" count both directions of each off-diagonal entry and each loop once; the CSV and
# METIS counts are undirected edges, stored here in both directions.
EXPECTED = {
    "cora": (2708, 13264, 2708),
    "citeseer": (3327, 9228, 124),
    "pubmed": (19717, 88651, 3),
    "github-social": (37700, 2 * 289003, 0),
    "deezer-europe": (28281, 2 * 92752, 0),
    "astro-ph": (16706, 2 * 121251, 0),
    "pgp-giantcompo": (10680, 2 * 24316, 0),
    "us-power-grid": (4941, 2 * 6594, 0),
    "wing-mesh": (62032, 2 * 121544, 0),
}


def _keys(g):
    u, v = g.edges()
    return u.numpy() * g.num_nodes() + v.numpy()


def test_graph_list():
    assert datasets.GRAPHS == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_load_graph_counts(name):
    nodes, edges, loops = EXPECTED[name]
    g = datasets.load_graph(name)
    assert g.idtype == torch.int64
    assert g.num_nodes() == nodes
    assert g.num_edges() == edges
    u, v = g.edges()
    assert int((u == v).sum()) == loops
    keys = _keys(g)
    assert len(np.unique(keys)) == len(keys)
    reverse = v.numpy() * nodes + u.numpy()
    assert np.array_equal(np.sort(keys), np.sort(reverse))


@pytest.mark.parametrize("name", ["cora", "citeseer", "us-power-grid"])
def test_self_loop_options(name):
    nodes, edges, loops = EXPECTED[name]
    removed = datasets.load_graph(name, self_loops="remove")
    assert removed.num_edges() == edges - loops
    u, v = removed.edges()
    assert not bool((u == v).any())
    added = datasets.load_graph(name, self_loops="add")
    assert added.num_edges() == edges - loops + nodes
    u, v = added.edges()
    assert torch.equal(torch.sort(u[u == v]).values, torch.arange(nodes))
    with pytest.raises(ValueError):
        datasets.load_graph(name, self_loops="twice")


def test_unknown_and_missing(monkeypatch, tmp_path):
    with pytest.raises(KeyError):
        datasets.load_graph("nope")
    with pytest.raises(KeyError):
        datasets.load_planetoid("pubmed")
    monkeypatch.setattr(datasets, "DATA_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="cora.mtx"):
        datasets.load_graph("cora")
    with pytest.raises(FileNotFoundError, match="ind.citeseer"):
        datasets.load_planetoid("citeseer")


def test_metis_reader_formats(tmp_path):
    path = tmp_path / "w.metis"
    # fmt 011: a vertex weight first, then (neighbour, edge weight) pairs; a comment and an
    # isolated node 4 (empty line).
    path.write_text("% comment\n4 2 011\n7 2 5\n1 1 5 3 9\n% mid comment\n1 2 9\n1\n")
    u, v, n = datasets.read_metis(path)
    assert n == 4
    assert sorted(zip(u.tolist(), v.tolist())) == [(0, 1), (1, 0), (1, 2), (2, 1)]


def test_mtx_reader_general(tmp_path):
    path = tmp_path / "g.mtx"
    path.write_text("%%MatrixMarket matrix coordinate pattern general\n% c\n3 3 3\n1 2\n2 3\n2 3\n")
    u, v, n, symmetric = datasets.read_mtx(path)
    assert (n, symmetric) == (3, False)
    g = datasets.from_edges(u, v, n, symmetric=symmetric)
    assert g.num_edges() == 2


@pytest.mark.parametrize("name,nodes,edges,feats,classes,split", [
    ("cora", 2708, 10556, 1433, 7, (140, 500, 1000)),
    ("citeseer", 3327, 9228, 3703, 6, (120, 500, 1000)),
])
def test_planetoid(name, nodes, edges, feats, classes, split):
    g, x, y, train, val, test = datasets.load_planetoid(name)
    assert g.idtype == torch.int64
    assert (g.num_nodes(), g.num_edges()) == (nodes, edges)
    assert x.shape == (nodes, feats) and x.dtype == torch.float32
    assert y.shape == (nodes,) and y.dtype == torch.int64
    assert int(y.max()) + 1 == classes
    assert tuple(int(m.sum()) for m in (train, val, test)) == split
    assert not bool((train & val).any() or (train & test).any() or (val & test).any())
    assert torch.equal(torch.nonzero(train).flatten(), torch.arange(split[0]))
    assert torch.equal(torch.nonzero(val).flatten(), torch.arange(split[0], split[0] + 500))
    row_sums = x.sum(1)
    assert torch.allclose(row_sums[row_sums > 0], torch.ones(1), atol=1e-5)
    u, v = g.edges()
    homophily = float((y[u] == y[v]).float().mean())
    assert homophily > 0.7  # labels, ids and graph agree (random labels give about 0.2)
    keys = _keys(g)
    assert np.array_equal(np.sort(keys), np.sort(v.numpy() * nodes + u.numpy()))


def test_cora_class_sizes():
    _, _, y, _, _, test = datasets.load_planetoid("cora")
    assert torch.bincount(y).tolist() == [351, 217, 418, 818, 426, 298, 180]
    test_ids = np.loadtxt(datasets.DATA_DIR / "planetoid" / "ind.cora.test.index", dtype=int)
    assert torch.equal(torch.nonzero(test).flatten(), torch.from_numpy(np.sort(test_ids)))


def test_citeseer_isolated_test_nodes():
    g, x, y, _, _, test = datasets.load_planetoid("citeseer")
    test_ids = np.loadtxt(datasets.DATA_DIR / "planetoid" / "ind.citeseer.test.index", dtype=int)
    padded = np.setdiff1d(np.arange(test_ids.min(), test_ids.max() + 1), test_ids)
    assert len(padded) == 15
    assert float(x[padded].abs().sum()) == 0.0
    assert not bool(test[padded].any())
    no_loops = datasets.load_planetoid("citeseer", self_loops="remove")[0]
    assert no_loops.num_edges() == 9104


def test_planetoid_unnormalized_features():
    _, x, _, _, _, _ = datasets.load_planetoid("cora", normalize_features=False)
    assert set(torch.unique(x).tolist()) == {0.0, 1.0}


def test_gcn_reaches_known_accuracy():
    """A 2-layer GCN (Kipf & Welling settings) on the loaded Cora reaches about 81%."""
    import dgl
    import torch.nn.functional as F
    from dgl.nn import GraphConv

    g, x, y, train, _, test = datasets.load_planetoid("cora")
    g = dgl.add_self_loop(dgl.remove_self_loop(g))
    torch.manual_seed(0)
    conv1, conv2 = GraphConv(x.shape[1], 16), GraphConv(16, int(y.max()) + 1)
    params = list(conv1.parameters()) + list(conv2.parameters())
    opt = torch.optim.Adam(params, lr=0.01, weight_decay=5e-4)
    for _ in range(200):
        h = F.relu(conv1(g, F.dropout(x, 0.5, True)))
        loss = F.cross_entropy(conv2(g, F.dropout(h, 0.5, True))[train], y[train])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = conv2(g, F.relu(conv1(g, x))).argmax(1)
    assert float((pred[test] == y[test]).float().mean()) > 0.77
