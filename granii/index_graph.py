"""A graph held as index tensors: the source and target of every edge, in edge order.

The graph any frontend without graph objects of its own passes to granii's core (PyTorch
Geometric's ``edge_index``, ``EdgeIndex`` and sparse adjacencies: ``granii.pyg.graph``), and the
reference graphs of the calibration where DGL is not installed. It answers the few questions
``granii.graph.GraphInfo`` and the kernels ask a graph (sizes, ``adj_tensors``, degrees,
``edges``), so the per-graph structures (CSR of ``A`` and ``A^T`` with the edge permutation,
degrees, the once-per-graph cache) are those DGL graphs get, built from the index tensors.
"""
import torch

from .device import is_gpu, runs_on

__all__ = ["IndexGraph"]


class IndexGraph:
    """The directed graph ``src[e] -> dst[e]`` on ``num_nodes`` nodes, edges in the given order.

    ``kind`` says what it was made from (a frontend's graph input, such as PyG's ``edge_index``),
    ``values`` the per-edge values that input stored (edge order), if any. ``_graph`` is the
    change token ``GraphInfo`` compares (DGL replaces it on a structural edit): an
    ``IndexGraph`` never changes, so it is itself."""
    is_block = False
    srctypes = dsttypes = ("_N",)
    canonical_etypes = (("_N", "_E", "_N"),)

    def __init__(self, src, dst, num_nodes, kind="edge_index", values=None):
        self.src = src.long().contiguous()
        self.dst = dst.long().contiguous()
        self.n = int(num_nodes)
        self.kind = kind
        self.values = values
        self.derived = {}                 # transform -> IndexGraph (self loops added)
        self._graph = self

    @property
    def device(self):
        return self.src.device

    def num_src_nodes(self):
        return self.n

    num_dst_nodes = num_nodes = number_of_nodes = num_src_nodes

    def num_edges(self):
        return self.src.numel()

    number_of_edges = num_edges

    @property
    def edge_index(self):
        """``[src; dst]`` (a new [2, E] tensor), as PyG writes a graph."""
        return torch.stack([self.src, self.dst])

    def adj_tensors(self, fmt):
        """``(indptr, indices, eids)`` as DGL's ``adj_tensors``: ``"csc"`` has one row per
        target (``A``), ``"csr"`` one per source (``A^T``); entries of a row in edge order."""
        if fmt not in ("csc", "csr"):
            raise ValueError(f"granii: adj_tensors('{fmt}') of an index graph")
        rows, cols = (self.dst, self.src) if fmt == "csc" else (self.src, self.dst)
        eids = torch.sort(rows, stable=True).indices
        counts = torch.bincount(rows, minlength=self.n)
        indptr = torch.zeros(self.n + 1, dtype=torch.long, device=rows.device)
        torch.cumsum(counts, 0, out=indptr[1:])
        return indptr, cols[eids], eids

    def runs(self, impl):
        """Whether kernel implementation ``impl`` runs on this index graph: DGL's kernels need a
        DGL graph; a graph on the GPU runs the GPU's kernels (``granii.device``)."""
        return impl != "dgl" and runs_on(impl, is_gpu(self.device))

    def in_degrees(self):
        """Edges into each node (``A 1``), parallel edges counted."""
        return torch.bincount(self.dst, minlength=self.n)

    def out_degrees(self):
        return torch.bincount(self.src, minlength=self.n)

    def edges(self, order="eid"):
        return self.src, self.dst

    def __repr__(self):
        return f"IndexGraph(num_nodes={self.n}, num_edges={self.num_edges()}, from={self.kind})"
