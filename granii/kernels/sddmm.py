"""Edge values from node values (SDDMM-style primitives)."""
import torch

from granii.kernels.registry import register


def _like(d, ref_dim):
    """``d`` of shape ``(n,)`` viewed as ``(n, 1, ..., 1)`` to broadcast against a ``ref_dim``-D tensor."""
    return d.reshape(d.shape[0], *([1] * (ref_dim - d.dim()))) if d.dim() < ref_dim else d


@register("sddmm_scale", "dgl")
def sddmm_scale_dgl(gi, d_dst, w, d_src):
    """``w'_e = d_dst[v] w_e d_src[u]`` for ``e = u -> v``: the values of ``diag(d_dst) A_w diag(d_src)``.

    ``w=None`` means ``w_e = 1``; ``d_dst=None`` / ``d_src=None`` mean all ones. ``d_*`` have shape
    ``(n,)`` and broadcast over the trailing (head) dimensions of ``w``.
    """
    import dgl
    g = gi.g
    if w is None:
        if d_dst is None and d_src is None:
            return torch.ones(gi.num_edges, device=gi.device)
        if d_dst is None:
            return dgl.ops.copy_u(g, d_src)
        if d_src is None:
            return dgl.ops.copy_v(g, d_dst)
        return dgl.ops.u_mul_v(g, d_src, d_dst)
    out = w
    if d_src is not None:
        out = dgl.ops.e_mul_u(g, out, _like(d_src, w.dim()))
    if d_dst is not None:
        out = dgl.ops.e_mul_v(g, out, _like(d_dst, w.dim()))
    return out


@register("sddmm_scale", "torch")
def sddmm_scale_torch(gi, d_dst, w, d_src):
    """``w'_e = d_dst[v] w_e d_src[u]`` for ``e = u -> v``, by index gathers (see ``sddmm_scale_dgl``)."""
    src, dst = gi.edges()
    if w is None:
        if d_dst is None and d_src is None:
            return torch.ones(gi.num_edges, device=gi.device)
        if d_dst is None:
            return d_src[src]
        if d_src is None:
            return d_dst[dst]
        return d_dst[dst] * d_src[src]
    out = w
    if d_src is not None:
        out = out * _like(d_src, w.dim())[src]
    if d_dst is not None:
        out = _like(d_dst, w.dim())[dst] * out
    return out


@register("sddmm_add", "dgl")
def sddmm_add_dgl(gi, a_src, b_dst):
    """``e_uv = a_src[u] + b_dst[v]`` for each edge ``u -> v`` (GAT scores, shape ``(E, heads[, 1])``)."""
    import dgl
    return dgl.ops.u_add_v(gi.g, a_src, b_dst)


@register("sddmm_add", "torch")
def sddmm_add_torch(gi, a_src, b_dst):
    """``e_uv = a_src[u] + b_dst[v]`` for each edge ``u -> v``, by index gathers."""
    src, dst = gi.edges()
    return a_src[src] + b_dst[dst]
