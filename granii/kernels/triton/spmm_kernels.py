"""Sparse-dense products with fused epilogues, in Triton.

For the CSR matrix ``M`` (``A``, or ``A^T`` in a backward), per-head edge values ``w`` (``(nnz, H)``
in ``M``'s CSR order, or all ones), a row-scale vector ``r`` and a column-scale vector ``c``, and
``X`` of shape ``(cols, H * D)`` (head ``h`` owns columns ``h D .. h D + D - 1``)::

    S[v, f]  = r[v] * sum_{j in row v} w[j, f // D] * c[col_j] * X[col_j, f]
    Y[v, f]  = act(S[v, f] + bias[f] + R[v, f])          act: identity or ReLU

GCN's normalisation ``D^-1/2 A D^-1/2`` is ``r = c = deg^-1/2``; mean aggregation ``r = 1/deg``;
SAGE's self term and GIN's ``(1 + eps) X`` are the residual ``R``.

Two schedules compute the same sums:

* ``rows``: one program per (row, block of ``BLOCK_F`` columns); it walks the row's edges
  ``BLOCK_E`` at a time, gathering a ``BLOCK_E x BLOCK_F`` tile of ``X``. A row of a hub with
  10^5 edges is one program's serial work: skewed graphs leave the GPU waiting for it.
* ``segments``: one program per work item of at most ``SEG`` edges (``graph._segments``): short
  rows are one item each; long rows are split, their items add partial sums (already scaled by
  ``r``) with atomic adds into a zeroed output, and a second small kernel applies
  ``bias + R`` and ``act`` to those rows only. Every program does bounded work, whatever the
  degree distribution.

Both loop over an item's own edges when compiled (``BOUND`` 0), over a compile-time bound under
the interpreter (``graph``); ``config`` gives the tile and the warps by the number of columns.

Autograd (``ops.SpmmFn``), with ``P = dL/dY`` masked by ``Y > 0`` under ReLU::

    dX    = diag(c) M_w^T diag(r) P        (the same kernel on the transpose, r and c swapped,
                                            values in its CSR order: w[pos])
    dw_jh = r[v] c[u] <P[v, h], X[u, h]>   for entry j = (v, u): an SDDMM
                                           (``sddmm_kernels.sddmm_dot_csr``)
    dbias = sum_v P[v];   dR = P
    dr[v] = <P[v], (M_w diag(c) X)[v]>;    dc[u] = <X[u], (M_w^T diag(r) P)[u]>
"""
import torch
import triton
import triton.language as tl

from granii.kernels.triton.graph import loop_mode, next_pow2
from granii.kernels.triton.launch import launch

SEG = 64          # edges per work item of the ``segments`` schedule (read at each call)
LEGACY = False    # True: the launch configuration used before the one-warp rule (``config``)


@triton.jit
def epilogue(acc, row, f, fmask, bias, res, F, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
             RELU: tl.constexpr):
    """``act(acc + bias + R[row])`` over the columns ``f`` of one row: the fused epilogue of a
    whole row (``spmm_kernel``) and of a split row once its pieces are summed
    (``finish_rows_kernel``)."""
    if HAS_BIAS:
        acc += tl.load(bias + f, mask=fmask, other=0.0)
    if HAS_RES:
        acc += tl.load(res + row * F + f, mask=fmask, other=0.0)
    if RELU:
        acc = tl.maximum(acc, 0.0)
    return acc


