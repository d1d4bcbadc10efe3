"""Seeded graphs and call inputs that the library itself times: the calibration's reference calls.

``uniform(n, m, seed)`` is the Erdős–Rényi graph ``G(n, m)`` (the profiler's corpus uses the same
generator, so a reference graph is one the cost models know); ``graph_inputs`` and
``dense_inputs`` build the arguments of one call of a primitive as the layers pass them: float
features, float edge values (a normalised adjacency) for ``spmm_weighted``, degree powers
``D^-1/2`` for ``sddmm_scale`` and ``spmm_norm``, ``(n, heads, 1)`` attention terms for
``sddmm_add`` and ``(E, heads, 1)`` scores for ``edge_softmax``. Same arguments, same values.
"""
import numpy as np
import torch


def make_graph(u, v, num_nodes, undirected=False, remove_self_loops=True, dedupe=True):
    """A graph on ``num_nodes`` nodes from edge arrays ``u -> v``: a DGL graph (int64) where DGL
    is installed, as the profiler's graphs are, else granii's ``IndexGraph`` of the same edges in
    the same order; ``undirected`` adds ``v -> u`` for each edge, ``dedupe`` keeps one copy of
    each (ordered by ``(src, dst)``)."""
    u = np.asarray(u, dtype=np.int64)
    v = np.asarray(v, dtype=np.int64)
    if undirected:
        u, v = np.concatenate([u, v]), np.concatenate([v, u])
    if remove_self_loops:
        keep = u != v
        u, v = u[keep], v[keep]
    if dedupe and len(u):
        key = np.unique(u * num_nodes + v)
        u, v = key // num_nodes, key % num_nodes
    src, dst = torch.from_numpy(u), torch.from_numpy(v)
    try:
        import dgl
    except ImportError:
        from .index_graph import IndexGraph
        return IndexGraph(src, dst, num_nodes)
    return dgl.graph((src, dst), num_nodes=num_nodes, idtype=torch.int64)


def uniform(n, m, seed=0, undirected=False):
    """Erdős–Rényi ``G(n, m)``: exactly ``m`` distinct non-loop edges, uniform over such sets.

    Directed: ``m`` ordered pairs ``u != v`` (``m <= n (n - 1)``); undirected: ``m`` unordered
    pairs stored both ways (``2m`` edges, ``m <= n (n - 1) / 2``). Degrees are ~ Poisson(m / n).
    Pairs are drawn with replacement, the first occurrence of each kept, and the deficit redrawn.
    """
    limit = n * (n - 1) // (2 if undirected else 1)
    if m > limit:
        raise ValueError(f"granii: uniform({n}, {m}) asks for more than the {limit} possible edges")
    rng = np.random.default_rng(seed)
    keys = np.empty(0, dtype=np.int64)
    while len(keys) < m:
        need = m - len(keys)
        draw = int(need * 1.1) + 16
        u = rng.integers(0, n, draw)
        v = rng.integers(0, n, draw)
        if undirected:
            u, v = np.minimum(u, v), np.maximum(u, v)
        new = (u * n + v)[u != v]
        keys = np.concatenate([keys, new])
        _, first = np.unique(keys, return_index=True)
        keys = keys[np.sort(first)][:m]
    return make_graph(keys // n, keys % n, n, undirected, remove_self_loops=False, dedupe=True)


def graph_inputs(prim, gi, sizes, seed=0, device=None):
    """Arguments after ``gi`` of a call of ``prim`` on ``gi`` with ``sizes`` (no grad), on
    ``device`` (drawn on the CPU, so a seed gives the same values on every device)."""
    args = _graph_inputs(prim, gi, sizes, seed)
    return args if device is None else _to(args, device)


def _to(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _graph_inputs(prim, gi, sizes, seed):
    gen_ = torch.Generator().manual_seed(seed)
    n_src, n_dst, e = gi.num_src, gi.num_dst, gi.num_edges
    if prim == "spmm_norm":
        x = torch.randn(n_src, sizes["k"], generator=gen_)
        d_dst = gi.in_degrees().clamp(min=1).pow(-0.5)
        d_src = gi.out_degrees().clamp(min=1).pow(-0.5)
        return (d_dst, d_src, x)
    if prim == "gat_aggregate":
        h, k = sizes["heads"], sizes["k"]
        return (torch.randn(n_src, h, 1, generator=gen_), torch.randn(n_dst, h, 1, generator=gen_),
                torch.randn(n_src, h, k // h, generator=gen_), 0.2)
    if prim == "spmm_heads":        # softmax-like edge values, one per head
        return (torch.rand(e, sizes["heads"], generator=gen_),
                torch.randn(n_src, sizes["k"], generator=gen_))
    if prim.startswith("spmm"):
        x = torch.randn(n_src, sizes["k"], generator=gen_)
        if prim == "spmm_weighted":
            d_in = gi.in_degrees().clamp(min=1).pow(-0.5)
            d_out = gi.out_degrees().clamp(min=1).pow(-0.5)
            src, dst = gi.edges()
            w = (d_in[dst] * d_out[src]).contiguous()
            return (w, x)
        return (x,)
    if prim == "sddmm_scale":
        d_dst = gi.in_degrees().clamp(min=1).pow(-0.5)
        d_src = gi.out_degrees().clamp(min=1).pow(-0.5)
        return (d_dst, None, d_src)
    h = sizes["heads"]
    if prim == "sddmm_add":
        return (torch.randn(n_src, h, 1, generator=gen_), torch.randn(n_dst, h, 1, generator=gen_))
    if prim == "edge_softmax":
        return (torch.randn(e, h, 1, generator=gen_),)
    raise KeyError(f"granii: no profiling inputs for {prim}")


def dense_inputs(prim, sizes, seed=0, device=None):
    """Arguments of a call of the dense primitive ``prim`` with ``sizes``, on ``device``."""
    args = _dense_inputs(prim, sizes, seed)
    return args if device is None else _to(args, device)


def _dense_inputs(prim, sizes, seed):
    gen_ = torch.Generator().manual_seed(seed)
    if prim == "gemm":
        return (torch.randn(sizes["m"], sizes["k"], generator=gen_),
                torch.randn(sizes["k"], sizes["n"], generator=gen_))
    if prim == "head_gemm":
        return (torch.randn(sizes["m"], sizes["heads"], sizes["k"], generator=gen_),
                torch.randn(sizes["k"], sizes["n"], generator=gen_))
    if prim == "head_dot":          # X, blockdiag(a_1 .. a_H)
        m, k, h = sizes["m"], sizes["k"], sizes["n"]
        a = torch.randn(h, k // h, generator=gen_)
        return (torch.randn(m, k, generator=gen_),
                torch.block_diag(*(a[i].unsqueeze(1) for i in range(h))))
    return (torch.rand(sizes["n"], generator=gen_) + 0.5,
            torch.randn(sizes["n"], sizes["k"], generator=gen_))
