"""Loaders for the real graphs shipped in ``data/`` (see ``data/PROVENANCE.md``).

Every loader returns a ``dgl.DGLGraph`` with int64 ids. Undirected inputs are stored with both
directions ``u -> v`` and ``v -> u``; a self-loop ``u -> u`` is one edge. Exact duplicate directed
edges are dropped, so each graph is a simple directed graph (plus possibly self-loops).

Self-loops: by default (``self_loops="keep"``) a graph holds exactly the self-loops its file
holds. ``cora.mtx`` stores ``A + I`` (a loop on every node, 13,264 edges), ``citeseer.mtx`` 124
loops and ``pubmed.mtx`` 3 loops: these are the edge counts of DGL's citation datasets for
CiteSeer (9,228) and PubMed (88,651), and Cora's 10,556 plus 2,708 loops. ``"remove"`` drops all
loops, ``"add"`` leaves exactly one loop on every node (``A - diag(A) + I``, as GCN uses).
"""
import pickle
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

_FILES = {
    "cora": ("mtx", "graphs/cora.mtx"),
    "citeseer": ("mtx", "graphs/citeseer.mtx"),
    "pubmed": ("mtx", "graphs/pubmed.mtx"),
    "github-social": ("csv", "graphs/github-social.edges.csv"),
    "deezer-europe": ("csv", "graphs/deezer-europe.edges.csv"),
    "astro-ph": ("metis", "graphs/astro-ph.metis"),
    "pgp-giantcompo": ("metis", "graphs/pgp-giantcompo.metis"),
    "us-power-grid": ("metis", "graphs/us-power-grid.metis"),
    "wing-mesh": ("metis", "graphs/wing-mesh.metis"),
}

GRAPHS = list(_FILES)
PLANETOID = ["cora", "citeseer"]


def _path(rel):
    path = DATA_DIR / rel
    if not path.is_file():
        raise FileNotFoundError(f"granii: data file {path} is missing (see data/PROVENANCE.md)")
    return path


def _data_lines(path):
    """Non-comment lines of a text file (``%`` starts a comment line), newlines stripped."""
    with open(path) as f:
        return [line for line in f.read().splitlines() if not line.lstrip().startswith("%")]