@triton.jit
def spmm_kernel(indptr, seg_row, seg_start, seg_end, seg_whole, indices, w, rs, cs, x, bias, res,
                y, F, D, H, FBLOCKS, SEGMENTED: tl.constexpr, BOUND: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr, HAS_W: tl.constexpr,
                HAS_RS: tl.constexpr, HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_RES: tl.constexpr, RELU: tl.constexpr):
    """One program per (work item, block of ``BLOCK_F`` columns), the column blocks of one item
    next to each other in launch order (program ``item * FBLOCKS + block``), so that they read
    the item's indices and edge values while these are in cache.

    ``SEGMENTED`` false (``rows``): item ``i`` is row ``i``, its edges ``indptr[i] ..
    indptr[i + 1]``. ``SEGMENTED`` true: item ``i`` is ``seg_start[i] .. seg_end[i]`` of row
    ``seg_row[i]``; a whole row stores its finished result, a piece of a split row adds
    ``r[row] * partial`` atomically (its row zeroed before, ``finish_rows_kernel`` after).
    ``BOUND`` 0 loops over the item's own length, else ``BOUND`` offsets (masked).
    """
    pid = tl.program_id(0).to(tl.int64)
    item = pid // FBLOCKS
    f = (pid % FBLOCKS) * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = f < F
    if SEGMENTED:
        row = tl.load(seg_row + item).to(tl.int64)
        start = tl.load(seg_start + item).to(tl.int64)
        end = tl.load(seg_end + item).to(tl.int64)
    else:
        row = item
        start = tl.load(indptr + row).to(tl.int64)
        end = tl.load(indptr + row + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_F], dtype=x.dtype.element_ty)
    # the bound goes into range() directly: see graph.py on loop bounds under the interpreter
    for k in range(0, (end - start) if BOUND == 0 else BOUND, BLOCK_E):
        offs = start + k + tl.arange(0, BLOCK_E)
        emask = offs < end
        cols = tl.load(indices + offs, mask=emask, other=0).to(tl.int64)
        m2 = emask[:, None] & fmask[None, :]
        xv = tl.load(x + cols[:, None] * F + f[None, :], mask=m2, other=0.0)
        if HAS_W:
            xv = xv * tl.load(w + offs[:, None] * H + (f // D)[None, :], mask=m2, other=0.0)
        if HAS_CS:
            xv = xv * tl.load(cs + cols, mask=emask, other=0.0)[:, None]
        acc += tl.sum(xv, axis=0)
    if HAS_RS:
        acc = acc * tl.load(rs + row)
    done = epilogue(acc, row, f, fmask, bias, res, F, HAS_BIAS, HAS_RES, RELU)
    if SEGMENTED:
        flag = tl.load(seg_whole + item)
        tl.store(y + row * F + f, done, mask=fmask & (flag != 0))
        tl.atomic_add(y + row * F + f, acc, mask=fmask & (flag == 0))
    else:
        tl.store(y + row * F + f, done, mask=fmask)


@triton.jit
def finish_rows_kernel(rows, bias, res, y, F, BLOCK_F: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr):
    """``Y[row] = act(Y[row] + bias + R[row])`` for the listed rows (the split rows)."""
    row = tl.load(rows + tl.program_id(0)).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = f < F
    acc = tl.load(y + row * F + f, mask=fmask, other=0.0)
    tl.store(y + row * F + f, epilogue(acc, row, f, fmask, bias, res, F, HAS_BIAS, HAS_RES, RELU),
             mask=fmask)


def with_warps(kernel, num_warps):
    """``kernel`` to be launched with ``num_warps`` warps (``launch`` takes either)."""
    return kernel if num_warps == 4 else _Warps(kernel, num_warps)


class _Warps:
    """A kernel launched with ``num_warps`` warps, in the form ``launch`` takes a kernel (the
    recorded signature names the kernel itself: the ahead-of-time compile uses its default
    warps, which checks the same code)."""

    def __init__(self, kernel, num_warps):
        self.kernel, self.num_warps = kernel, num_warps
        self.fn, self.arg_names = kernel.fn, kernel.arg_names

    def __getitem__(self, grid):
        run = self.kernel[grid]
        return lambda *args, **consts: run(*args, num_warps=self.num_warps, **consts)


def config(width):
    """``(BLOCK_E, BLOCK_F, num_warps)`` for ``width`` columns.

    From 32 columns on: one warp a program, ``BLOCK_F = min(next_pow2(width), 256)`` and
    ``BLOCK_E = 1024 / BLOCK_F`` edges a step (a 1024-value tile: 32 x 32, 16 x 64, 8 x 128,
    4 x 256). Small programs keep many rows in flight on each multiprocessor, which is what a
    gather of ``X``'s rows needs when most rows have a few dozen edges; the reduction over the
    edges stays inside each thread. Measured on an H200 (2M-node power-law graph, ``segments``,
    ms): k = 32 1.8 (4 warps, 64 x 32: 3.4), k = 64 2.7 (4.8), k = 128 5.2 (7.8), k = 256 10.3
    (20.5); cuSPARSE 3.9, 4.4, 6.4, 12.7.

    Below 32 columns (not measured on a GPU), and everywhere with ``LEGACY`` (the rule before,
    kept for timing comparisons): ``BLOCK_F = min(next_pow2(width), 128)``, ``BLOCK_E = 4096 /
    BLOCK_F`` clamped to 16 .. 64, 4 warps."""
    block_f = next_pow2(width)
    if not LEGACY and block_f >= 32:
        block_f = min(block_f, 256)
        return 1024 // block_f, block_f, 1
    block_f = min(block_f, 128)
    return max(16, min(64, 4096 // block_f)), block_f, 4


def spmm_csr(csr, x, w=None, rs=None, cs=None, bias=None, res=None, relu=False,
             schedule="rows"):
    """``Y = act(diag(rs) M_w diag(cs) X + bias + res)`` for the ``Csr`` ``csr`` (module
    docstring), no autograd. ``x``: ``(cols, F)`` contiguous; ``w``: ``(nnz, H)`` in CSR order
    with ``F % H == 0``, or None; ``rs`` ``(rows,)``, ``cs`` ``(cols,)``, ``bias`` ``(F,)``,
    ``res`` ``(rows, F)``, each or None. ``schedule``: ``"rows"`` or ``"segments"``."""
    if x.dim() != 2:
        raise ValueError(f"granii: x must be (cols, F), got {tuple(x.shape)}")
    if x.shape[0] != csr.cols:
        raise ValueError(f"granii: x has {x.shape[0]} rows, the matrix {csr.cols} columns")
    if schedule not in ("rows", "segments"):
        raise ValueError(f"granii: schedule must be 'rows' or 'segments', got {schedule!r}")
    x = x.contiguous()
    width = x.shape[1]
    heads = 1 if w is None else w.shape[1]
    if width % heads:
        raise ValueError(f"granii: {width} columns do not split into {heads} heads")
    dummy = x
    args = [w, rs, cs, x, bias, res]
    w_, rs_, cs_, x_, bias_, res_ = [dummy if a is None else a.contiguous() for a in args]
    block_e, block_f, warps = config(width)
    kernel = with_warps(spmm_kernel, warps)
    flags = dict(HAS_W=w is not None, HAS_RS=rs is not None, HAS_CS=cs is not None,
                 HAS_BIAS=bias is not None, HAS_RES=res is not None, RELU=bool(relu))
    fblocks = triton.cdiv(width, block_f) if width else 0
    y = torch.empty(csr.rows, width, dtype=x.dtype, device=x.device)
    if schedule == "rows":
        ip = csr.indptr
        launch(kernel, (csr.rows * fblocks,),
               [ip, ip, ip, ip, ip, csr.indices, w_, rs_, cs_, x_, bias_, res_, y, width,
                width // heads, heads, fblocks],
               dict(SEGMENTED=False, BOUND=csr.bound(block_e), BLOCK_E=block_e,
                    BLOCK_F=block_f, **flags))
        return y
    seg = SEG
    seg_row, seg_start, seg_end, seg_whole, split = csr.segments(seg)
    if split.shape[0]:
        y.index_fill_(0, split.long(), 0)      # the rows that pieces add into
    block_e = min(block_e, next_pow2(seg))
    bound = 0 if loop_mode() == "dynamic" else max(next_pow2(seg), block_e)
    launch(kernel, (seg_row.shape[0] * fblocks,),
           [csr.indptr, seg_row, seg_start, seg_end, seg_whole, csr.indices, w_, rs_, cs_, x_,
            bias_, res_, y, width, width // heads, heads, fblocks],
           dict(SEGMENTED=True, BOUND=bound, BLOCK_E=block_e, BLOCK_F=block_f, **flags))
    if split.shape[0] and (bias is not None or res is not None or relu):
        launch(finish_rows_kernel, (split.shape[0], fblocks),
               [split, bias_, res_, y, width],
               dict(BLOCK_F=block_f, HAS_BIAS=bias is not None, HAS_RES=res is not None,
                    RELU=bool(relu)))
    return y


def choose_schedule(csr):
    """``segments`` when some row is much longer than the average (skewed degrees), else
    ``rows``: a hub's row would be one program's serial work."""
    if csr.rows == 0 or csr.nnz == 0:
        return "rows"
    mean = csr.nnz / csr.rows
    return "segments" if csr.max_len > max(4 * SEG, 16 * mean) else "rows"
