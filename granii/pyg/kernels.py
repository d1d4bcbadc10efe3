"""Kernels PyG layers need that the core has only on DGL graphs.

``spmm_amax``: ``Y[v] = max_{u -> v} X[u]`` per column, 0 where ``v`` has no in-edge: PyG's
``MaxAggregation`` (``scatter(..., reduce='max')``), computed as PyG computes it, by torch's
``scatter_reduce(amax, include_self=False)`` into zeros, so its gradient is PyG's too (split
evenly between tied maxima). Registered under a primitive of its own: the DGL layers' max
(``spmm_max``) keeps its implementations; the cost model prices it as a sparse product.
"""
import torch

from ..kernels import REGISTRY, register


def spmm_amax_torch(gi, x):
    src, dst = gi.edges()
    idx = dst.view(-1, *([1] * (x.dim() - 1))).expand(-1, *x.shape[1:])
    out = x.new_zeros((gi.num_dst,) + tuple(x.shape[1:]))
    return out.scatter_reduce(0, idx, x.index_select(0, src), reduce="amax", include_self=False)


if "torch" not in REGISTRY.get("spmm_amax", {}):
    register("spmm_amax", "torch")(spmm_amax_torch)
