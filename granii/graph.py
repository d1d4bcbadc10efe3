"""Per-graph structures shared by kernels, featurizer and plans.

A DGL graph ``g`` with edges ``u -> v`` is the sparse matrix ``A`` of shape ``(num_dst, num_src)``
with ``A[v, u] = 1`` (or the edge value ``w_e``): aggregation ``Y = A X`` sums, at each destination,
the features of its sources. ``D_in = diag(A 1)`` holds destination (in-)degrees and
``D_out = diag(A^T 1)`` source (out-)degrees; the two differ on directed graphs and blocks.

``GraphInfo`` computes the index structures once per graph and keeps everything derived from the
graph alone (degree powers, normalised edge values, CSR matrices) in ``cache``: a plan's
"precompute once" values live there, so a new graph never sees stale ones.
"""
import weakref

import torch


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
        self.cache = {}

    @property
    def g(self):
        g = self._g()
        if g is None:
            raise RuntimeError("granii: the graph this GraphInfo describes no longer exists")
        return g

    def memo(self, key, compute):
        """``cache[key]``, computed by ``compute()`` on first use. Under ``torch.inference_mode``
        it is computed as an ordinary tensor, so calls outside inference mode can use it too."""
        if key not in self.cache:
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False), torch.no_grad():
                    self.cache[key] = compute()
            else:
                self.cache[key] = compute()
        return self.cache[key]

    def csr_in(self):
        """``(indptr, src_indices, eids)``: ``A`` with one row per destination node."""
        def make():
            indptr, indices, eids = self.g.adj_tensors("csc")
            return indptr.long(), indices.long(), eids.long()
        return self.memo("csr_in", make)

    def csr_out(self):
        """``(indptr, dst_indices, eids)``: ``A^T`` with one row per source node."""
        def make():
            indptr, indices, eids = self.g.adj_tensors("csr")
            return indptr.long(), indices.long(), eids.long()
        return self.memo("csr_out", make)

    def in_degrees(self):
        """Float in-degrees of the destination nodes, ``A 1``."""
        return self.memo("in_deg", lambda: self.g.in_degrees().float())

    def out_degrees(self):
        """Float out-degrees of the source nodes, ``A^T 1``."""
        return self.memo("out_deg", lambda: self.g.out_degrees().float())

    def edges(self):
        """``(src, dst)`` node ids of each edge, in edge-id order."""
        def make():
            u, v = self.g.edges(order="eid")
            return u.long(), v.long()
        return self.memo("edges", make)


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


def as_float(t):
    return t if t.dtype == torch.float32 else t.float()
