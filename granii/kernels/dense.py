"""Dense primitives."""
from granii.kernels.registry import register


@register("gemm", "torch")
def gemm_torch(x, w):
    """``Y = X W`` for ``X`` of shape ``(n, k_in)`` and ``W`` of shape ``(k_in, k_out)``."""
    return x @ w


@register("row_scale", "torch")
def row_scale_torch(d, x):
    """``Y = diag(d) X``: ``Y[i] = d_i X[i]`` for ``d`` of shape ``(n,)``, ``X`` ``(n, ...)``."""
    return d.reshape(d.shape[0], *([1] * (x.dim() - 1))) * x
