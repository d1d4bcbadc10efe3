"""PyTorch Geometric's graph inputs as granii graphs.

PyG passes the graph to a layer in one of three forms:

    edge_index   LongTensor [2, E]: messages flow ``edge_index[0] -> edge_index[1]`` (source ->
                 target, PyG's default ``flow="source_to_target"``); edge ``e`` is column ``e``
    EdgeIndex    PyG's ``torch_geometric.EdgeIndex``, the same [2, E] tensor with metadata
    adj_t        a ``torch.sparse`` matrix (CSR or COO) of shape (N, N), rows = targets, columns =
                 sources: ``adj_t[v, u] = w`` for an edge ``u -> v``; edge ``e`` is its ``e``-th
                 stored entry (the row-major order of CSR), its value ``adj_t.values()[e]``

Each is the matrix ``A`` (N x N, ``A[v, u]`` for ``u -> v``) of granii's core, held as the core's
``IndexGraph`` (``granii.index_graph``): the source and target of every edge in PyG's edge order,
from which the per-graph structures DGL graphs get are built; no DGL object is involved.
Edge-value tensors at the kernel interface are in PyG's edge order.

``index_graph(graph_input, num_nodes)`` returns one ``IndexGraph`` per input tensor, reused while
the tensor is the same object with the same storage and version counter (an in-place edit bumps
it: the edited graph is a new graph, with new caches). ``derived(g, "remaining" | "add")`` is the
graph PyG's ``add_remaining_self_loops`` / ``add_self_loops`` make of it, once per graph (also
what ``remove_self_loops`` then ``add_self_loops`` make: "remaining"); ``"removed"`` is
``remove_self_loops`` alone.
"""
import weakref

import torch

from ..graph import graph_info
from ..index_graph import IndexGraph

__all__ = ["IndexGraph", "index_graph", "derived", "graph_info", "input_kind",
           "known_index_graph"]


def input_kind(graph_input):
    """``"edge_index"``, ``"EdgeIndex"`` or ``"adj_t"`` (a ``torch.sparse`` adjacency), or
    ``None`` for anything else."""
    if not isinstance(graph_input, torch.Tensor):
        return None
    if graph_input.layout in (torch.sparse_csr, torch.sparse_coo):
        return "adj_t"
    if graph_input.layout != torch.strided or graph_input.dim() != 2 or \
            graph_input.shape[0] != 2 or graph_input.dtype not in (torch.long, torch.int):
        return None
    return "EdgeIndex" if type(graph_input).__name__ == "EdgeIndex" else "edge_index"


def _make(graph_input, num_nodes, kind):
    if kind == "adj_t":
        if graph_input.shape[0] != graph_input.shape[1]:
            raise ValueError("granii: a sparse adjacency of shape "
                             f"{tuple(graph_input.shape)}; only square (N, N) ones are read")
        if graph_input.layout == torch.sparse_csr:
            indptr = graph_input.crow_indices()
            dst = torch.repeat_interleave(torch.arange(graph_input.shape[0],
                                                       device=indptr.device),
                                          indptr[1:] - indptr[:-1])
            src = graph_input.col_indices()
        else:
            a = graph_input.coalesce() if not graph_input.is_coalesced() else graph_input
            dst, src = a.indices()
            graph_input = a
        return IndexGraph(src, dst, graph_input.shape[0], kind,
                          graph_input.values().detach())
    plain = _plain(graph_input)
    return IndexGraph(plain[0], plain[1], num_nodes, kind)


def _plain(t):
    """The plain tensor of an ``EdgeIndex`` (its data), else ``t``."""
    return t.as_tensor() if type(t) is not torch.Tensor and hasattr(t, "as_tensor") else t


# id(input tensor) -> (weak reference, identity, IndexGraph)
_GRAPHS = {}


def _identity(t, num_nodes):
    if t.layout == torch.strided:
        base = _plain(t)
        return (base.data_ptr(), base._version, tuple(base.shape), base.stride(), num_nodes)
    return (id(t), t._version if not t.is_inference() else None, tuple(t.shape))


def index_graph(graph_input, num_nodes):
    """The ``IndexGraph`` of a PyG graph input (see the module docstring) whose features have
    ``num_nodes`` rows; the same object while the input is the same unchanged tensor."""
    kind = input_kind(graph_input)
    if kind is None:
        raise ValueError(f"granii: a graph given as {type(graph_input).__name__} "
                         f"{tuple(getattr(graph_input, 'shape', ()))}; PyG's edge_index [2, E], "
                         "EdgeIndex or a torch.sparse adjacency are read")
    if graph_input.is_inference():
        return _make(graph_input, num_nodes, kind)
    g = known_index_graph(graph_input, num_nodes)
    if g is not None:
        return g
    key = id(graph_input)
    g = _make(graph_input, num_nodes, kind)
    if key not in _GRAPHS:
        weakref.finalize(graph_input, _GRAPHS.pop, key, None)
    _GRAPHS[key] = (weakref.ref(graph_input), _identity(graph_input, num_nodes), g)
    return g


def known_index_graph(graph_input, num_nodes):
    """The ``IndexGraph`` ``index_graph`` made for this graph input while it is the same
    unchanged tensor, or ``None`` (not made yet, edited in place, not a graph input): a lookup
    that never builds one."""
    hit = _GRAPHS.get(id(graph_input))
    if hit is None or hit[0]() is not graph_input:
        return None
    try:
        return hit[2] if hit[1] == _identity(graph_input, num_nodes) else None
    except (RuntimeError, AttributeError):
        return None


def loop_positions(g):
    """``(kept, loops)``: the positions of ``g``'s edges that are not self loops (those PyG's
    ``add_remaining_self_loops`` and ``remove_self_loops`` keep, in order) and of those that are
    (whose values ``add_remaining_self_loops`` moves to its new loops), as index tensors made once
    per graph: a call gathers by them and reads no device value, as a boolean mask would on a
    GPU."""
    def compute():
        loop = g.src == g.dst
        return torch.nonzero(~loop).flatten(), torch.nonzero(loop).flatten()
    return graph_info(g).memo(("loop_positions",), compute)


def derived(g, how):
    """The ``IndexGraph`` of ``g`` with its self loops changed as PyG changes them, made once per
    graph and kept with it: ``"add"`` (``add_self_loops``: a loop on every node appended after
    every edge), ``"remaining"`` (``add_remaining_self_loops``: the existing loops dropped, then a
    loop on every node) or ``"removed"`` (``remove_self_loops``); the other edges in order."""
    if how is None:
        return g
    d = g.derived.get(how)
    if d is None:
        src, dst = g.src, g.dst
        if how != "add":
            kept, _ = loop_positions(g)
            src, dst = src.index_select(0, kept), dst.index_select(0, kept)
        if how != "removed":
            loop = torch.arange(g.n, device=g.src.device)
            src, dst = torch.cat([src, loop]), torch.cat([dst, loop])
        d = g.derived[how] = IndexGraph(src, dst, g.n, g.kind)
    return d
