"""What granii did with a model's layers: how many run an optimized plan, which fall back and why,
and the composition and kernel implementations each chose."""
from granii.runtime.dispatch import layer_states


def describe(model):
    """``dict(optimized, layers, fallbacks, plans)`` from the layers' last calls. A layer whose
    measured tie-break kept its own original forward shows ``original forward (measured)``."""
    states = layer_states(model)
    fallbacks = [f"{st.name}: {st.fallback}" for st in states if st.fallback]
    plans = []
    for st in states:
        if st.fallback or st.last is None:
            continue
        plans.append(f"{st.name}: {_kept(st)}")
    return dict(optimized=len(states) - len(fallbacks), layers=len(states),
                fallbacks=" | ".join(fallbacks), plans=" | ".join(plans))


def _kept(st):
    """The composition and implementations the layer runs now."""
    ranking, best = st.last[1], st.last[2]
    tuned = getattr(st, "tuned", None)
    if tuned:
        label = tuned[1]
        if not label.startswith("["):
            return f"{label} (measured)"
        best = next((c for c in ranking if f"[{c.plan.index}]" == label), best)
    impls = sorted({i for i in best.impls if i != "inline"})
    return f"{best.plan.composition()} [{','.join(impls)}]"


class Settling:
    """``Settling(*models)()`` is True once granii's measured tie-breaks in ``models`` have stopped
    moving: no layer's trial (its first calls, when candidate plans take turns) advanced, started
    or ended since the previous call. A trial that a mode no longer used left open (the inference
    decision ``granii(...)`` started before training) does not move, so it does not count."""

    def __init__(self, *models):
        self.models = models
        self.prev = None

    def __call__(self):
        now = _trials(self.models)
        moved = self.prev is None or now != self.prev
        self.prev = now
        return not moved


def _trials(models):
    from granii.runtime import tiebreak
    trial = getattr(tiebreak, "Trial", None)
    out = {}
    if trial is None:
        return out
    for model in models:
        for st in layer_states(model):
            # a block's own table goes with the block; its sampler configuration's stays
            for per_graph in list(st.decisions.values()) + [getattr(st, "sampled", {})]:
                for d in list(per_graph.values()):
                    if isinstance(d, trial):      # one trial may sit in several tables
                        out[id(d)] = d.turn
    return out


__all__ = ["describe", "Settling"]
