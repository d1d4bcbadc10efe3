"""Edge values from node values (SDDMM) in Triton, one program per block of edges.

For each CSR entry ``j`` of ``A`` (edge ``u -> v``: row ``v``, column ``u``) and head ``h``::

    dot: out[j, h] = sum_{d < D} P[v, h D + d] * Q[u, h D + d]   (P: (num_dst, H D),
                                                                  Q: (num_src, H D))
    add: out[j, h] = a[u, h] + b[v, h]                             (GAT's scores el[u] + er[v])

``dot`` is the gradient of the edge values of ``Y = A_w X`` (``dw = <dY[v], X[u]>``) and the
attention score of dot-product attention; ``add`` is GAT's ``u_add_v``. Edges are independent:
the work is balanced by edges whatever the degrees. Gradients (``ops.SddmmDotFn``,
``ops.SddmmAddFn``), with ``G = dL/dout`` as per-head edge values::

    dot: dP = A_G Q,  dQ = A_G^T P        (weighted SpMM, ``spmm_kernels.spmm_csr``)
    add: da[u, h] = sum_{j: col u} G[j, h],  db[v, h] = sum_{j in row v} G[j, h]
"""
import torch
import triton
import triton.language as tl

from granii.kernels.triton.graph import next_pow2
from granii.kernels.triton.launch import launch


@triton.jit
def sddmm_dot_kernel(row_of, indices, p, q, out, nnz, F, H, DIM: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[j, h] = <P[row_j, head h], Q[col_j, head h]>`` for a block of ``BLOCK_E`` entries."""
    j = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    h = tl.program_id(1)
    emask = j < nnz
    v = tl.load(row_of + j, mask=emask, other=0).to(tl.int64)
    u = tl.load(indices + j, mask=emask, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_E], dtype=p.dtype.element_ty)
    for d0 in range(0, DIM, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = emask[:, None] & (d < DIM)[None, :]
        col = h * DIM + d
        pv = tl.load(p + v[:, None] * F + col[None, :], mask=m2, other=0.0)
        qv = tl.load(q + u[:, None] * F + col[None, :], mask=m2, other=0.0)
        acc += tl.sum(pv * qv, axis=1)
    tl.store(out + j * H + h, acc, mask=emask)


@triton.jit
def sddmm_add_kernel(row_of, indices, a, b, out, nnz, H, BLOCK_E: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """``out[j, h] = a[col_j, h] + b[row_j, h]`` for a block of ``BLOCK_E`` entries, all heads."""
    j = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    hh = tl.arange(0, BLOCK_H)
    emask = j < nnz
    m2 = emask[:, None] & (hh < H)[None, :]
    v = tl.load(row_of + j, mask=emask, other=0).to(tl.int64)
    u = tl.load(indices + j, mask=emask, other=0).to(tl.int64)
    av = tl.load(a + u[:, None] * H + hh[None, :], mask=m2, other=0.0)
    bv = tl.load(b + v[:, None] * H + hh[None, :], mask=m2, other=0.0)
    tl.store(out + j[:, None] * H + hh[None, :], av + bv, mask=m2)


def sddmm_dot_csr(csr, p, q, heads=1):
    """``(nnz, heads)`` per-head dot products in ``csr``'s order (module docstring), no autograd.
    ``p`` ``(rows, F)``, ``q`` ``(cols, F)``, ``F`` a multiple of ``heads``."""
    p, q = p.contiguous(), q.contiguous()
    width = p.shape[1]
    if q.shape[1] != width or width % heads:
        raise ValueError(f"granii: sddmm of widths {width} and {q.shape[1]} in {heads} heads")
    out = torch.empty(csr.nnz, heads, dtype=p.dtype, device=p.device)
    if csr.nnz and width == 0:
        return out.zero_()
    dim = width // heads
    block_d = min(next_pow2(dim), 64)
    block_e = max(16, min(128, 4096 // block_d))
    launch(sddmm_dot_kernel, (triton.cdiv(csr.nnz, block_e), heads),
           [csr.row_of, csr.indices, p, q, out, csr.nnz, width, heads],
           dict(DIM=dim, BLOCK_E=block_e, BLOCK_D=block_d))
    return out


def sddmm_add_csr(csr, a, b):
    """``(nnz, H)``: ``a[col_j] + b[row_j]`` in ``csr``'s order, no autograd; ``a`` ``(cols, H)``,
    ``b`` ``(rows, H)``."""
    a, b = a.contiguous(), b.contiguous()
    heads = a.shape[1]
    out = torch.empty(csr.nnz, heads, dtype=a.dtype, device=a.device)
    block_h = next_pow2(heads)
    block_e = max(16, min(256, 2048 // block_h))
    launch(sddmm_add_kernel, (triton.cdiv(csr.nnz, block_e),),
           [csr.row_of, csr.indices, a, b, out, csr.nnz, heads],
           dict(BLOCK_E=block_e, BLOCK_H=block_h))
    return out
