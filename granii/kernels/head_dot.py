"""GAT's attention terms, one dot product per row and head: implementation ``"native"`` of
``head_dot`` (``csrc/head_dot.cpp``).

For ``X`` ``(n, H F)`` and ``d = blockdiag(a_1 .. a_H)`` ``(H F x H)``::

    Y[i, h]          = sum_f X[i, h F + f] a_h[f]       (forward: one read of X)
    dX[i, h F + f]   = dY[i, h] a_h[f]                   (backward: one pass over the rows
    da_h[f]          = sum_i dY[i, h] X[i, h F + f]       gives both)

torch's version (``dense.head_dot_torch``) writes an ``(n, H, F)`` product and sums it over
``f``; its backward writes another ``(n, H F)`` temporary for ``da`` and reduces it over the rows.
Measured inside granii's memory pool (``results/kernels/head_dot.md``, ``scripts/bench_head_dot``)
at the sizes of DGL's GAT examples, this kernel ran the forward 1.6-2.4x and forward + backward
1.4-2.6x faster. ``a`` is read as in torch's version (``head_blocks``), so the gradient reaches
the attention parameter.
"""
import torch

from granii.kernels import native
from granii.kernels.dense import head_blocks, head_dot_torch
from granii.kernels.registry import register

AVAILABLE = native.AVAILABLE and hasattr(torch.ops.granii, "head_dot")


class _HeadDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a):
        ctx.save_for_backward(x, a)
        return torch.ops.granii.head_dot(x, a)

    @staticmethod
    def backward(ctx, g):
        x, a = ctx.saved_tensors
        need_x, need_a = ctx.needs_input_grad[:2]
        dx, da = torch.ops.granii.head_dot_backward(g.contiguous(), x, a, need_x, need_a)
        return (dx if need_x else None), (da if need_a else None)


def head_dot_native(x, d):
    """``Y = X blockdiag(a_1 .. a_H)`` as ``head_dot_torch``, by the native kernel (see the
    module docstring); torch's version for one head (a matrix-vector product, whose backward is
    one too) and where the kernel does not apply (mixed dtypes)."""
    heads = d.shape[1]
    if heads == 1 or x.dtype != d.dtype or x.dtype not in (torch.float32, torch.float64):
        return head_dot_torch(x, d)
    a = head_blocks(d).contiguous()
    x = x.reshape(x.shape[0], d.shape[0]).contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or a.requires_grad):
        return _HeadDot.apply(x, a)
    return torch.ops.granii.head_dot(x, a)     # nothing to save (inference tensors cannot be)


if AVAILABLE:
    register("head_dot", "native")(head_dot_native)
