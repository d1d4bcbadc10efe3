"""Selection restricted to DGL's and torch's kernels: a cost model that prices every other
implementation (the project's ``native`` kernels) at infinity, so ``select.rank`` never picks one.

Compared with the unrestricted model, the difference is what choosing the composition together
with the project's own implementations gains over choosing the composition among kernels that
DGL and torch already ship.
"""
import math

EXCLUDED = ("native",)


class WithoutNative:
    """Wraps a cost model (``predict`` and ``predict_train(prim, impl, gi, dims)``); ``impl`` in
    ``EXCLUDED`` costs inf in both phases."""

    def __init__(self, inner, excluded=EXCLUDED):
        self.inner = inner
        self.excluded = tuple(excluded)
        self.name = f"{getattr(inner, 'name', type(inner).__name__)} without {'/'.join(excluded)}"

    def predict(self, prim, impl, gi, dims):
        if impl in self.excluded:
            return math.inf
        return self.inner.predict(prim, impl, gi, dims)

    def predict_train(self, prim, impl, gi, dims):
        if impl in self.excluded:
            return math.inf
        train = getattr(self.inner, "predict_train", None)
        return train(prim, impl, gi, dims) if train is not None else None

    def has_model(self, prim, impl, phase="forward"):
        return impl not in self.excluded and getattr(self.inner, "has_model",
                                                     lambda *a: False)(prim, impl, phase)


def uses_excluded(model, excluded=EXCLUDED):
    """Implementations in ``excluded`` that the decisions of ``model``'s layers use."""
    from granii.runtime.dispatch import layer_states
    found = set()
    for st in layer_states(model):
        if st.last is not None:
            found.update(i for i in st.last[2].impls if i in excluded)
    return sorted(found)


__all__ = ["WithoutNative", "uses_excluded", "EXCLUDED"]
