"""granii: input-aware selection and ordering of sparse/dense primitives for DGL GNN layers.

    from granii import granii
    granii(model, graph, feats)      # optimizes model's layers in place for this input
    model(graph, feats)              # same outputs and gradients as before, faster
    granii.explain(model)            # what was chosen and why
    granii.restore(model)            # back to the original layers
"""
from .api import explain, find_layers, load_decisions, restore, save_decisions
from .api import granii as _granii
from .graph import set_cache_limit


class _Granii:
    """``granii(model, graph, feats)`` with ``granii.explain`` and ``granii.restore`` attached."""
    explain = staticmethod(explain)
    restore = staticmethod(restore)
    find_layers = staticmethod(find_layers)
    save_decisions = staticmethod(save_decisions)
    load_decisions = staticmethod(load_decisions)
    set_cache_limit = staticmethod(set_cache_limit)

    def __call__(self, model, graph, feats, **options):
        return _granii(model, graph, feats, **options)

    __doc__ = _granii.__doc__


granii = _Granii()
__all__ = ["granii", "explain", "restore", "find_layers", "save_decisions", "load_decisions",
           "set_cache_limit"]