def from_edges(u, v, num_nodes, symmetric=False, self_loops="keep"):
    """A DGL graph (int64) from edge arrays, deduplicated.

    ``symmetric``: add ``v -> u`` for each ``u -> v``. ``self_loops``: ``"keep"``, ``"remove"``,
    or ``"add"`` (exactly one loop per node). Edges are ordered by ``(src, dst)``.
    """
    import dgl
    u = np.asarray(u, dtype=np.int64)
    v = np.asarray(v, dtype=np.int64)
    if self_loops not in ("keep", "remove", "add"):
        raise ValueError(f"granii: self_loops must be keep, remove or add, got {self_loops!r}")
    if symmetric:
        u, v = np.concatenate([u, v]), np.concatenate([v, u])
    if self_loops != "keep":
        keep = u != v
        u, v = u[keep], v[keep]
    if self_loops == "add":
        loop = np.arange(num_nodes, dtype=np.int64)
        u, v = np.concatenate([u, loop]), np.concatenate([v, loop])
    key = np.unique(u * num_nodes + v)
    src, dst = torch.from_numpy(key // num_nodes), torch.from_numpy(key % num_nodes)
    return dgl.graph((src, dst), num_nodes=num_nodes, idtype=torch.int64)


def read_mtx(path):
    """``(u, v, n, symmetric)`` from a MatrixMarket coordinate file.

    Ids become 0-based; values are ignored."""
    with open(path) as f:
        banner = f.readline().lower().split()
    if len(banner) < 5 or banner[0] != "%%matrixmarket" or banner[2] != "coordinate":
        raise ValueError(f"granii: {path} is not a MatrixMarket coordinate file")
    lines = _data_lines(path)
    rows, cols, nnz = (int(t) for t in lines[0].split()[:3])
    body = lines[1:1 + nnz]
    width = len(body[0].split()) if body else 2
    entries = np.array(" ".join(body).split(), dtype=np.float64).reshape(-1, width)
    if len(entries) != nnz:
        raise ValueError(f"granii: {path} announces {nnz} entries, holds {len(entries)}")
    i = entries[:, 0].astype(np.int64) - 1
    j = entries[:, 1].astype(np.int64) - 1
    return i, j, max(rows, cols), banner[4] in ("symmetric", "skew-symmetric", "hermitian")


def read_edge_csv(path):
    """``(u, v, n)`` from a CSV with a header line and two integer id columns.

    ``n = max id + 1``."""
    e = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    return e[:, 0], e[:, 1], int(e.max()) + 1 if len(e) else 0


def read_metis(path):
    """``(u, v, n)`` from a METIS graph file: header ``n m [fmt [ncon]]``, then line ``i`` lists the
    1-based neighbours of node ``i`` (after optional vertex sizes/weights, with edge weights
    interleaved if ``fmt`` says so). Each undirected edge appears in both endpoint lists."""
    lines = _data_lines(path)
    head = lines[0].split()
    n, m = int(head[0]), int(head[1])
    fmt = head[2].zfill(3) if len(head) > 2 else "000"
    ncon = int(head[3]) if len(head) > 3 else 1
    skip = (fmt[0] == "1") + ncon * (fmt[1] == "1")
    stride = 2 if fmt[2] == "1" else 1
    body = lines[1:1 + n]
    body += [""] * (n - len(body))
    if skip == 0 and stride == 1:
        counts = np.fromiter((len(line.split()) for line in body), dtype=np.int64, count=n)
        nbrs = np.array(" ".join(body).split(), dtype=np.int64)
    else:
        lists = [line.split()[skip::stride] for line in body]
        counts = np.array([len(x) for x in lists], dtype=np.int64)
        nbrs = np.array([t for x in lists for t in x], dtype=np.int64)
    if len(nbrs) != 2 * m:
        raise ValueError(f"granii: {path} announces {m} edges, lists {len(nbrs)} endpoints")
    return np.repeat(np.arange(n, dtype=np.int64), counts), nbrs - 1, n


def load_graph(name, self_loops="keep"):
    """The shipped graph ``name`` (one of ``GRAPHS``) as a DGL graph with both edge directions.

    ``self_loops``: ``"keep"`` (as in the file), ``"remove"`` or ``"add"`` (one per node).
    """
    if name not in _FILES:
        raise KeyError(f"granii: unknown graph {name!r}; known: {', '.join(GRAPHS)}")
    kind, rel = _FILES[name]
    path = _path(rel)
    if kind == "mtx":
        u, v, n, symmetric = read_mtx(path)
        return from_edges(u, v, n, symmetric=symmetric, self_loops=self_loops)
    if kind == "csv":
        u, v, n = read_edge_csv(path)
        return from_edges(u, v, n, symmetric=True, self_loops=self_loops)
    u, v, n = read_metis(path)
    return from_edges(u, v, n, symmetric=False, self_loops=self_loops)


def _load_pickle(path):
    # Python-2 pickles of scipy matrices name the deprecated ``scipy.sparse.csr`` module.
    with open(path, "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pickle.load(f, encoding="latin1")


def _row_normalize(x):
    """``D^{-1} X`` with ``D = diag(X 1)``; all-zero rows stay zero."""
    rowsum = np.asarray(x.sum(1)).ravel()
    inv = np.divide(1.0, rowsum, out=np.zeros_like(rowsum, dtype=np.float64), where=rowsum != 0)
    return sp.diags(inv) @ x


def load_planetoid(name, normalize_features=True, self_loops="keep"):
    """Cora or CiteSeer with features, labels and the standard Planetoid split (Kipf & Welling).

    Returns ``(g, features, labels, train_mask, val_mask, test_mask)``; ``features`` float32
    ``(N, F)``, ``labels`` int64 ``(N,)``, masks bool ``(N,)``.

    Node ``i < len(allx)`` takes row ``i`` of ``allx``/``ally``; the test rows ``tx``/``ty`` go to
    the ids of ``ind.<name>.test.index``. Train = the first ``len(y)`` nodes, validation the next
    500, test the (sorted) test indices. CiteSeer's test indices skip 15 ids (isolated nodes absent
    from ``tx``): as in Kipf's code they get zero feature rows and label 0 (argmax of a zero row),
    and belong to no split. ``normalize_features`` divides each row by its sum, as DGL does.

    The graph is ``ind.<name>.graph`` made symmetric with duplicates dropped and node ids in sorted
    order, as DGL's ``CitationGraphDataset``; its self-loops (none in Cora, 124 in CiteSeer) are
    kept by default like DGL, giving Cora 2,708 nodes / 10,556 edges and CiteSeer 3,327 / 9,228.
    """
    if name not in PLANETOID:
        raise KeyError(f"granii: no Planetoid split for {name!r}; known: {', '.join(PLANETOID)}")
    obj = {k: _load_pickle(_path(f"planetoid/ind.{name}.{k}"))
           for k in ("x", "y", "tx", "ty", "allx", "ally", "graph")}
    test_order = np.loadtxt(_path(f"planetoid/ind.{name}.test.index"), dtype=np.int64, ndmin=1)
    test_sorted = np.sort(test_order)

    tx, ty = sp.csr_matrix(obj["tx"]), np.asarray(obj["ty"])
    lo, hi = int(test_sorted[0]), int(test_sorted[-1])
    if hi - lo + 1 != len(test_sorted):
        tx_full = sp.lil_matrix((hi - lo + 1, tx.shape[1]), dtype=tx.dtype)
        tx_full[test_sorted - lo, :] = tx
        ty_full = np.zeros((hi - lo + 1, ty.shape[1]), dtype=ty.dtype)
        ty_full[test_sorted - lo, :] = ty
        tx, ty = tx_full.tocsr(), ty_full

    features = sp.vstack([sp.csr_matrix(obj["allx"]), tx]).tocsr()
    onehot = np.vstack([np.asarray(obj["ally"]), ty])
    # Rows are stacked in test-file order after allx; move them to their node ids.
    perm = np.arange(features.shape[0])
    perm[test_order] = test_sorted
    features, onehot = features[perm], onehot[perm]
    if normalize_features:
        features = _row_normalize(features)
    n = features.shape[0]

    adj = obj["graph"]
    src = np.fromiter((k for k, vs in adj.items() for _ in vs), dtype=np.int64)
    dst = np.fromiter((w for vs in adj.values() for w in vs), dtype=np.int64)
    n = max(n, int(max(adj)) + 1, int(dst.max()) + 1 if len(dst) else 0)
    g = from_edges(src, dst, n, symmetric=True, self_loops=self_loops)

    def mask(idx):
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.as_tensor(idx, dtype=torch.int64)] = True
        return m

    num_train = len(obj["y"])
    return (
        g,
        torch.from_numpy(np.asarray(features.todense(), dtype=np.float32)),
        torch.from_numpy(onehot.argmax(1).astype(np.int64)),
        mask(np.arange(num_train)),
        mask(np.arange(num_train, num_train + 500)),
        mask(test_sorted),
    )
