"""Pruning: domination between trees, and early pruning of long products losing nothing."""
from dgl.nn import GATConv, GINConv, TAGConv
from torch import nn

import granii.enumerate as en
from granii import ir
from granii.frontend import lower_layer
from granii.plan import lower, tree_calls
from granii.prune import GE, LT, Calls, covered_by, prune


def calls(*sigs):
    return Calls.of(sigs)


def test_domination_needs_a_matching_not_a_greedy_pairing():
    """``small``'s first GEMM fits both of ``big``'s, its second only the first: pairing the
    first with the first (greedy) fails, the matching pairs them crosswise."""
    small = calls(("gemm", False, ("N", "k_out", "k_out")), ("gemm", False, ("N", "k_in", "k_in")))
    big = calls(("gemm", False, ("N", "k_in", "k_in")), ("gemm", False, ("N", "k_in", "k_out")))
    assert covered_by(small, big, GE)
    assert not covered_by(small, big, LT)        # k_in x k_in is larger than k_in x k_out there
    assert not covered_by(big, small, GE)


def test_domination_counts_calls_and_ignores_amortised_vectors():
    spmm = ("spmm", False, ("E", "k_in"))
    degree = ("diag_mul", True, ("N",))
    assert covered_by(calls(spmm, degree), calls(spmm), GE)
    assert not covered_by(calls(spmm, spmm), calls(spmm), GE)
    assert not covered_by(calls(("spmm", False, ("E", "k_out"))), calls(spmm), LT)


def promoted_plans(forest):
    kept = prune([tree_calls(root, choice) for root, choice in forest])
    return [lower(i, *forest[i], scenarios) for i, scenarios in kept.items()]


def test_tree_calls_are_the_priced_steps_of_the_lowered_plan():
    for layer in (TAGConv(4, 3, k=2), GATConv(4, 3, 2), GINConv(nn.Linear(4, 3), "sum")):
        forest, _ = en.layer_forest(lower_layer(layer).root)
        for i, (root, choice) in enumerate(forest):
            plan = lower(i, root, choice)
            assert sorted(tree_calls(root, choice)) == sorted(s.sig for s in plan.steps if s.sig)


def _equivalent_survivors(plans, others):
    """Each plan of ``plans``, in each scenario it survives, has a plan of ``others`` surviving
    there that dominates it and that it dominates (the same calls up to equal sizes)."""
    def calls_of(p):
        return Calls.of([s.sig for s in p.steps if s.sig])
    return all(any(sc in q.scenarios and covered_by(calls_of(p), calls_of(q), sc)
                   and covered_by(calls_of(q), calls_of(p), sc) for q in others)
               for p in plans for sc in p.scenarios)


def test_early_pruning_of_tagconv_with_three_hops_keeps_every_survivor():
    """Pruning each sub-expression's candidates as they are enumerated (``enumerate_layer``)
    must promote the same compositions as enumerating every candidate and pruning them all at
    the end (up to which of two equivalent trees stands for both)."""
    root = lower_layer(TAGConv(4, 3, k=3)).root
    early = en.enumerate_layer(root)
    full = en.enumerate_layer(root, exhaustive=True)
    assert len(early.forest) < len(full.forest) / 10 and early.n_trees < full.n_trees
    a, b = (promoted_plans(f.forest) for f in (early, full))
    assert len(a) == len(b) and _equivalent_survivors(a, b) and _equivalent_survivors(b, a)


def test_tagconv_with_four_hops_has_its_split_and_factored_forms():
    """Four hops used to be associated as written only (two million trees over all forms):
    now the stacked, split and factored (Horner) forms are all enumerated, each with the
    normalisation chosen once for every hop."""
    root = lower_layer(TAGConv(4, 3, k=4)).root
    forest, n = en.layer_forest(root)
    from test_khop import tagconv_forms
    assert tagconv_forms(promoted_plans(forest), 4) == {"stacked", "split", "horner"}
    assert isinstance(root.a.args[0], ir.Cat)          # cat(H, N H, ...) W + bias


