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
    """``granii(model, *args)`` with ``granii.explain`` and ``granii.restore`` attached: ``args``
    are the arguments of one forward call of ``model`` (``g, x`` for a DGL model, ``x,
    edge_index`` and any more, such as ``edge_weight`` or ``edge_attr``, for a PyG one)."""
    explain = staticmethod(explain)
    restore = staticmethod(restore)
    find_layers = staticmethod(find_layers)
    save_decisions = staticmethod(save_decisions)
    load_decisions = staticmethod(load_decisions)
    set_cache_limit = staticmethod(set_cache_limit)

    def __call__(self, model, *args, **options):
        if len(args) < 2:
            raise TypeError("granii(model, *args) takes the arguments of one forward call of the "
                            "model: granii(model, g, x) for a DGL model, granii(model, x, "
                            f"edge_index, ...) for a PyG one; it was given {len(args)}")
        if len(args) > 2:
            if options.get("extra_args"):
                raise TypeError("granii: give the forward's further arguments either after the "
                                "first two or as extra_args, not both")
            options["extra_args"] = tuple(args[2:])
        return _granii(model, args[0], args[1], **options)

    __doc__ = _granii.__doc__


granii = _Granii()
__all__ = ["granii", "explain", "restore", "find_layers", "save_decisions", "load_decisions",
           "set_cache_limit"]
