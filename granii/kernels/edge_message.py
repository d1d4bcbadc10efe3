"""Edge messages of node rows and edge features (``ir.EdgeMessage``): three primitives.

For each edge ``e = u -> v`` with ``a`` read at the source, ``b`` at the destination and ``c``
one row per edge (any of them ``None``), ``act`` ``None``, ``"relu"`` or ``"leaky_relu"``
(negative slope ``slope``)::

    edge_message(gi, a, b, c, act, slope)          M[e]    = act(a[u] + b[v] + c[e])     (E x K)
    edge_message_sum(gi, a, b, c, act, slope)      Y[v]    = sum_{e -> v} M[e]           (N x K)
    edge_message_score(gi, a, b, c, act, slope, d) S[e, h] = sum_f att[h, f] M[e, h F + f]
                                                   (E x H; ``d = blockdiag(att_1 .. att_H)``)

GINE's aggregation is ``edge_message_sum(x, None, lin(edge_attr), "relu")``; GATv2's scores
``edge_message_score(x_l, x_r, lin_edge(edge_attr), "leaky_relu", slope, blockdiag(att))``.

Implementations: ``"torch"`` (gathers, the sum, the activation, ``index_add`` / a product per
head: M is materialised, E x K) for every primitive and device; ``"native"`` (``csrc/
edge_message.cpp``, CPU, float32/float64) of the sum and the score: one pass over the rows of
``A``, M never stored; the backward recomputes the pre-activation, walks ``A`` for the gradients
of ``b``, ``c`` and ``att`` and ``A^T`` for that of ``a``.
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from granii.kernels import native
from granii.kernels.dense import head_blocks
from granii.kernels.registry import register

_ACTS = {None: 0, "relu": 1, "leaky_relu": 2}
AVAILABLE = native.AVAILABLE and hasattr(torch.ops.granii, "edge_message_sum")


def activation(p, act, slope):
    """``act(p)`` for an activation named as in the module docstring."""
    if act == "relu":
        return torch.relu(p)
    if act == "leaky_relu":
        return F.leaky_relu(p, slope)
    if act is None:
        return p
    raise ValueError(f"granii: edge message activation {act!r}")


def _pre(gi, a, b, c):
    """``a[u] + b[v] + c[e]`` per edge (E x K), in PyG's order of the terms."""
    src, dst = gi.edges()
    terms = [t for t in (a[src] if a is not None else None, b[dst] if b is not None else None, c)
             if t is not None]
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


@register("edge_message", "torch")
def edge_message_torch(gi, a, b, c, act, slope):
    """``M[e] = act(a[u] + b[v] + c[e])`` (E x K)."""
    return activation(_pre(gi, a, b, c), act, slope)


@register("edge_message_sum", "torch")
def edge_message_sum_torch(gi, a, b, c, act, slope):
    """``Y[v] = sum_{e -> v} act(a[u] + b[v] + c[e])`` by a materialised ``M`` and ``index_add``."""
    m = edge_message_torch(gi, a, b, c, act, slope)
    dst = gi.edges()[1]
    return m.new_zeros((gi.num_dst, m.shape[1])).index_add_(0, dst, m)


@register("edge_message_score", "torch")
def edge_message_score_torch(gi, a, b, c, act, slope, d):
    """``S[e, h] = sum_f att[h, f] act(a[u] + b[v] + c[e])[h F + f]`` (E x H)."""
    m = edge_message_torch(gi, a, b, c, act, slope)
    att = head_blocks(d)
    return (m.reshape(m.shape[0], att.shape[0], att.shape[1]) * att).sum(-1)


# -- native ----------------------------------------------------------------------------------------
def _csr(gi, which):
    idx = native.csr_index(gi, which)
    return idx.indptr, idx.indices, idx.eids


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c, gi, act, slope):
        ctx.save_for_backward(a, b, c)
        ctx.gi, ctx.act, ctx.slope = gi, act, slope
        k = next(t for t in (a, b, c) if t is not None).shape[1]
        return torch.ops.granii.edge_message_sum(*_csr(gi, "a"), a, b, c, act, slope, k)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        a, b, c = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        at = _csr(ctx.gi, "at") if need[0] else _csr(ctx.gi, "a")
        grads = torch.ops.granii.edge_message_sum_backward(
            *_csr(ctx.gi, "a"), *at, a, b, c, ctx.act, ctx.slope, dy.contiguous(), *need)
        return tuple(g if n else None for g, n in zip(grads, need)) + (None, None, None)


class _Score(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c, att, gi, act, slope):
        ctx.save_for_backward(a, b, c, att)
        ctx.gi, ctx.act, ctx.slope = gi, act, slope
        return torch.ops.granii.edge_message_score(*_csr(gi, "a"), a, b, c, act, slope, att)

    @staticmethod
    @once_differentiable
    def backward(ctx, ds):
        a, b, c, att = ctx.saved_tensors
        need = ctx.needs_input_grad[:4]
        at = _csr(ctx.gi, "at") if need[0] else _csr(ctx.gi, "a")
        grads = torch.ops.granii.edge_message_score_backward(
            *_csr(ctx.gi, "a"), *at, a, b, c, ctx.act, ctx.slope, att, ds.contiguous(), *need)
        return tuple(g if n else None for g, n in zip(grads, need)) + (None, None, None)


def _native_operands(gi, a, b, c):
    """``(a, b, c)`` contiguous, or ``None`` where the kernel does not apply (not CPU, not one
    float dtype, not two-dimensional)."""
    given = [t for t in (a, b, c) if t is not None]
    dtype = given[0].dtype
    if dtype not in (torch.float32, torch.float64) or any(
            t.dtype != dtype or t.device.type != "cpu" or t.dim() != 2 for t in given):
        return None
    return tuple(t.contiguous() if t is not None else None for t in (a, b, c))


def edge_message_sum_native(gi, a, b, c, act, slope):
    """``edge_message_sum`` by the native kernel (see the module docstring); the torch version
    where it does not apply."""
    ops = _native_operands(gi, a, b, c)
    if ops is None:
        return edge_message_sum_torch(gi, a, b, c, act, slope)
    return _Sum.apply(*ops, gi, _ACTS[act], float(slope))


def edge_message_score_native(gi, a, b, c, act, slope, d):
    """``edge_message_score`` by the native kernel; the torch version where it does not apply."""
    ops = _native_operands(gi, a, b, c)
    att = head_blocks(d)
    if ops is None or att.dtype != next(t for t in ops if t is not None).dtype:
        return edge_message_score_torch(gi, a, b, c, act, slope, d)
    return _Score.apply(*ops, att.contiguous(), gi, _ACTS[act], float(slope))


if AVAILABLE:
    register("edge_message_sum", "native")(edge_message_sum_native)
    register("edge_message_score", "native")(edge_message_score_native)
