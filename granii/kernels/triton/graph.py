"""The graph as the Triton kernels read it: CSR of ``A``, CSR of ``A^T``, and launch settings.

``A`` has shape ``(num_dst, num_src)`` with ``A[v, u] = 1`` for an edge ``u -> v`` (granii's
convention, ``granii/kernels/__init__.py``): row ``v`` of the CSR lists the in-edges of ``v``.
Edge values and per-edge results outside this package are in *edge order* (the order of the
``src``/``dst`` lists the graph was built from); inside, kernels read them in *CSR order*:

    eids[j]  = edge id of CSR entry j of A          (values_csr = values_edge[eids])
    where[e] = CSR position of edge e in A          (values_edge = values_csr[where])
    pos[j]   = CSR position in A of entry j of A^T  (the same edge; values_csc = values_csr[pos])

All of it is built once per graph (``CsrGraph.from_coo`` / ``from_csr``), on the device the
features live on; the transpose is what the backward of ``Y = A X`` (``dX = A^T dY``) walks, so
that source-side sums need no atomics.

Loop bounds. A row-per-program kernel walks ``indptr[v] .. indptr[v + 1]``. Compiled for a GPU the
bound is read from memory (``dynamic``: a loop of ``ceil(deg / BLOCK)`` steps). Under Triton's
interpreter with some Triton/numpy versions, a bound loaded from memory fails ("only 0-dimensional
arrays can be converted to Python scalars": the loaded scalar is a one-element array, which newer
numpy refuses to turn into an int). So every row loop is written as ``range(0, BOUND, BLOCK)`` with
a mask ``offset < end``, where ``BOUND`` is either the row's own length (``dynamic``) or the
graph's largest row length rounded up to a power of two, passed as a compile-time constant
(``static``). ``static`` is the default under the interpreter, ``dynamic`` on a GPU;
``GRANII_TRITON_LOOPS=static|dynamic`` overrides both (the tests run both forms).
"""
import os

import torch

_INT32_MAX = 2**31 - 1


def interpreting():
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def loop_mode():
    """``"static"`` or ``"dynamic"`` row-loop bounds (module docstring)."""
    mode = os.environ.get("GRANII_TRITON_LOOPS", "")
    if mode in ("static", "dynamic"):
        return mode
    if mode:
        raise ValueError(f"granii: GRANII_TRITON_LOOPS must be 'static' or 'dynamic', got {mode!r}")
    return "static" if interpreting() else "dynamic"


def next_pow2(n):
    """The smallest power of two ``>= max(n, 1)``."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def _pieces(whole, split_counts):
    """Where each piece of a split row keeps its partial result: ``slot[i]`` (-1 for an item that
    is a whole row, else ``0, 1, ...`` over the other items in order) and ``split_ptr`` (``len +
    1``): the pieces of the ``r``-th split row are slots ``split_ptr[r] .. split_ptr[r + 1]``
    (items of one row are consecutive, in the order of the split rows)."""
    piece = whole == 0
    slot = torch.where(piece, torch.cumsum(piece.long(), 0) - 1, -1)
    split_ptr = torch.zeros(split_counts.shape[0] + 1, dtype=torch.long, device=whole.device)
    split_ptr[1:] = torch.cumsum(split_counts, 0)
    return slot, split_ptr


def _segments(indptr, seg):
    """Work items of at most ``seg`` edges: every row is one item, a row longer than ``seg`` is
    split into ``ceil(deg / seg)`` items. Returns ``(row, start, end, whole, split_rows)``: item
    ``i`` covers CSR entries ``start[i] .. end[i]`` of row ``row[i]``; ``whole[i]`` says the item
    is its row's only one (it may then apply the epilogue and store), else it adds its partial sum
    atomically and ``split_rows`` (the rows with several items) get the epilogue afterwards.
    Rows without edges are items too (their result is the epilogue of zero)."""
    ip = indptr.long()
    deg = ip[1:] - ip[:-1]
    rows = deg.shape[0]
    n_items = torch.clamp((deg + seg - 1) // seg, min=1)
    row = torch.repeat_interleave(torch.arange(rows, device=ip.device), n_items)
    first = torch.cumsum(n_items, 0) - n_items
    k = torch.arange(row.shape[0], device=ip.device) - first[row]
    start = ip[:-1][row] + k * seg
    end = torch.minimum(start + seg, ip[1:][row])
    whole = (n_items[row] == 1)
    split_rows = torch.nonzero(n_items > 1).reshape(-1)
    return row, start, end, whole.to(torch.int8), split_rows


class Csr:
    """One CSR matrix: ``indptr`` (rows + 1), ``indices`` (nnz), shape ``(rows, cols)``.

    ``row_of`` (the row of each entry), the load-balancing items (``segments``) and the slots of
    split rows' pieces (``pieces``) are made on first use and kept."""

    def __init__(self, indptr, indices, rows, cols):
        self.indptr, self.indices, self.rows, self.cols = indptr, indices, int(rows), int(cols)
        self.nnz = int(indices.shape[0])
        deg = indptr[1:] - indptr[:-1]
        self.max_len = int(deg.max()) if rows else 0
        self._row_of = None
        self._segments = {}
        self._pieces = {}

    @property
    def row_of(self):
        """Row index of each CSR entry (``nnz``), in the index dtype."""
        if self._row_of is None:
            deg = (self.indptr[1:] - self.indptr[:-1]).long()
            self._row_of = torch.repeat_interleave(
                torch.arange(self.rows, device=self.indptr.device, dtype=self.indptr.dtype), deg)
        return self._row_of

    def segments(self, seg):
        """The work items of at most ``seg`` edges (``_segments``), once per ``seg``."""
        if seg not in self._segments:
            row, start, end, whole, split = _segments(self.indptr, seg)
            cast = self.indptr.dtype
            self._segments[seg] = (row.to(cast), start.to(cast), end.to(cast), whole,
                                   split.to(cast))
        return self._segments[seg]

    def pieces(self, seg):
        """``(slot, split_ptr, most, slots)`` of the split rows' pieces for items of ``seg`` edges
        (``_pieces``), ``most`` the largest number of pieces of one row and ``slots`` their
        number (Python ints: a call reads no device value); once per ``seg``."""
        if seg not in self._pieces:
            whole, split = self.segments(seg)[3:5]
            deg = (self.indptr[1:] - self.indptr[:-1]).long()[split.long()]
            counts = (deg + seg - 1) // seg
            slot, split_ptr = _pieces(whole, counts)
            most = int(counts.max()) if counts.numel() else 0
            cast = self.indptr.dtype
            self._pieces[seg] = (slot.to(cast), split_ptr.to(cast), most, int(split_ptr[-1]))
        return self._pieces[seg]

    def bound(self, block):
        """``BOUND`` of the row loops (module docstring): 0 for dynamic bounds, else the largest row
        length rounded up to a power of two (at least ``block``)."""
        if loop_mode() == "dynamic":
            return 0
        return max(next_pow2(self.max_len), block)


