"""Synthetic graphs for the cost-model training corpus and for large benchmark inputs.

Every generator is a plain function of sizes and a seed that returns a ``dgl.DGLGraph`` with int64
ids; the same arguments give the same graph. Generation is vectorised (numpy): a 10 M-edge graph
takes seconds. Edges ``u -> v`` of an undirected graph are stored in both directions.

Common options (where they make sense): ``undirected`` adds ``v -> u`` for every ``u -> v``;
``remove_self_loops`` drops ``u -> u``; ``dedupe`` keeps one copy of repeated ``u -> v`` (edges are
then ordered by ``(src, dst)``). ``simplify`` applies the same options to any graph.

``corpus(kind, seed)`` yields ``(name, factory)`` pairs; ``build(name)`` rebuilds a graph from its
name alone, so a profiling run can be resumed or a single point reproduced.
"""
import math
from functools import partial

import numpy as np
import torch

from granii.reference import make_graph, uniform  # noqa: F401  (the corpus's uniform family)


def simplify(g, undirected=False, remove_self_loops=True, dedupe=True):
    """``g`` (homogeneous) with the common options applied; node and edge data are dropped."""
    u, v = g.edges()
    return make_graph(u.numpy(), v.numpy(), g.num_nodes(), undirected, remove_self_loops, dedupe)


def rmat(scale, edge_factor=16, a=0.57, b=0.19, c=0.19, seed=0, undirected=True, permute=True,
         remove_self_loops=True, dedupe=True):
    """R-MAT (recursive matrix / stochastic Kronecker) power-law graph on ``n = 2**scale`` nodes.

    Each of ``m = edge_factor * n`` edges picks its cell of the ``n x n`` adjacency matrix by
    ``scale`` independent quadrant choices: top-left with probability ``a``, top-right ``b``,
    bottom-left ``c``, bottom-right ``d = 1 - a - b - c``; level ``l`` fixes bit ``scale-1-l`` of
    ``(src, dst)``. So ``P(u -> v) = a^{#(0,0)} b^{#(0,1)} c^{#(1,0)} d^{#(1,1)}`` over the bit
    pairs of ``(u, v)``: degrees follow a heavy-tailed (log-normal / power-law like) law whose
    skew grows with ``a / d``. Defaults are Graph500's. ``permute`` relabels nodes by a random
    permutation (as Graph500 does) so degree does not follow id. After ``dedupe`` and loop
    removal the graph has fewer than ``m`` (``2m`` if undirected) edges.
    """
    d = 1.0 - a - b - c
    if min(a, b, c, d) < -1e-9:
        raise ValueError("granii: rmat needs a, b, c >= 0 and a + b + c <= 1")
    n = 1 << scale
    m = int(edge_factor * n)
    rng = np.random.default_rng(seed)
    u = np.zeros(m, dtype=np.int64)
    v = np.zeros(m, dtype=np.int64)
    ab, abc = a + b, a + b + c
    for _ in range(scale):
        r = rng.random(m, dtype=np.float32)
        u <<= 1
        v <<= 1
        u |= r >= ab
        v |= ((r >= a) & (r < ab)) | (r >= abc)
    if permute:
        perm = rng.permutation(n)
        u, v = perm[u], perm[v]
    return make_graph(u, v, n, undirected, remove_self_loops, dedupe)


def grid2d(rows, cols, undirected=True):
    """The ``rows x cols`` 4-neighbour lattice; node ``(r, c)`` has id ``r * cols + c``.

    Undirected edges: ``rows (cols - 1)`` horizontal plus ``(rows - 1) cols`` vertical. Degrees: 4
    inside, 3 on the border, 2 at the corners. ``undirected=False`` keeps only right/down edges.
    """
    ids = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    u = np.concatenate([ids[:, :-1].ravel(), ids[:-1, :].ravel()])
    v = np.concatenate([ids[:, 1:].ravel(), ids[1:, :].ravel()])
    return make_graph(u, v, rows * cols, undirected, remove_self_loops=False, dedupe=False)


