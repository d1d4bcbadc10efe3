"""Readouts: one row per graph of a batch, DGL's ``sum_nodes`` and ``mean_nodes``.

With ``R`` (G x N) holding a one at each node of each graph of the batch,

    readout_sum(X)  = R X
    readout_mean(X) = C^-1 R X        C = diag(node counts, clamped to 1)

so a graph without nodes reads 0, as DGL's ``segment_reduce`` gives. ``dgl.batch`` keeps the nodes
of graph ``b`` contiguous (rows ``offsets[b]:offsets[b+1]`` of ``X``), so ``R`` is the CSR with
row pointers ``offsets`` and column indices ``0 .. N-1``: the native SpMM sums each segment (a
tenth of DGL's readout call on a batch of small graphs), and the gradient ``R^T C^-1 dY`` copies
each graph's row of ``dY`` back to its nodes (``index_select`` by the graph of each node, found
once per batch), both in C++ (``granii::segment_sum``, ``csrc/readout.cpp``: no Python in the
forward or the backward). Without the native kernels, or for dtypes they do not take,
``index_add_`` computes the same sum.
"""
import torch

from granii.kernels import native
from granii.kernels.registry import register


def segments(gi):
    """``(counts, csr, graph_of_node)`` of ``gi``'s batch (``GraphInfo.segments``): ``csr``
    ``R``'s row pointers and column indices for the native SpMM (int32; the indices a view of
    one shared ``0, 1, 2, ...``), ``None`` without it; ``graph_of_node`` ``None`` where the
    segments did not come with it (``_graph_of_node`` makes it)."""
    counts, offsets, offsets32, graph_of_node = gi.segments()
    if offsets32 is None:
        return counts, None, None
    return counts, (offsets32, _iota(gi.num_src)), graph_of_node


_IOTA = [torch.arange(0, dtype=torch.int32)]


def _iota(n):
    """``0 .. n-1`` (int32), a view of one tensor grown as needed."""
    if _IOTA[0].numel() < n:
        _IOTA[0] = torch.arange(max(n, 2 * _IOTA[0].numel()), dtype=torch.int32)
    return _IOTA[0][:n]


def _graph_of_node(gi, counts):
    """The graph of each node of ``gi``'s batch (``R^T`` as an index: ``R^T dY = dY[graph]``),
    where the segments did not come with it, once per batch: the readouts after every layer of
    a model share it."""
    hit = gi.cache.get("readout_graph_of_node")
    if hit is None or hit[0] is not counts:
        hit = gi.cache["readout_graph_of_node"] = (
            counts, torch.repeat_interleave(torch.arange(counts.numel()), counts))
    return hit[1]


def _readout(gi, x, mean):
    counts, csr, graph_of_node = segments(gi)
    g = counts.numel()
    flat = x.reshape(x.shape[0], -1)
    scale = counts.to(x.dtype).clamp(min=1).reciprocal() if mean else None
    if (csr is not None and graph_of_node is not None
            and x.dtype in (torch.float32, torch.float64) and flat.shape[0] > 0
            and flat.shape[1] > 0):
        y = torch.ops.granii.segment_sum(flat, csr[0], csr[1], graph_of_node,
                                         None if scale is None else scale.contiguous())
    else:
        if graph_of_node is None:
            graph_of_node = _graph_of_node(gi, counts)
        y = flat.new_zeros((g, flat.shape[1])).index_add_(0, graph_of_node, flat)
        if scale is not None:
            y = y * scale.unsqueeze(1)
    return y.reshape(g, *x.shape[1:])


@register("readout_sum", "segment")
def readout_sum(gi, x):
    """``Y[b] = sum of X[v]`` over the nodes ``v`` of graph ``b``."""
    return _readout(gi, x, False)


@register("readout_mean", "segment")
def readout_mean(gi, x):
    """``Y[b] = mean of X[v]`` over the nodes of graph ``b``; 0 for a graph without nodes."""
    return _readout(gi, x, True)

