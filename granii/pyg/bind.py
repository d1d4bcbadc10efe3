"""Binding a PyG call: the graph, the per-edge values the frontend left to compute, the leaves.

``edge_values(ev, base, values)`` computes a ``values.EdgeVal`` on the real graph, in the edge
order of the graph it belongs to (``base`` with the self loops ``ev.graph.how`` added):

    w                  the argument ``values[arg]``; with self loops added, PyG's values for them:
                       ``add``: ``cat(w, fill)``; ``remaining``: the kept edges' ``w``, then per
                       node its existing loop's ``w`` (the last one) or ``fill``
    deg (DegVec)       ``scatter_add(w or 1, index)`` over that graph, ``^power``, ``inf -> 0`` if
                       masked
    product            ``const * w * prod deg_i[side_i]``

An ``EdgeAttr`` (edge features E x k) is computed by ``edge_features``: the rows of the edges that
are not loops, then (``remaining``) one row per node, ``fill`` or the mean / sum of the rows of
its in-edges kept (``scatter(edge_attr, edge_index[1], reduce=fill)``, as ``add_self_loops``).

Values that read no argument depend on the graph alone: they are computed once per graph (no
gradient) and kept in its ``GraphInfo`` cache.
"""
import torch

from .graph import derived, graph_info, loop_positions
from .values import EdgeAttr, EdgeVal


def _weight(w_spec, base, values):
    w = values[w_spec.arg]
    if w.layout != torch.strided:        # a sparse adjacency: its values, in the adapter's order
        w = (w if w.layout == torch.sparse_csr or w.is_coalesced() else w.coalesce()).values()
    w = w.reshape(-1)
    if w_spec.how is None:
        return w
    fill = torch.full((base.n,), w_spec.fill, dtype=w.dtype, device=w.device)
    if w_spec.how == "add":
        return torch.cat([w, fill])
    kept, loops = loop_positions(base)
    fill = fill.index_put((base.src.index_select(0, loops),), w.index_select(0, loops))
    return torch.cat([w.index_select(0, kept), fill])


def _reads_argument(ev):
    if ev.weight is not None:
        return True
    return any(v.weight is not None and _reads_argument(v.weight) for v, _ in ev.gathers)


def _degree(vec, base, values, dtype):
    g = derived(base, vec.graph.how)
    idx = g.dst if vec.side == "dst" else g.src
    w = (edge_values(vec.weight, base, values) if vec.weight is not None
         else torch.ones(g.num_edges(), dtype=dtype, device=idx.device))
    deg = torch.zeros(g.n, dtype=w.dtype, device=idx.device).scatter_add(0, idx, w)
    if vec.power != 1:
        deg = deg.pow(vec.power)
    if vec.masked:
        deg = deg.masked_fill(deg == float("inf"), 0)
    return deg


def edge_features(spec, base, values):
    """The edge features of ``spec`` (an ``EdgeAttr``) per edge of its graph (see above)."""
    attr = values[spec.arg]
    kept, _ = loop_positions(base)
    rows = attr.index_select(0, kept)
    if spec.how == "removed":
        return rows
    if isinstance(spec.fill, float):
        fill = attr.new_full((base.n, attr.shape[1]), spec.fill)
    else:
        dst = base.dst.index_select(0, kept)
        fill = attr.new_zeros((base.n, attr.shape[1])).index_add(0, dst, rows)
        if spec.fill == "mean":
            count = graph_info(base).memo(("kept_in_degrees",),
                                          lambda: torch.bincount(dst, minlength=base.n))
            fill = fill / count.clamp(min=1).to(fill.dtype).unsqueeze(1)
    return torch.cat([rows, fill])


def edge_values(ev, base, values, dtype=torch.float32):
    """The values of ``ev`` (an ``EdgeVal``) per edge of its graph, shape (E,); of an
    ``EdgeAttr``, its features (E x k)."""
    if isinstance(ev, EdgeAttr):
        return edge_features(ev, base, values)
    if not _reads_argument(ev):
        gi = graph_info(derived(base, ev.graph.how))
        key = ("pyg_values", ev.key(), dtype)
        with torch.no_grad():
            return gi.memo(key, lambda: _compute(ev, base, values, dtype))
    return _compute(ev, base, values, dtype)


def _compute(ev, base, values, dtype):
    g = derived(base, ev.graph.how)
    out = _weight(ev.weight, base, values) if ev.weight is not None else None
    for vec, side in ev.gathers:
        d = _degree(vec, base, values, dtype)[g.src if side == "src" else g.dst]
        out = d if out is None else out * d
    if out is None:
        out = torch.ones(g.num_edges(), dtype=dtype, device=g.src.device)
    if ev.const != 1:
        out = out * ev.const
    return out


__all__ = ["edge_features", "edge_values", "EdgeVal"]