def road_like(n, seed=0, p_remove=0.3, shortcut_frac=0.02, reach=8, long_frac=0.1, undirected=True):
    """A road-network-like graph: sparse (average degree about 3), planar-ish, high id locality.

    Nodes are the first ``n`` cells of a ``rows x cols`` grid (``rows = round(sqrt(n))``, row-major
    ids). Each 4-neighbour grid edge is dropped with probability ``p_remove``. Then
    ``shortcut_frac * n`` shortcuts join a random node to one within ``reach`` rows and columns
    (local roads), and a ``long_frac`` share of them to a uniformly random node (highways).
    """
    rng = np.random.default_rng(seed)
    rows = max(1, int(round(math.sqrt(n))))
    cols = -(-n // rows)
    ids = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    u = np.concatenate([ids[:, :-1].ravel(), ids[:-1, :].ravel()])
    v = np.concatenate([ids[:, 1:].ravel(), ids[1:, :].ravel()])
    keep = (v < n) & (rng.random(len(u)) >= p_remove)
    u, v = u[keep], v[keep]
    s = int(shortcut_frac * n)
    a = rng.integers(0, n, s)
    dr, dc = rng.integers(-reach, reach + 1, (2, s))
    r = np.clip(a // cols + dr, 0, rows - 1)
    c = np.clip(a % cols + dc, 0, cols - 1)
    b = r * cols + c
    far = rng.random(s) < long_frac
    b[far] = rng.integers(0, n, int(far.sum()))
    ok = b < n
    u, v = np.concatenate([u, a[ok]]), np.concatenate([v, b[ok]])
    return make_graph(u, v, n, undirected, remove_self_loops=True, dedupe=True)


def sbm(block_sizes, p_in, p_out, seed=0, undirected=True, permute=False):
    """Stochastic block model: blocks of the given sizes (contiguous ids unless ``permute``); a pair
    in the same block ``i`` is an edge with probability ``p_in`` (scalar or per block), a pair
    across blocks with probability ``p_out``, all independently (pairs unordered if ``undirected``).

    Sampling is exact and sparse, without a dense matrix: give every ordered pair an independent
    ``Poisson(lam)`` count with ``1 - exp(-lam) = p`` (halved per ordered pair when undirected, so
    each unordered pair gets ``Poisson(-ln(1 - p))``) and keep the pairs with a nonzero count. A
    block's total count is ``Poisson(n_i^2 lam_i)`` and its pairs are uniform; cross-block pairs are
    drawn uniformly over all ``N^2`` pairs with ``lam_out`` and the same-block ones discarded.
    """
    sizes = np.asarray(block_sizes, dtype=np.int64)
    n = int(sizes.sum())
    p_in = np.broadcast_to(np.asarray(p_in, dtype=np.float64), sizes.shape)
    if np.any(p_in >= 1) or p_out >= 1:
        raise ValueError("granii: sbm probabilities must be below 1")
    half = 0.5 if undirected else 1.0
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    lam_in = -np.log1p(-p_in) * half
    counts = rng.poisson(lam_in * sizes.astype(np.float64) ** 2)
    blk = np.repeat(np.arange(len(sizes)), counts)
    u_in = starts[blk] + (rng.random(len(blk)) * sizes[blk]).astype(np.int64)
    v_in = starts[blk] + (rng.random(len(blk)) * sizes[blk]).astype(np.int64)
    lam_out = -math.log1p(-p_out) * half
    k = rng.poisson(lam_out * float(n) ** 2)
    u_out = rng.integers(0, n, k)
    v_out = rng.integers(0, n, k)
    block_of = np.repeat(np.arange(len(sizes)), sizes)
    cross = block_of[u_out] != block_of[v_out]
    u = np.concatenate([u_in, u_out[cross]])
    v = np.concatenate([v_in, v_out[cross]])
    if permute:
        perm = rng.permutation(n)
        u, v = perm[u], perm[v]
    return make_graph(u, v, n, undirected, remove_self_loops=True, dedupe=True)


def community(n, blocks, degree, mix=0.9, seed=0, undirected=True, permute=False):
    """An ``sbm`` with ``blocks`` blocks of random sizes and expected degree ``degree``, a share
    ``mix`` of each node's edges inside its block.

    Block sizes are proportional to ``Dirichlet(2, ..., 2)`` draws (each at least 2 nodes). A node
    sits in a block of mean size ``s = sum_i n_i^2 / n``, so ``p_in = mix * degree / s`` and
    ``p_out = (1 - mix) * degree / (n - s)`` (both capped below 1) give mean degree ``degree``.
    """
    rng = np.random.default_rng(seed)
    share = rng.dirichlet(np.full(blocks, 2.0))
    sizes = np.maximum(2, np.floor(share * (n - 2 * blocks)).astype(np.int64) + 2)
    sizes[-1] += n - sizes.sum()
    if sizes[-1] < 1:
        raise ValueError(f"granii: community({n}, {blocks}) has too many blocks for its nodes")
    s = float((sizes.astype(np.float64) ** 2).sum()) / n
    p_in = min(mix * degree / s, 0.99)
    p_out = min((1 - mix) * degree / max(n - s, 1.0), 0.99)
    return sbm(sizes, p_in, p_out, seed=seed + 1, undirected=undirected, permute=permute)


def mycielskian(k, undirected=True):
    """The Mycielski graph ``M_k`` (``k >= 2``) with SuiteSparse's numbering.

    ``M_2 = K_2``. From ``M_k`` with adjacency ``A`` (``n`` nodes, ``m`` undirected edges),
    ``M_{k+1}`` has adjacency ``[[A, A, 0], [A, 0, 1], [0, 1^T, 0]]``: the old nodes ``v_i`` (ids
    ``0..n-1``), a copy ``u_i`` (id ``n + i``) joined to the neighbours of ``v_i``, and one node
    ``w`` (id ``2n``) joined to every ``u_i``. So ``n' = 2n + 1`` and ``m' = 3m + n``: ``M_3`` is
    the 5-cycle, ``M_4`` the Grötzsch graph (11, 20), ``M_17`` has 98,303 nodes and 50,122,871
    edges. The graphs are triangle-free with chromatic number ``k``. Stored in both directions
    unless ``undirected`` is false (then once each, in construction order). No duplicates or
    loops arise.
    """
    if k < 2:
        raise ValueError("granii: mycielskian needs k >= 2")
    a = np.array([1], dtype=np.int64)
    b = np.array([0], dtype=np.int64)
    n = 2
    for _ in range(k - 2):
        w = 2 * n
        copies = np.arange(n, 2 * n, dtype=np.int64)
        a, b = (np.concatenate([a, a + n, b + n, np.full(n, w, dtype=np.int64)]),
                np.concatenate([b, b, a, copies]))
        n = 2 * n + 1
    return make_graph(a, b, n, undirected, remove_self_loops=False, dedupe=False)


def mycielskian_size(k):
    """``(nodes, undirected edges)`` of ``M_k`` from the recurrence ``(2n + 1, 3m + n)``."""
    n, m = 2, 1
    for _ in range(k - 2):
        n, m = 2 * n + 1, 3 * m + n
    return n, m


def _sample_in_neighbours(indptr, indices, frontier, fanout, rng):
    """Up to ``fanout`` in-neighbours of each frontier node, uniformly without replacement.

    Each candidate edge of a row gets a uniform key; a row keeps its ``fanout`` smallest keys.
    Returns ``(src, dst)`` node ids.
    """
    lo, hi = indptr[frontier], indptr[frontier + 1]
    deg = hi - lo
    total = int(deg.sum())
    row = np.repeat(np.arange(len(frontier)), deg)
    row_start = np.cumsum(deg) - deg
    pos = np.arange(total) - row_start[row]
    order = np.lexsort((rng.random(total), row))
    rank = np.arange(total) - row_start[row[order]]
    chosen = order[rank < fanout]
    return indices[lo[row[chosen]] + pos[chosen]], frontier[row[chosen]]


def sample_subgraph(g, fraction=None, num_seeds=None, fanout=None, seed=0, block=False,
                    undirected=False):
    """A subgraph of ``g`` around random seed nodes (``num_seeds``, or ``fraction`` of the nodes).

    Without ``fanout``: the node-induced subgraph on the seeds (ids relabelled in sorted order), so
    a fraction ``f`` keeps about ``f^2`` of the edges. With ``fanout`` (an int, or one int per hop):
    neighbour sampling as in mini-batch GNN training: hop ``h`` takes up to ``fanout[h]`` random
    in-neighbours ``u -> v`` of each node reached in the previous hop; the result holds the sampled
    edges on the reached nodes (seeds first, then nodes in order of discovery). ``block=True``
    (single hop) returns that hop as a DGL block instead: destinations are the seeds, sources the
    seeds followed by the new neighbours, as ``dgl.to_block`` lays them out. The ids of the
    sampled nodes in ``g`` are in ``ndata[dgl.NID]`` (``srcdata``/``dstdata`` for a block).
    """
    import dgl
    n = g.num_nodes()
    rng = np.random.default_rng(seed)
    k = num_seeds if num_seeds is not None else int(round(fraction * n))
    seeds = np.sort(rng.choice(n, size=min(k, n), replace=False)).astype(np.int64)
    if fanout is None:
        if block:
            raise ValueError("granii: block=True needs a fanout")
        new_id = np.full(n, -1, dtype=np.int64)
        new_id[seeds] = np.arange(len(seeds))
        u, v = (t.numpy() for t in g.edges())
        keep = (new_id[u] >= 0) & (new_id[v] >= 0)
        sub = make_graph(new_id[u[keep]], new_id[v[keep]], len(seeds), undirected,
                         remove_self_loops=False, dedupe=False)
        sub.ndata[dgl.NID] = torch.from_numpy(seeds)
        return sub
    fanouts = [fanout] if np.isscalar(fanout) else list(fanout)
    if block and len(fanouts) != 1:
        raise ValueError("granii: block=True samples a single hop")
    indptr, indices, _ = (t.numpy().astype(np.int64) for t in g.adj_tensors("csc"))
    new_id = np.full(n, -1, dtype=np.int64)
    new_id[seeds] = np.arange(len(seeds))
    reached = len(seeds)
    frontier = seeds
    us, vs = [], []
    for f in fanouts:
        u, v = _sample_in_neighbours(indptr, indices, frontier, int(f), rng)
        us.append(u)
        vs.append(v)
        fresh = _first_unique(u[new_id[u] < 0])
        new_id[fresh] = np.arange(reached, reached + len(fresh))
        reached += len(fresh)
        frontier = fresh
    u, v = new_id[np.concatenate(us)], new_id[np.concatenate(vs)]
    original = np.empty(reached, dtype=np.int64)
    original[new_id[new_id >= 0]] = np.flatnonzero(new_id >= 0)
    original = torch.from_numpy(original)
    if block:
        blk = dgl.create_block((torch.from_numpy(u), torch.from_numpy(v)), num_src_nodes=reached,
                               num_dst_nodes=len(seeds), idtype=torch.int64)
        blk.srcdata[dgl.NID] = original
        blk.dstdata[dgl.NID] = original[: len(seeds)]
        return blk
    sub = make_graph(u, v, reached, undirected, remove_self_loops=False, dedupe=undirected)
    sub.ndata[dgl.NID] = original
    return sub


def _first_unique(x):
    """Distinct values of ``x`` in order of first appearance."""
    _, first = np.unique(x, return_index=True)
    return x[np.sort(first)]


FAMILIES = {
    "rmat": rmat,
    "uniform": uniform,
    "grid2d": grid2d,
    "road": road_like,
    "community": community,
    "mycielskian": mycielskian,
}


def _fmt(value):
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return "/".join(_fmt(x) for x in value)
    if isinstance(value, float):
        return repr(round(value, 4))
    return str(value)


def _parse(text):
    if "/" in text:
        return [_parse(x) for x in text.split("/")]
    try:
        return int(text)
    except ValueError:
        return float(text)


def spec_name(family, **params):
    """``"family:key=value,..."``; a ``sample`` spec's ``base`` (another name) comes last."""
    base = params.pop("base", None)
    items = [f"{key}={_fmt(val)}" for key, val in params.items()]
    if base is not None:
        items.append(f"base={base}")
    return f"{family}:{','.join(items)}"


def parse_name(name):
    """``(family, params)`` of a ``spec_name``."""
    family, _, rest = name.partition(":")
    params = {}
    if family == "sample":
        rest, _, base = rest.partition("base=")
        rest = rest.rstrip(",")
        params["base"] = base
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        params[key] = _parse(val)
    return family, params


def build(name):
    """The graph a corpus name describes (e.g. ``"rmat:scale=12,edge_factor=8,...,seed=3"``)."""
    family, params = parse_name(name)
    if family == "sample":
        base = build(params.pop("base"))
        return sample_subgraph(base, **params)
    if family not in FAMILIES:
        raise KeyError(f"granii: unknown graph family {family!r}")
    return FAMILIES[family](**params)


def _spec_for(family, target, rng, seed, variant=0, max_base=2e7):
    """Parameters of ``family`` giving roughly ``target`` directed edges (``variant`` picks the
    kind of sampled subgraph: node-induced, one-hop block, two-hop subgraph)."""
    if family in ("rmat", "rmat-directed"):
        undirected = family == "rmat"
        ef = int(rng.choice([4, 8, 16, 32]))
        a = float(rng.choice([0.45, 0.57, 0.7]))
        b = c = round((1 - a) * float(rng.uniform(0.3, 0.45)), 4)
        scale = max(6, int(round(math.log2(target / (ef * (2 if undirected else 1))))))
        return "rmat", dict(scale=scale, edge_factor=ef, a=a, b=b, c=c, seed=seed,
                            undirected=undirected)
    if family in ("uniform", "uniform-directed"):
        undirected = family == "uniform"
        deg = float(rng.choice([2, 4, 8, 16, 32, 64]))
        n = max(64, int(target / deg))
        m = target // 2 if undirected else target
        m = min(m, n * (n - 1) // 4)
        return "uniform", dict(n=n, m=int(m), seed=seed, undirected=undirected)
    if family == "grid2d":
        side = math.sqrt(target / 4)
        aspect = float(rng.choice([1, 2, 8]))
        rows = max(2, int(side / math.sqrt(aspect)))
        return "grid2d", dict(rows=rows, cols=max(2, int(target / 4 / rows)))
    if family == "road":
        return "road", dict(n=max(64, int(target / 2.8)), seed=seed)
    if family == "community":
        deg = float(rng.choice([4, 10, 25, 60]))
        n = max(256, int(target / deg))
        blocks = int(min(rng.choice([4, 16, 64, 256]), n // 16))
        return "community", dict(n=n, blocks=max(blocks, 1), degree=deg,
                                 mix=float(rng.choice([0.6, 0.8, 0.95])), seed=seed,
                                 permute=bool(rng.random() < 0.3))
    if family == "sample":
        if variant % 3 == 0:
            frac = float(rng.choice([0.3, 0.5, 0.7]))
            base_family = str(rng.choice(["rmat", "community", "uniform", "road"]))
            fam, params = _spec_for(base_family, int(target / frac ** 2), rng, seed + 7)
            return "sample", dict(fraction=frac, seed=seed, base=spec_name(fam, **params))
        fan = int(rng.choice([5, 10, 25]))
        hops = [fan] if variant % 3 == 1 else [fan, max(2, fan // 2)]
        seeds = max(16, int(target / fan / (1 if len(hops) == 1 else 1 + hops[1])))
        deg = 2 * fan
        n = max(4 * seeds, int(min(4 * target, max_base / deg)))
        if rng.random() < 0.5:
            base = spec_name("community", n=n, blocks=64, degree=float(deg), mix=0.8,
                             seed=seed + 7, permute=True)
        else:
            base = spec_name("rmat", scale=int(math.log2(n)), edge_factor=deg // 2, a=0.57,
                             b=0.19, c=0.19, seed=seed + 7, undirected=True)
        return "sample", dict(num_seeds=seeds, fanout=hops, seed=seed, block=len(hops) == 1,
                              base=base)
    raise KeyError(family)


_CORPUS = {
    "quick": dict(lo=1e4, hi=5e5, per_family=3, sample_hi=5e5, max_base=4e6,
                  myc=(9, 10, 11, 12)),
    "full": dict(lo=1e4, hi=1e7, per_family=8, sample_hi=1e6, max_base=2e7,
                 myc=tuple(range(9, 16))),
}
_CORPUS_FAMILIES = ["rmat", "rmat-directed", "uniform", "uniform-directed", "grid2d", "road",
                    "community", "sample"]


def approx_size(name):
    """``(nodes, edges)`` a corpus name will roughly have, without building it."""
    fam, p = parse_name(name)
    two = lambda: 2 if p.get("undirected", 1) else 1
    if fam == "rmat":
        n = 2 ** p["scale"]
        return n, int(0.85 * two() * p.get("edge_factor", 16) * n)
    if fam == "uniform":
        return p["n"], two() * p["m"]
    if fam == "grid2d":
        return p["rows"] * p["cols"], 4 * p["rows"] * p["cols"]
    if fam == "road":
        return p["n"], int(2.8 * p["n"])
    if fam == "community":
        return p["n"], int(p["n"] * p["degree"])
    if fam == "mycielskian":
        n, m = mycielskian_size(p["k"])
        return n, 2 * m
    if fam == "sample":
        bn, be = approx_size(p["base"])
        seeds = p.get("num_seeds") or int(p["fraction"] * bn)
        fan = p.get("fanout")
        if fan is None:
            return seeds, int(be * (seeds / max(bn, 1)) ** 2)
        hops = [fan] if not isinstance(fan, list) else fan
        deg = be / max(bn, 1)
        e, frontier = 0, seeds
        for f in hops:
            e += frontier * min(f, deg)
            frontier = frontier * min(f, deg)
        return int(seeds + e), int(e)
    return 1000, 10000


def corpus(kind="quick", seed=0):
    """Yield ``(name, factory)`` for the training corpus; ``factory()`` builds the graph.

    Each family (R-MAT undirected and directed, uniform undirected and directed, grid, road-like,
    community SBM, sampled subgraphs and blocks of generated graphs) gets ``per_family`` target
    edge counts, log-uniform over ``[lo, hi]`` directed edges (``[1e4, 5e5]`` for ``"quick"``,
    ``[1e4, 1e7]`` for ``"full"``; sampled ones up to ``sample_hi``) with randomly chosen shape
    parameters; Mycielski graphs add the orders whose edge counts fall in range. Names come from
    ``spec_name`` and are rebuilt by ``build``; the list depends only on ``kind`` and ``seed``.
    """
    cfg = _CORPUS[kind]
    rng = np.random.default_rng(seed)
    for i, family in enumerate(_CORPUS_FAMILIES):
        hi = cfg["sample_hi"] if family == "sample" else cfg["hi"]
        edges = np.geomspace(cfg["lo"], hi, cfg["per_family"])
        jitter = rng.uniform(-0.15, 0.15, cfg["per_family"])
        for j, target in enumerate(edges * 10 ** jitter):
            point_seed = seed * 1000 + i * 100 + j
            fam, params = _spec_for(family, int(target), rng, point_seed, variant=j,
                                    max_base=cfg["max_base"])
            name = spec_name(fam, **params)
            yield name, partial(build, name)
    for k in cfg["myc"]:
        name = spec_name("mycielskian", k=k)
        yield name, partial(build, name)