def test_tagconv_concatenation_is_a_candidate_for_wide_outputs():
    """``cat(H, N H, N N H) W`` (DGL's own composition: hops at the input width, one GEMM over
    the stacked width) survives for k_in < k_out, next to the split and factored forms."""
    root = lower_layer(TAGConv(4, 3, k=2)).root
    forest, n = en.layer_forest(root)
    plans = promoted_plans(forest)
    stacked = [p for p in plans if any(s.prim == "cat" for s in p.steps)]
    assert stacked and all(LT in p.scenarios for p in stacked)
    gemms = [s.sig[2] for p in stacked for s in p.steps if s.prim == "gemm"]
    assert ("N", "k_in+k_in+k_in", "k_out") in gemms
    assert any(p.composition().count("gemm") == 3 for p in plans)     # split: one per hop
    # {stacked, split, Horner} x {degree-scaled edge values, row scalings around the SpMM}
    assert (n, len(plans)) == (60, 6)


def test_mixed_normalisations_are_dropped_and_hops_choose_one_form():
    """A candidate normalising one hop by edge values and another by row scalings is never
    better than the cheaper route used by both; APPNP's ten hops keep two candidates (one per
    route), not one per mix."""
    from dgl.nn import APPNPConv
    found = en.enumerate_layer(lower_layer(APPNPConv(10, 0.1)).root)
    routes = []
    for root, choice in found.forest:
        seen = en._computed((root,), choice)
        routes.append(en._route(seen))
    assert sorted(routes) == ["edges", "rows"]


def test_a_bias_added_after_the_aggregation_is_priced_as_a_pass():
    """GraphConv's bias added in its own pass costs one pass over the output (priced as a row
    scaling of that size); written by the fused SpMM's epilogue it costs nothing extra."""
    import torch
    from dgl.nn import GraphConv
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.select import price
    from graphs import undirected

    g = undirected()
    layer = GraphConv(8, 4, norm="both", allow_zero_in_degree=True)
    with torch.no_grad():
        call = prepare(new_state(layer, "conv"), layer, (g, torch.randn(g.num_nodes(), 8)), {})

    class OnlyPasses:
        name = "only passes"

        def predict(self, prim, impl, gi, dims):
            return 1.0 if prim == "row_scale" else 0.0

    costs = {}
    for plan in call.compiled.plans:
        if plan.composition() in ("sddmm_scale -> gemm -> spmm_weighted", "gemm -> spmm_norm"):
            c = price(plan, call.gi, call.symbols, OnlyPasses(), False, False, 1)
            costs[plan.composition()] = c.cost
    assert costs == {"sddmm_scale -> gemm -> spmm_weighted": 1.0, "gemm -> spmm_norm": 0.0}


def test_scale_free_native_spmm_norm_is_priced_as_the_spmm_it_runs():
    """SAGEConv's mean as ``spmm_norm(D_in^-1, None, X)`` runs the native SpMM's unweighted loop
    with the scale in its epilogue, so its native implementation is priced by the SpMM's model;
    GraphConv's, with a source scale read per nonzero, by spmm_norm's own; other implementations
    by theirs."""
    import pytest
    import torch
    from dgl.nn import GraphConv, SAGEConv
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.kernels import native
    from granii.select import price
    from graphs import undirected

    if not native.AVAILABLE:
        pytest.skip("native kernels not built")

    class PerPrimitive:
        name = "per primitive"

        def predict(self, prim, impl, gi, dims):
            if prim == "spmm_norm":
                return 10.0 if impl == "native" else 100.0
            return 1.0 if prim == "spmm" else 0.0

    g = undirected()
    priced = {}
    for layer in (SAGEConv(8, 4, "mean"), GraphConv(8, 4, norm="both")):
        with torch.no_grad():
            call = prepare(new_state(layer, "conv"), layer, (g, torch.randn(g.num_nodes(), 8)), {})
        for plan in call.compiled.plans:
            for step in plan.steps:
                if step.prim != "spmm_norm":
                    continue
                c = price(plan, call.gi, call.symbols, PerPrimitive(), False, False, 1)
                for st, impl, t in c.step_costs:
                    if st is step:
                        priced[(type(layer).__name__, step.args[1] is None, impl)] = t
    assert priced == {("SAGEConv", True, "native"): 1.0, ("GraphConv", False, "native"): 10.0}
