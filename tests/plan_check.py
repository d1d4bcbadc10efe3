"""Shared test helper: run every promoted plan of a layer and compare with the original layer."""
import itertools

import torch

from granii.runtime.bind import prepare
from granii.runtime.state import new_state
from granii.runtime.variants import run_plan
from granii.plan import step_impls


def impl_choices(plan):
    """Kernel assignments that run every implementation of every step inside this plan: the
    ``i``-th takes each step's ``i``-th implementation (its last for steps with fewer), for
    ``i`` up to the most any step has; not the cross product (implementations of one
    primitive are interchangeable, so each is checked in place in the plan once)."""
    per_step = [step_impls(s) for s in plan.steps]
    n = max((len(o) for o in per_step), default=1)
    return list(dict.fromkeys(tuple(o[min(i, len(o) - 1)] for o in per_step)
                              for i in range(n)))


def state_for(layer):
    return new_state(layer)


def grads(out, inputs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(out.shape, generator=gen)
    return torch.autograd.grad((out * r).sum(), inputs, allow_unused=True)


def check_all_plans(layer, args, kwargs, grad_inputs, atol=1e-4, rtol=1e-4):
    """Every promoted plan, with every kernel implementation, equals ``layer(*args, **kwargs)``
    in output and in the gradients of ``grad_inputs``. Returns the number of (plan, impls) run."""
    ref = layer(*args, **kwargs)
    ref_grads = grads(ref, grad_inputs)
    state = state_for(layer)
    call = prepare(state, layer, args, kwargs)
    assert not isinstance(call, str), f"not optimized: {call}"
    assert call.compiled.plans, "no promoted plan"
    n = 0
    for plan in call.compiled.plans:
        choices = impl_choices(plan)
        ran = {(j, i) for impls in choices for j, i in enumerate(impls)}
        assert ran == {(j, i) for j, s in enumerate(plan.steps) for i in step_impls(s)}, \
            f"plan {plan.index}: some implementation of a step is not run"
        for impls in choices:
            out = run_plan(call, plan, impls)
            what = f"plan {plan.index} ({plan.composition()}) with {impls}"
            torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
            for g, rg, x in zip(grads(out, grad_inputs), ref_grads, grad_inputs):
                if rg is None:
                    assert g is None or not g.abs().sum(), what
                    continue
                torch.testing.assert_close(g, rg, atol=atol, rtol=rtol,
                                           msg=lambda m: f"{what}, gradient: {m}")
            n += 1
    return n


__all__ = ["check_all_plans", "impl_choices", "itertools"]
