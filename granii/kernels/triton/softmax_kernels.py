"""Softmax of edge scores over each destination's in-edges, all heads at once, in Triton.

For scores ``s`` (``(nnz, H)``, ``A``'s CSR order) and each row ``v`` (the in-edges of ``v``)::

    m[v, h] = max_{j in row v} s[j, h]
    a[j, h] = exp(s[j, h] - m[v, h]) / sum_{j' in row v} exp(s[j', h] - m[v, h])

One program per row: a first pass keeps a running maximum and a running sum rescaled whenever the
maximum grows (``l <- l exp(m_old - m_new) + sum exp(s - m_new)``, the online softmax), a second
pass writes ``a``. Backward, with ``G = dL/da``: ``ds[j, h] = a[j, h] (G[j, h] - sum_{j' in row
v} a[j', h] G[j', h])`` (one row sum, then a write), the same two-pass shape.
The running maximum starts at -3e38, not -inf, so that
``exp(m_old - m_new)`` is never ``exp(-inf + inf)``. Loop bounds as in ``graph`` (``BOUND``: 0
for the row's own length, else static).
"""
import torch
import triton
import triton.language as tl

from granii.kernels.triton.graph import next_pow2
from granii.kernels.triton.launch import launch


@triton.jit
def edge_softmax_kernel(indptr, s, a, H, BOUND: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(indptr + row).to(tl.int64)
    end = tl.load(indptr + row + 1).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < H
    m = tl.full([BLOCK_H], -3.0e38, dtype=s.dtype.element_ty)
    l = tl.zeros([BLOCK_H], dtype=s.dtype.element_ty)
    for k in range(0, (end - start) if BOUND == 0 else BOUND, BLOCK_E):
        offs = start + k + tl.arange(0, BLOCK_E)
        m2 = (offs < end)[:, None] & hmask[None, :]
        sv = tl.load(s + offs[:, None] * H + hh[None, :], mask=m2, other=-3.0e38)
        m_new = tl.maximum(m, tl.max(sv, axis=0))
        p = tl.where(m2, tl.exp(sv - m_new[None, :]), 0.0)
        l = l * tl.exp(m - m_new) + tl.sum(p, axis=0)
        m = m_new
    inv = 1.0 / tl.where(l > 0, l, 1.0)
    for k in range(0, (end - start) if BOUND == 0 else BOUND, BLOCK_E):
        offs = start + k + tl.arange(0, BLOCK_E)
        m2 = (offs < end)[:, None] & hmask[None, :]
        sv = tl.load(s + offs[:, None] * H + hh[None, :], mask=m2, other=-3.0e38)
        tl.store(a + offs[:, None] * H + hh[None, :], tl.exp(sv - m[None, :]) * inv[None, :],
                 mask=m2)


@triton.jit
def edge_softmax_backward_kernel(indptr, a, g, ds, H, BOUND: tl.constexpr,
                                 BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(indptr + row).to(tl.int64)
    end = tl.load(indptr + row + 1).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < H
    dot = tl.zeros([BLOCK_H], dtype=a.dtype.element_ty)
    for k in range(0, (end - start) if BOUND == 0 else BOUND, BLOCK_E):
        offs = start + k + tl.arange(0, BLOCK_E)
        m2 = (offs < end)[:, None] & hmask[None, :]
        idx = offs[:, None] * H + hh[None, :]
        dot += tl.sum(tl.load(a + idx, mask=m2, other=0.0) * tl.load(g + idx, mask=m2, other=0.0),
                      axis=0)
    for k in range(0, (end - start) if BOUND == 0 else BOUND, BLOCK_E):
        offs = start + k + tl.arange(0, BLOCK_E)
        m2 = (offs < end)[:, None] & hmask[None, :]
        idx = offs[:, None] * H + hh[None, :]
        av = tl.load(a + idx, mask=m2, other=0.0)
        gv = tl.load(g + idx, mask=m2, other=0.0)
        tl.store(ds + idx, av * (gv - dot[None, :]), mask=m2)


def _blocks(heads):
    block_h = next_pow2(heads)
    return max(16, min(128, 2048 // block_h)), block_h


def edge_softmax_csr(csr, s):
    """``a`` of the module docstring for scores ``s`` ``(nnz, H)`` in ``csr``'s order."""
    s = s.contiguous()
    heads = s.shape[1]
    a = torch.empty_like(s)
    block_e, block_h = _blocks(heads)
    launch(edge_softmax_kernel, (csr.rows,), [csr.indptr, s, a, heads],
           dict(BOUND=csr.bound(block_e), BLOCK_E=block_e, BLOCK_H=block_h))
    return a


def edge_softmax_backward_csr(csr, a, g):
    """``ds`` of the module docstring."""
    a, g = a.contiguous(), g.contiguous()
    heads = a.shape[1]
    ds = torch.empty_like(a)
    block_e, block_h = _blocks(heads)
    launch(edge_softmax_backward_kernel, (csr.rows,), [csr.indptr, a, g, ds, heads],
           dict(BOUND=csr.bound(block_e), BLOCK_E=block_e, BLOCK_H=block_h))
    return ds
