"""Dense primitives."""
import torch

from granii.kernels import blas
from granii.kernels.registry import register


@register("gemm", "torch")
def gemm_torch(x, w, c=None, into=False):
    """``Y = X W`` for ``X`` of shape ``(n, k_in)`` and ``W`` of shape ``(k_in, k_out)``; with
    ``c`` (``(n, k_out)`` or a ``(k_out,)`` row), ``Y = c + X W`` in one pass (``addmm``).
    ``into``: ``c`` is a fresh result no one else reads, so an ``(n, k_out)`` one is accumulated
    into in place, without the copy of it ``addmm`` makes first. A small product without ``c``
    runs on the calling thread while torch's workers sleep (``blas``)."""
    w = column_major_if_narrow(w)
    if c is None:
        return blas.serial_mm(x, w) if blas.serial(x, w) else x @ w
    if x.dim() != 2:
        return c + x @ w
    if into and c.shape == (x.shape[0], w.shape[1]) and c.is_contiguous() and \
            c.dtype == x.dtype == w.dtype:
        return c.addmm_(x, w)
    return torch.addmm(c, x, w)


def column_major_if_narrow(w):
    """``W`` stored column by column when it is a row-major matrix of 2 to 8 columns, else ``W``.

    torch's CPU product (MKL) with such a right operand ran 2-4x slower than with the same
    values stored column-major (measured with 2 threads: ``(19717 x 500) (500 x 3)`` 4.4 ms
    against 1.3 ms, and 13.6 ms against 5.6 ms with the weight's gradient; from 12 columns on,
    and for one, both orders ran alike). ``nn.Linear``'s ``weight.t()`` is column-major already;
    a ``(k_in, k_out)`` parameter (GraphConv's) is not. The copy is ``k_in x k_out`` values,
    and autograd takes the gradient back through it (``mm``'s backward keeps the column order)."""
    if w.dim() == 2 and 2 <= w.shape[1] <= 8 and w.shape[0] > 1 and w.stride(1) == 1:
        return w.t().contiguous().t()
    return w


@register("head_dot", "torch")
def head_dot_torch(x, d):
    """``Y = X blockdiag(a_1 .. a_H)`` for ``d`` that block diagonal (H F x H), ``X`` (n, H F):
    ``Y[i, h] = sum_f X[i, h F + f] a_h[f]``, a dot product per head (GAT's attention scores):
    F multiply-adds per output instead of the dense product's H F. ``a`` is ``head_blocks(d)``,
    so gradients reach the attention parameter through the blocks or through ``d``."""
    heads = d.shape[1]
    if heads == 1:      # a matrix-vector product: one pass over X, no X-sized temporary
        return x @ d
    a = head_blocks(d)
    return (x.reshape(x.shape[0], heads, a.shape[1]) * a).sum(-1)


def head_blocks(d):
    """The blocks ``a_h`` of ``d = blockdiag(a_1 .. a_H)`` as an (H, F) matrix: those it was made
    from (``plan.head_diag`` keeps them as ``d.heads``), else summed out of it."""
    blocks = getattr(d, "heads", None)
    if isinstance(blocks, torch.Tensor) and blocks.shape == (d.shape[1], d.shape[0] // d.shape[1]):
        return blocks
    return d.sum(1).reshape(d.shape[1], -1)


@register("row_scale", "torch")
def row_scale_torch(d, x):
    """``Y = diag(d) X``: ``Y[i] = d_i X[i]`` for ``d`` of shape ``(n,)``, ``X`` ``(n, ...)``."""
    return d.reshape(d.shape[0], *([1] * (x.dim() - 1))) * x


@register("head_gemm", "torch")
def head_gemm_torch(z, w):
    """``Y[:, h] = Z[:, h] W_h`` for ``Z`` ``(n, H, K)`` (a sum per attention head, ``spmm_heads``)
    and ``W`` ``(K, H F)`` whose columns ``h F .. (h + 1) F`` are ``W_h``: one batched product of
    ``H`` (n x K) (K x F) GEMMs; ``Y`` ``(n, H F)``."""
    n, heads, k = z.shape
    wh = w.reshape(k, heads, -1).transpose(0, 1)
    return torch.bmm(z.transpose(0, 1), wh).transpose(0, 1).reshape(n, -1)
