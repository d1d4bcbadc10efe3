"""Kernel registry: one thin function per (primitive, implementation).

Conventions. ``gi`` is a ``granii.graph.GraphInfo``. The sparse matrix ``A`` has shape
``(num_dst, num_src)`` with ``A[v, u] = 1`` for an edge ``u -> v``; ``A_w`` carries the edge value
``w_e`` instead. Edge-value tensors have shape ``(E,)`` or ``(E, heads, ...)`` in DGL edge-id order.
Every implementation is differentiable in all its tensor inputs, edge values included.

Primitives: ``gemm``, ``row_scale`` (dense); ``spmm``, ``spmm_weighted``, ``spmm_mean``,
``spmm_max`` (sparse-dense products); ``sddmm_scale``, ``sddmm_add`` (edge values from node
values); ``edge_softmax``; ``spmm_norm`` (``act(D_dst^a A D_src^b X + bias)``, see ``native.py``);
``readout_sum``, ``readout_mean`` (one row per graph of a batch, ``readout.py``);
``edge_message``, ``edge_message_sum``, ``edge_message_score`` (messages of node rows and edge
features, ``edge_message.py``).
"""
from granii.kernels.registry import REGISTRY, get, implementations, register
from granii.kernels import dense, sddmm, softmax, spmm  # noqa: F401  (registration)
from granii.kernels import head_dot, native, native_gat, sparse_rows  # noqa: F401,E402  ("native" if built)
from granii.kernels import readout  # noqa: F401,E402
from granii.kernels import edge_message  # noqa: F401,E402  (torch, and "native" if built)

__all__ = ["REGISTRY", "register", "get", "implementations"]
