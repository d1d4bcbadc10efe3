"""Generated stand-ins for the RGCN entity-classification benchmarks (AIFB, MUTAG, BGS, AM).

The real graphs cannot be downloaded here. ``generate(name)`` builds a knowledge graph with the
*published* statistics of Schlichtkrull et al. (2018), Table 1 (entities, edges, relations);
node-type counts are our assumption (the paper does not give them). These are generated graphs
with published statistics, not the datasets: results on them say how the layer behaves at those
sizes and skews, not what it does on the real data.

How a relation's edges are drawn (a knowledge graph's shape):

- relation sizes follow a Zipf law over relations (exponent ``skew``): a few relations (type,
  label, part-of) hold most edges, many hold a handful;
- each relation joins a source node type to a destination node type; its edges come from
  *subjects* drawn uniformly from the source type, each with ``1 + Geometric`` objects (most
  relations are nearly functional), and *objects* drawn from the destination type with Zipf
  popularity (a few classes and values are shared by many subjects);
- duplicate triples are dropped.

With ``inverse=True`` (what the RGCN model uses) each relation also gets its inverse, so ``2 R``
relation types and about ``2 E`` edges. Forward relations then have about one distinct
(source, relation) pair per edge and inverse ones far fewer (a popular object is the source of
many inverse edges): the ratio of distinct (source, relation) pairs to edges ends up between the
two, as in real knowledge graphs. ``stats`` reports it.

Nodes have no features (as in these benchmarks): RGCN learns an embedding per node, and so do
the benchmark and tests (an ``nn.Embedding`` table as the first layer's input).
"""
import numpy as np
import torch

# name: (entities, edges, relations) as published; node types: assumed
PUBLISHED = {
    "aifb": (8285, 29043, 45),
    "mutag": (23644, 74227, 23),
    "bgs": (333845, 916199, 103),
    "am": (1666764, 5988321, 133),
}
NODE_TYPES = {"aifb": 7, "mutag": 5, "bgs": 27, "am": 7}


def generate(name, scale=1.0, seed=0, inverse=True, skew=1.1):
    """A ``dgl.heterograph`` with the published counts of ``name`` (times ``scale``: tests use
    small ones). Node types ``t0..``, relations ``r0..`` (and ``r0-inv..``)."""
    import dgl
    n_ent, n_edge, n_rel = PUBLISHED[name]
    n_ent, n_edge = max(int(n_ent * scale), 20), max(int(n_edge * scale), 40)
    rng = np.random.default_rng(seed)
    T = NODE_TYPES[name]
    share = 1.0 / np.arange(1, T + 1) ** 0.8
    sizes = np.maximum((share / share.sum() * n_ent).astype(int), 2)
    rel_share = 1.0 / np.arange(1, n_rel + 1) ** skew
    # about a tenth of the drawn triples are duplicates, dropped below: draw that many more
    m = np.maximum((rel_share / rel_share.sum() * n_edge * 1.12).astype(int), 1)
    data = {}
    for r in range(n_rel):
        s, d = int(rng.integers(T)), int(rng.integers(T))
        ns, nd = int(sizes[s]), int(sizes[d])
        per_subject = 1 + rng.geometric(0.6, size=m[r]) - 1
        subjects = rng.integers(0, ns, size=max(1, int(np.ceil(m[r] / per_subject.mean()))))
        u = rng.choice(subjects, size=m[r])
        pop = 1.0 / np.arange(1, nd + 1) ** 1.1
        perm = rng.permutation(nd)
        v = perm[rng.choice(nd, size=m[r], p=pop / pop.sum())]
        uv = np.unique(np.stack([u, v], 1), axis=0)
        u, v = torch.from_numpy(uv[:, 0]), torch.from_numpy(uv[:, 1])
        data[(f"t{s}", f"r{r}", f"t{d}")] = (u, v)
        if inverse:
            data[(f"t{d}", f"r{r}-inv", f"t{s}")] = (v, u)
    return dgl.heterograph(data, num_nodes_dict={f"t{i}": int(n) for i, n in enumerate(sizes)})


def relational(hg, shuffle=False, seed=0):
    """``(g, etypes)``: the homogeneous graph RGCN runs on (``dgl.to_homogeneous``: edges sorted
    by relation, so ``presorted=True`` is valid) and its edge types; ``shuffle`` permutes the
    edges (then only ``presorted=False`` is valid)."""
    import dgl
    g = dgl.to_homogeneous(hg)
    etypes = g.edata[dgl.ETYPE].long()
    if shuffle:
        perm = torch.from_numpy(np.random.default_rng(seed).permutation(g.num_edges()))
        u, v = g.edges(order="eid")
        g = dgl.graph((u[perm], v[perm]), num_nodes=g.num_nodes())
        etypes = etypes[perm]
    return dgl.graph(g.edges(order="eid"), num_nodes=g.num_nodes()), etypes


def stats(g, etypes):
    """Nodes, edges, relations, distinct (source, relation) and (destination, relation) pairs
    per edge, and the share of edges held by the 5 largest relations."""
    u, v = g.edges(order="eid")
    r = etypes.long()
    n = g.num_nodes()
    counts = torch.bincount(r).sort(descending=True).values
    e = max(g.num_edges(), 1)
    return {"nodes": n, "edges": g.num_edges(), "relations": int(counts.numel()),
            "src_pairs_per_edge": torch.unique(r * n + u.long()).numel() / e,
            "dst_pairs_per_edge": torch.unique(r * n + v.long()).numel() / e,
            "top5_share": counts[:5].sum().item() / e}