class CsrGraph:
    """``A`` (``a``: rows are destinations) and ``A^T`` (``at``: rows are sources) of one graph,
    with the edge permutations of the module docstring (``eids``, ``where``, ``pos``).

    ``eids``/``where`` are ``None`` when edge ``e`` is CSR entry ``e`` (edges given sorted by
    destination, stably): then edge-order values are read as they are."""

    def __init__(self, a, at, pos, eids, where):
        self.a, self.at, self.pos, self.eids, self.where = a, at, pos, eids, where
        self.num_dst, self.num_src, self.num_edges = a.rows, a.cols, a.nnz

    @property
    def device(self):
        return self.a.indptr.device

    @staticmethod
    def from_coo(src, dst, num_src, num_dst, index_dtype=None):
        """The graph with edges ``src[e] -> dst[e]``; indices int32 when everything fits (else
        int64), or ``index_dtype``. On the device of ``src``."""
        src, dst = src.long(), dst.long()
        e = src.shape[0]
        if index_dtype is None:
            small = max(e, num_src, num_dst) <= _INT32_MAX
            index_dtype = torch.int32 if small else torch.int64
        order = torch.argsort(dst, stable=True)
        identity = bool((order == torch.arange(e, device=order.device)).all()) if e else True
        eids = None if identity else order
        where = None
        if not identity:
            where = torch.empty_like(order)
            where[order] = torch.arange(e, device=order.device)
        indptr = _indptr(dst, num_dst)
        a = Csr(indptr.to(index_dtype), src[order].to(index_dtype), num_dst, num_src)
        at, pos = _transpose(a, index_dtype)
        return CsrGraph(a, at, pos, eids, where)

    @staticmethod
    def from_csr(indptr, indices, num_src, index_dtype=None):
        """The graph whose in-edge CSR is ``(indptr, indices)`` (edge ``j`` is entry ``j``)."""
        num_dst = indptr.shape[0] - 1
        if index_dtype is None:
            small = max(indices.shape[0], num_src, num_dst) <= _INT32_MAX
            index_dtype = torch.int32 if small else torch.int64
        a = Csr(indptr.to(index_dtype).contiguous(), indices.to(index_dtype).contiguous(),
                num_dst, num_src)
        at, pos = _transpose(a, index_dtype)
        return CsrGraph(a, at, pos, None, None)

    def to_csr_order(self, t):
        """Edge-order values ``t`` (``(E, ...)``) in the CSR order of ``A`` (differentiable)."""
        return t if self.eids is None else t.index_select(0, self.eids)

    def to_edge_order(self, t):
        """CSR-order values ``t`` in edge order (differentiable)."""
        return t if self.where is None else t.index_select(0, self.where)


def _indptr(rows_of_entries, rows):
    counts = torch.bincount(rows_of_entries, minlength=rows) if rows_of_entries.numel() else \
        torch.zeros(rows, dtype=torch.long, device=rows_of_entries.device)
    indptr = torch.zeros(rows + 1, dtype=torch.long, device=rows_of_entries.device)
    indptr[1:] = torch.cumsum(counts, 0)
    return indptr


def _transpose(a, index_dtype):
    """CSR of ``A^T`` and ``pos`` (position in ``A`` of each of its entries): a stable sort of
    ``A``'s entries by column."""
    col = a.indices.long()
    order = torch.argsort(col, stable=True)
    indptr = _indptr(col, a.cols)
    at = Csr(indptr.to(index_dtype), a.row_of.long()[order].to(index_dtype), a.cols, a.rows)
    return at, order.to(index_dtype)
