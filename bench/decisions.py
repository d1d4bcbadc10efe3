"""What granii did with a model's layers: how many run an optimized plan, which fall back and why,
and the composition and kernel implementations each chose."""
from granii.dispatch import layer_states


def describe(model):
    """``dict(optimized, layers, fallbacks, plans)`` from the layers' last calls."""
    states = layer_states(model)
    fallbacks = [f"{st.name}: {st.fallback}" for st in states if st.fallback]
    plans = []
    for st in states:
        if st.fallback or st.last is None:
            continue
        best = st.last[2]
        impls = sorted({i for i in best.impls if i != "inline"})
        plans.append(f"{st.name}: {best.plan.composition()} [{','.join(impls)}]")
    return dict(optimized=len(states) - len(fallbacks), layers=len(states),
                fallbacks="; ".join(fallbacks), plans="; ".join(plans))


__all__ = ["describe"]
