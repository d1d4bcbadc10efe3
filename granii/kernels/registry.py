"""Primitive -> implementation name -> function.

A primitive is one mathematical operation (``spmm``: ``Y = A X``); each implementation computes it
with a different library or data layout and is interchangeable in outputs and gradients.
"""

REGISTRY = {}


def register(primitive, impl):
    """Decorator: record ``fn`` as implementation ``impl`` of ``primitive``."""
    def deco(fn):
        impls = REGISTRY.setdefault(primitive, {})
        if impl in impls:
            raise ValueError(f"granii: {primitive}/{impl} registered twice")
        impls[impl] = fn
        return fn
    return deco


def get(primitive, impl):
    """The function implementing ``primitive`` with ``impl``."""
    try:
        return REGISTRY[primitive][impl]
    except KeyError:
        known = {p: sorted(i) for p, i in REGISTRY.items()}
        raise KeyError(f"granii: no kernel {primitive}/{impl}; registered: {known}") from None


def implementations(primitive):
    """Names of the registered implementations of ``primitive``."""
    return sorted(REGISTRY.get(primitive, ()))
