"""Dense primitives."""
import torch

from granii.kernels.registry import register


@register("gemm", "torch")
def gemm_torch(x, w, c=None):
    """``Y = X W`` for ``X`` of shape ``(n, k_in)`` and ``W`` of shape ``(k_in, k_out)``; with
    ``c`` (``(n, k_out)`` or a ``(k_out,)`` row), ``Y = c + X W`` in one pass (``addmm``)."""
    if c is None:
        return x @ w
    if x.dim() != 2:
        return c + x @ w
    return torch.addmm(c, x, w)


@register("row_scale", "torch")
def row_scale_torch(d, x):
    """``Y = diag(d) X``: ``Y[i] = d_i X[i]`` for ``d`` of shape ``(n,)``, ``X`` ``(n, ...)``."""
    return d.reshape(d.shape[0], *([1] * (x.dim() - 1))) * x
