"""Softmax of edge scores over the in-edges of each destination."""
import torch

from granii.kernels.registry import register


@register("edge_softmax", "dgl")
def edge_softmax_dgl(gi, e):
    """``a_e = exp(e_e) / sum_{e' = (u' -> v)} exp(e_e')`` for ``e = u -> v``; ``e`` of shape ``(E, ...)``."""
    import dgl
    return dgl.ops.edge_softmax(gi.g, e)


@register("edge_softmax", "torch")
def edge_softmax_torch(gi, e):
    """``a_e = exp(e_e - m_v) / sum_{e' -> v} exp(e_e' - m_v)`` with ``m_v = max_{e' -> v} e_e'``.

    ``m_v`` only stabilises the exponent and cancels in the quotient, so it is detached.
    """
    dst = gi.edges()[1]
    shape = (gi.num_dst,) + tuple(e.shape[1:])
    m = e.new_zeros(shape).index_reduce_(0, dst, e.detach(), "amax", include_self=False)
    ex = torch.exp(e - m[dst])
    s = e.new_zeros(shape).index_add(0, dst, ex)
    return ex / s[dst]
