"""Per-graph structures shared by kernels, featurizer and plans.

A DGL graph ``g`` with edges ``u -> v`` is the sparse matrix ``A`` of shape ``(num_dst, num_src)``
with ``A[v, u] = 1`` (or the edge value ``w_e``): aggregation ``Y = A X`` sums, at each destination,
the features of its sources. ``D_in = diag(A 1)`` holds destination (in-)degrees and
``D_out = diag(A^T 1)`` source (out-)degrees; the two differ on directed graphs and blocks.

``GraphInfo`` computes the index structures once per graph and keeps everything derived from the
graph alone (degree powers, normalised edge values, CSR matrices) in ``cache``: a plan's
"precompute once" values live there, so a new graph never sees stale ones.
"""
import os
import sys
import weakref

import torch

from .device import is_gpu

_CPU = torch.device("cpu")


def _physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


# Bytes the once-per-graph caches of one graph may hold (``set_cache_limit``).
CACHE_LIMIT = {"bytes": _physical_memory() // 4}


def set_cache_limit(nbytes):
    """Bound the tensors granii keeps per graph (index structures, once-per-graph and
    once-per-input results) to ``nbytes``; beyond it the oldest are dropped, and computed again
    when needed. Default: a quarter of the machine's memory."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0 \
            or nbytes == float("inf"):
        raise ValueError(f"granii: set_cache_limit takes a number of bytes (0 or more), not "
                         f"{nbytes!r}")
    CACHE_LIMIT["bytes"] = int(nbytes)


def nbytes(value, seen=None):
    """Bytes of the tensors held in ``value`` (tuples, lists, dicts of tensors), each storage once."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        return _storage_bytes(value, seen)
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return 0
    total = 0
    for v in value:             # most items are tensors or hold none (ints, weak references)
        if isinstance(v, torch.Tensor):
            total += _storage_bytes(v, seen)
        elif isinstance(v, (tuple, list, dict)):
            total += nbytes(v, seen)
    return total


_SPARSE_PARTS = {torch.sparse_csr: ("crow_indices", "col_indices", "values"),
                 torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
                 torch.sparse_coo: ("_indices", "_values")}


def _storage_bytes(t, seen):
    if t.layout != torch.strided:
        # a sparse tensor has no storage of its own; asking for one raises an error whose C++
        # backtrace costs about a millisecond, so its parts are counted instead
        parts = _SPARSE_PARTS.get(t.layout, ())
        return sum(_storage_bytes(getattr(t, name)(), seen) for name in parts)
    try:
        storage = t.untyped_storage()
    except RuntimeError:
        return 0
    ptr = storage.data_ptr()
    if ptr in seen:
        return 0
    seen.add(ptr)
    return storage.nbytes()


class GraphCache(dict):
    """``GraphInfo.cache``: a dict whose tensors are bounded by ``CACHE_LIMIT`` bytes.

    Sizes are added up as entries are stored, and counted again past the limit and every
    ``RECOUNT`` stores (entries can grow after they are stored); the oldest are dropped until the
    rest fit. Dropped
    values are recomputed by whoever needs them: a bound on memory, never on correctness."""

    RECOUNT = 64          # stores between two full counts (entries that grew in place)

    def __init__(self):
        super().__init__()
        self.held = 0
        self.stores = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.held += nbytes(value)
        self.stores += 1
        if self.held > CACHE_LIMIT["bytes"] or self.stores % self.RECOUNT == 0:
            self.shrink(keep=key)

    def alias(self, key, value):
        """Store ``value``, whose tensors another entry holds, unless ``key`` has one: their bytes
        are counted there, so the store costs no count (``shrink`` counts every entry)."""
        if key not in self:
            super().__setitem__(key, value)

    def shrink(self, keep=None):
        sizes = {k: nbytes(v) for k, v in self.items()}
        self.held = sum(sizes.values())
        for k in list(self):
            if self.held <= CACHE_LIMIT["bytes"]:
                break
            if k != keep and sizes[k]:
                super().__delitem__(k)
                self.held -= sizes[k]


class GraphInfo:
    """Index structures and the once-per-graph cache of one DGL graph (or block).

    ``csr_in``: rows are destinations, columns sources, plus the DGL edge id of each entry
    (``A`` in CSR). ``csr_out``: rows are sources (``A^T`` in CSR). Edge values at the kernel
    interface are always in DGL edge-id order; kernels permute with the returned edge ids.
    """

    def __init__(self, g):
        self._g = weakref.ref(g)
        self.index = g._graph       # DGL replaces it on every structural edit of g
        self.num_src = g.num_src_nodes()
        self.num_dst = g.num_dst_nodes()
        self.num_edges = g.num_edges()
        self.is_block = g.is_block
        self.device = getattr(g, "device", _CPU)
        self.gpu = is_gpu(self.device)      # runs the GPU's kernels (``granii.device``)
        self.cache = GraphCache()

    @property
    def g(self):
        g = self._g()
        if g is None:
            raise RuntimeError("granii: the graph this GraphInfo describes no longer exists")
        return g

    def memo(self, key, compute):
        """``cache[key]``, computed by ``compute()`` on first use. Under ``torch.inference_mode``
        it is computed as an ordinary tensor, so calls outside inference mode can use it too."""
        try:
            return self.cache[key]
        except KeyError:
            pass
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                value = compute()
        else:
            value = compute()
        self.cache[key] = value
        return value

    def csc(self):
        """``(indptr, src_indices, eids)`` of ``A`` (one row per destination), in the graph's index
        type or int32: DGL's in-edge index when the graph has made it (a sampled block comes with
        it); otherwise counted from its edge list, which is all a new ``dgl.batch``, a
        ``dgl.graph`` or a PyG edge index holds, by the one counting sort the kernels' index is
        built by (``counted``): DGL building its index costs several times that. Not cached: a
        caller keeps what it derives."""
        counted = self.counted()
        if counted is None:
            return self.g.adj_tensors("csc")
        indptr, indices, eids = counted[:3]
        if eids is None:                     # the edges were in destination order already
            eids = torch.arange(self.num_edges, dtype=indices.dtype)
        return indptr, indices, eids

    def counted(self, transpose=False):
        """``granii::coo_to_csr`` of the graph's edge list, once per graph: ``(indptr, indices,
        eids or None, out-degrees, in-degrees, degree statistics)``, int32 where the graph fits;
        ``None`` where the graph holds an index already (a sampled block, a graph DGL indexed),
        lives on a GPU, or the native extension is not loaded. The cost model's features
        (``featurize``) and the kernels' index (``kernels.native.csr_index``) both read it: one
        count of the edges for both. ``transpose``: when the count is made now, make ``A^T``'s
        index in the same call (``coo_to_csr_both``; kept as ``"edge_list_transposed"``), which
        a backward reads next."""
        if self.gpu or self.is_block or not _native_loaded():
            return None
        cache = self.cache
        if "edge_list_counted" in cache:
            return cache["edge_list_counted"]
        edges = self.edge_list()
        if edges is None or edges[0].dtype not in (torch.int32, torch.int64):
            cache["edge_list_counted"] = None
            return None
        small = max(self.num_edges, self.num_src, self.num_dst) < 2 ** 31
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                out = self._count(edges, small, transpose)
        else:
            out = self._count(edges, small, transpose)
        cache["edge_list_counted"] = out[:6]
        cache.alias("out_deg", out[3])
        cache.alias("in_deg", out[4])
        cache.alias("degree_stats", out[5])
        if transpose:
            cache["edge_list_transposed"] = out[6:]
        return out[:6]

    def _count(self, edges, small, transpose):
        if transpose:
            return torch.ops.granii.coo_to_csr_both(*edges, self.num_src, self.num_dst, small)
        return torch.ops.granii.coo_to_csr(*edges, self.num_src, self.num_dst, small)

    def edge_list(self):
        """``(src, dst)`` in edge-id order when that is all the graph holds (a new ``dgl.batch``
        or ``dgl.graph``, a PyG edge index), else ``None``: an index the graph already has is
        cheaper to read than to count again."""
        g = self.g
        if not hasattr(g, "formats"):
            return g.edges(order="eid")
        capi = _dgl_capi()
        if capi is not None and g._graph.number_of_etypes() == 1:
            made = capi[0](g._graph)
            if "coo" in made and "csc" not in made:
                arrays = capi[1](g._graph, 0, "eid")
                return capi[2](arrays(0)), capi[2](arrays(1))
            return None
        made = g.formats()["created"]
        if "coo" in made and "csc" not in made:
            return g.edges(order="eid")
        return None

    def csr_in(self):
        """``(indptr, src_indices, eids)``: ``A`` with one row per destination node."""
        def make():
            indptr, indices, eids = self.csc()
            return indptr.long(), indices.long(), eids.long()
        return self.memo("csr_in", make)

    def csr_out(self):
        """``(indptr, dst_indices, eids)``: ``A^T`` with one row per source node."""
        def make():
            indptr, indices, eids = self.g.adj_tensors("csr")
            return indptr.long(), indices.long(), eids.long()
        return self.memo("csr_out", make)

    def in_degrees(self):
        """Float in-degrees of the destination nodes, ``A 1``: the row lengths of ``csr_in``."""
        def make():
            indptr = self.csr_in()[0]
            return (indptr[1:] - indptr[:-1]).float()
        return self.memo("in_deg", make)

    def out_degrees(self):
        """Float out-degrees of the source nodes, ``A^T 1``: counted over the in-edge index (a
        sampled block comes with it; DGL's ``out_degrees`` would build the out-edge index first,
        about ten times the count's cost)."""
        def make():
            try:
                _, src, _ = self.csc()
            except _dgl_errors():           # a DGL graph restricted to other formats
                return self.g.out_degrees().float()
            return torch.bincount(src, minlength=self.num_src).float()
        return self.memo("out_deg", make)

    def set_degrees(self, out_deg, in_deg):
        """Degree vectors counted elsewhere (the native index's pass over the in-edges), for
        ``out_degrees`` and ``in_degrees`` to return unless they already have theirs."""
        self.memo("out_deg", lambda: out_deg)
        self.memo("in_deg", lambda: in_deg)

    def segments(self):
        """``(counts, offsets, offsets32, graph_of_node)`` of the graphs of a batch
        (``dgl.batch``): node counts (int64), their running sums from 0 (``G + 1``, int64) and
        the same as int32, and the graph of each node (``N``, int64); the last two ``None``
        where the native kernels are not loaded (or the graph lives on a GPU). A graph that is
        no batch is one segment. Read from the graph at each call (``set_batch_num_nodes``
        changes them, not the structure); kept while the counts are the same tensor,
        unchanged. One native pass (``batch_segments``) makes all of them."""
        g = self.g
        counts = g.batch_num_nodes() if hasattr(g, "batch_num_nodes") else None
        hit = self.cache.get("segments")
        if counts is not None and hit is not None and hit[0] is counts \
                and hit[1] == counts._version:
            return hit[2]
        given = counts
        counts = torch.tensor([self.num_src], device=self.device) if counts is None \
            else counts.long()
        value = None
        if not self.gpu and counts.device.type == "cpu" and self.num_src < 2 ** 31 \
                and _native_loaded():
            try:
                value = (counts, *torch.ops.granii.batch_segments(counts, self.num_src))
            except RuntimeError:        # counts that do not add up: the check below says so
                value = None
        if value is None:
            offsets = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
            torch.cumsum(counts, 0, out=offsets[1:])
            if int(offsets[-1]) != self.num_src:
                raise ValueError(f"granii: the batch's node counts add up to "
                                 f"{int(offsets[-1])}, the graph has {self.num_src} nodes")
            value = (counts, offsets, None, None)
        if given is not None:
            self.cache["segments"] = (given, given._version, value)
        return value

    def edges(self):
        """``(src, dst)`` node ids of each edge, in edge-id order."""
        def make():
            u, v = self.g.edges(order="eid")
            return u.long(), v.long()
        return self.memo("edges", make)


_CAPI = []


def _dgl_capi():
    """``(created formats, edges, to tensor)``: the calls under DGL's ``g.formats()`` and
    ``g.edges(order="eid")`` (their Python wrappers cost 35 and 60 us of a new batch's first
    call, the calls themselves 2 and 23), or ``None`` where this DGL has them not. The
    conversion of an array to a tensor goes through DLPack directly: DGL's own
    (``from_dgl_nd``) reads the array's shape through ctypes first, 15 us an array."""
    if not _CAPI:
        try:
            from dgl import heterograph_index as hi
            from dgl.backend import from_dgl_nd
            from torch.utils.dlpack import from_dlpack

            def to_tensor(array):
                try:
                    return from_dlpack(array.to_dlpack())
                except (AttributeError, RuntimeError, TypeError):
                    return from_dgl_nd(array)
            _CAPI.append((hi._CAPI_DGLHeteroGetCreatedFormats, hi._CAPI_DGLHeteroEdges,
                          to_tensor))
        except (ImportError, AttributeError):
            _CAPI.append(None)
    return _CAPI[0]


def _native_loaded():
    """Whether granii's native extension is loaded (imported with the kernels; graph.py does
    not import them)."""
    import sys
    native = sys.modules.get("granii.kernels.native")
    return native is not None and native.available()


def _dgl_errors():
    """DGL's error class where DGL is loaded, else no class (``except ()`` catches nothing): a
    graph that is not DGL's raises no DGL error."""
    dgl = sys.modules.get("dgl")
    return dgl.DGLError if dgl is not None else ()


_INFOS = weakref.WeakKeyDictionary()


def graph_info(g):
    """The ``GraphInfo`` of ``g``, created on first use and dropped when ``g`` is garbage collected.

    A graph whose structure is edited in place (``add_edges``, ``remove_edges``) is a new input,
    whatever its counts: DGL gives it a new index object, and the stale entry is replaced.
    """
    info = _INFOS.get(g)
    if info is None or info.index is not g._graph:
        info = GraphInfo(g)
        _INFOS[g] = info
    return info


def known_info(g):
    """The ``GraphInfo`` of ``g`` if it has one and its structure was not edited since; else
    ``None``, creating nothing (any object may be asked)."""
    try:
        info = _INFOS.get(g)
    except TypeError:            # not weakly referenceable: not a graph granii has seen
        return None
    if info is None or info.index is not getattr(g, "_graph", None):
        return None
    return info


def as_float(t):
    return t if t.dtype == torch.float32 else t.float()
