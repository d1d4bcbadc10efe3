"""GIN, SGC, SAGE and user-written layers: every promoted plan equals the DGL layer."""
import copy
import io
import itertools

import dgl
import dgl.function as fn
import pytest
import torch
from dgl.nn import GATConv, GINConv, SAGEConv, SGConv, TAGConv
from torch import nn

from granii import explain, granii
from granii.api import layer_states
from graphs import GRAPHS, block, edge_weights
from plan_check import check_all_plans

SIZES = [(5, 9), (9, 5)]


def feats(g, k, seed=1):
    torch.manual_seed(seed)
    return torch.randn(g.num_src_nodes(), k, requires_grad=True)


def check_layer(make, graphs=GRAPHS, edge_w=False):
    for g in (make_g() for make_g in graphs.values()):
        for k_in, k_out in SIZES:
            torch.manual_seed(0)
            layer = make(k_in, k_out)
            x = feats(g, k_in)
            kwargs, extra = {}, []
            if edge_w:
                kwargs["edge_weight"] = edge_weights(g).requires_grad_()
                extra = [kwargs["edge_weight"]]
            check_all_plans(layer, (g, x), kwargs, [x] + extra + list(layer.parameters()))


def mlp(k_in, k_out):
    return nn.Sequential(nn.Linear(k_in, 7), nn.ReLU(), nn.Linear(7, k_out))


@pytest.mark.parametrize("agg,learn_eps,apply,edge_w", [
    (a, e, f, w) for a, e, f, w in itertools.product(["sum", "mean", "max"], [False, True],
                                                     ["linear", "mlp"], [False, True])
    if not (a == "max" and w)])
def test_gin(agg, learn_eps, apply, edge_w):
    def make(k_in, k_out):
        func = nn.Linear(k_in, k_out) if apply == "linear" else mlp(k_in, k_out)
        layer = GINConv(func, agg, init_eps=0.3, learn_eps=learn_eps, activation=torch.tanh)
        return layer
    check_layer(make, edge_w=edge_w)


def test_gin_without_apply_func():
    g = GRAPHS["directed"]()
    layer = GINConv(None, "sum", init_eps=0.5, learn_eps=True)
    x = feats(g, 6)
    check_all_plans(layer, (g, x), {}, [x, layer.eps])


def test_gin_tree_counts():
    """((1+eps) H + A H) W: kept as is (1 tree for the outer product, 1 for each of (1+eps) H
    and A H inside it), or distributed to (1+eps) H W + A H W where each product has 2 trees;
    7 trees over the products of both forms (5 combinations). Pruning keeps aggregate-first
    for k_in < k_out and update-first (H W shared by both terms) for k_in >= k_out; the mixed
    ones need two GEMMs.
    The paper counts 8 and 4 for GIN: its GIN also folds (1 + eps) I into the adjacency.
    Each promoted plan has a fused variant whose aggregation adds ``(1 + eps) H`` (or its
    product) as each row is written."""
    from granii.runtime.variants import compile_layer as _compile
    g = GRAPHS["directed"]()
    layer = GINConv(nn.Linear(4, 3), "sum")
    comp = _compile(layer, frozenset(), False, {"graph": g, "feat": torch.randn(40, 4),
                                                "self": layer})
    assert (comp.n_trees, comp.n_promoted) == (7, 2)
    promoted, fused = comp.plans[:comp.n_promoted], comp.plans[comp.n_promoted:]
    assert sorted(p.scenarios for p in promoted) == [("<",), (">=",)]
    assert sorted(p.index for p in fused) == sorted(f"{p.index}n" for p in promoted)
    for plan in fused:
        prims = [s.prim for s in plan.steps]
        assert "add" not in prims and "spmm" not in prims, prims
        (agg,) = [s for s in plan.steps if s.prim == "spmm_norm"]
        assert agg.args[:2] == (None, None) and len(agg.args) == 6, agg.args


@pytest.mark.parametrize("k_in,k_out,orders", [(6, 6, 2), (6, 3, 1), (3, 6, 1)])
def test_equal_widths_let_both_orders_compete(k_in, k_out, orders):
    """At k_in == k_out, aggregating first and multiplying first are symbolic duplicates (each
    scenario keeps one), yet they run at different speeds (GIN's bias and self term fuse into
    the GEMM only when it comes last): both are ranked. Otherwise only the scenario's plans."""
    from granii.costmodel import AnalyticalCost
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.select import rank
    g = GRAPHS["directed"]()
    layer = GINConv(nn.Linear(k_in, k_out), "sum")
    with torch.no_grad():
        call = prepare(new_state(layer), layer, (g, torch.randn(g.num_nodes(), k_in)), {})
    ranked = rank(call.compiled.plans, call.gi, call.symbols, AnalyticalCost())
    assert len({str(c.plan.index).rstrip("ghn") for c in ranked}) == orders   # fused variants aside
    assert len({c.plan.scenarios for c in ranked}) == orders


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sgc(k):
    check_layer(lambda a, b: SGConv(a, b, k=k, allow_zero_in_degree=True))


def test_sgc_cached_stores_and_reuses_like_dgl():
    g = GRAPHS["undirected"]()
    torch.manual_seed(0)
    ref = SGConv(6, 3, k=2, cached=True)
    layer = copy.deepcopy(ref)
    x = torch.randn(g.num_nodes(), 6)
    granii(layer, g, x)                      # inspecting the model leaves its cache empty
    assert layer._cached_h is None
    torch.testing.assert_close(layer(g, x), ref(g, x))   # the first call fills it, as DGL's
    torch.testing.assert_close(layer._cached_h, ref._cached_h)
    x2 = torch.randn(g.num_nodes(), 6)       # DGL ignores new features once cached: so must we
    torch.testing.assert_close(layer(g, x2), ref(g, x2))
    st = layer_states(layer)[0]
    assert sum(len(v) for v in st.compiled.values()) == 2   # uncached and cached variants


@pytest.mark.parametrize("aggregator", ["mean", "gcn"])
def test_sage_graphs_and_blocks(aggregator):
    """Every plan equals DGL on graphs, weighted graphs and blocks; ``gcn`` divides by
    ``deg + 1`` (a node without in-edges keeps its own features)."""
    make = lambda a, b: SAGEConv(a, b, aggregator, activation=torch.relu)
    check_layer(make)
    check_layer(make, edge_w=True)
    b = block()
    for k_in, k_out in SIZES:
        layer = make(k_in, k_out)
        x = feats(b, k_in)
        check_all_plans(layer, (b, x), {}, [x] + list(layer.parameters()))


def test_sage_gcn_aggregator_is_optimized_with_a_shifted_degree_leaf():
    """``(A H + H) / (deg + 1)``: the shifted degree ``(D_in + 1)^-1`` is a leaf of its own."""
    g = GRAPHS["undirected"]()
    layer = granii(SAGEConv(5, 9, "gcn", activation=torch.relu), g, feats(g, 5))
    text = explain(layer, file=io.StringIO())
    assert "NOT OPTIMIZED" not in text and "(D_in+1)^-1" in text


def test_sage_on_sampled_blocks_from_the_data_loader():
    g = GRAPHS["undirected"]()
    x = torch.randn(g.num_nodes(), 8)

    class SAGE(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([SAGEConv(8, 16, "mean"), SAGEConv(16, 4, "mean")])

        def forward(self, blocks, h):
            for layer, b in zip(self.layers, blocks):
                h = layer(b, h)
            return h

    torch.manual_seed(0)
    ref = SAGE()
    model = copy.deepcopy(ref)
    sampler = dgl.dataloading.NeighborSampler([3, 3])
    loader = dgl.dataloading.DataLoader(g, torch.arange(g.num_nodes()), sampler, batch_size=10,
                                        shuffle=False)
    for i, (inp, out, blocks) in enumerate(loader):
        h = x[inp]
        if i == 0:
            for layer, b in zip(model.layers, blocks):
                granii(layer, b, h if layer is model.layers[0] else
                       torch.randn(b.num_src_nodes(), 16))
        torch.testing.assert_close(model(blocks, h), ref(blocks, h), atol=1e-5, rtol=1e-4)


class WeightedGCN(nn.Module):
    """A user-written GCN variant: aggregation weighted by an edge tensor, DGL built-ins."""

    def __init__(self, k_in, k_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k_in, k_out) * 0.3)

    def forward(self, g, h, w):
        with g.local_scope():
            g.srcdata["h"] = h
            g.edata["w"] = w
            g.update_all(fn.u_mul_e("h", "w", "m"), fn.sum("m", "h"))
            return torch.relu(g.dstdata["h"] @ self.weight)


class EdataGCN(nn.Module):
    """A user layer reading edge weights attached to the graph before the call."""

    def __init__(self, k_in, k_out):
        super().__init__()
        self.lin = nn.Linear(k_in, k_out)

    def forward(self, g, h):
        with g.local_scope():
            g.ndata["h"] = self.lin(h)
            g.update_all(fn.u_mul_e("h", "w", "m"), fn.mean("m", "h"))
            return g.ndata["h"]


def test_user_written_layers_are_optimized():
    for gname, make_g in GRAPHS.items():
        g = make_g()
        for k_in, k_out in SIZES:
            layer = WeightedGCN(k_in, k_out)
            x = feats(g, k_in)
            w = edge_weights(g).requires_grad_()
            check_all_plans(layer, (g, x, w), {}, [x, w, layer.weight])
            layer = EdataGCN(k_in, k_out)
            g.edata["w"] = edge_weights(g, seed=7)
            check_all_plans(layer, (g, x), {}, [x] + list(layer.parameters()))
    layer = WeightedGCN(4, 3)
    granii(layer, g, torch.randn(g.num_nodes(), 4), inspect_now=False)
    layer(g, torch.randn(g.num_nodes(), 4), edge_weights(g))
    text = granii.explain(layer, file=io.StringIO())
    assert "NOT OPTIMIZED" not in text and "<- chosen" in text


def test_gin_max_with_edge_weight_falls_back_with_reason():
    g = GRAPHS["directed"]()
    layer = GINConv(nn.Linear(4, 3), "max")
    x, w = torch.randn(g.num_nodes(), 4), edge_weights(g)
    ref = layer(g, x, w)
    granii(layer, g, x)
    torch.testing.assert_close(layer(g, x, w), ref)
    text = granii.explain(layer, file=io.StringIO())
    assert "fn.max with fn.u_mul_e" in text


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_tagconv(k):
    check_layer(lambda a, b: TAGConv(a, b, k=k, activation=torch.relu))


def test_tagconv_horner_plan_is_promoted():
    """Factoring the hop sum (H W0 + N (H W1 + N H W2)) gives one aggregation per hop at the
    output width; it must survive pruning for k_in >= k_out."""
    from granii.runtime.variants import compile_layer as _compile
    g = GRAPHS["undirected"]()
    layer = TAGConv(4, 3, k=2)
    comp = _compile(layer, frozenset(), False, {"graph": g, "feat": torch.randn(40, 4),
                                                "self": layer})
    ge = [p for p in comp.plans if ">=" in p.scenarios]
    assert any(p.composition().count("spmm") == 2 and
               all(s.sig[2][-1] == "k_out" for s in p.steps
                   if s.sig and s.prim.startswith("spmm")) for p in ge)


def test_products_accumulate_in_place_only_into_fresh_results():
    """Plans that add two products (TAGConv's hops, SAGEConv's self and neighbour terms) add the
    second into the first in place; over repeated calls on the same features (whose
    once-per-input results are reused) the output, the gradients and the features stay DGL's."""
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.runtime.variants import run_plan
    from granii.plan import plan_code
    from plan_check import grads, impl_choices
    g = GRAPHS["undirected"]()
    for layer in (TAGConv(6, 4, k=2), SAGEConv(6, 4, "mean")):
        x = feats(g, 6)
        x0 = x.detach().clone()
        ref = layer(g, x)
        ref_grads = grads(ref, [x] + list(layer.parameters()))
        call = prepare(new_state(layer), layer, (g, x), {})
        accumulating = [(p, i) for p in call.compiled.plans for i in impl_choices(p)
                        if "into=True" in plan_code(p, i)]
        assert accumulating, type(layer).__name__
        for plan, impls in accumulating:
            for _ in range(3):
                out = run_plan(call, plan, impls)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
                for a, b in zip(grads(out, [x] + list(layer.parameters())), ref_grads):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert torch.equal(x.detach(), x0)


def test_tagconv_with_many_hops_is_optimized():
    """From 8 hops TAGConv used to fall back; its enumeration is now polynomial in the hops
    (tests/test_khop.py)."""
    g = GRAPHS["undirected"]()
    layer = TAGConv(4, 3, k=8)
    x = torch.randn(g.num_nodes(), 4)
    ref = layer(g, x)
    granii(layer, g, x)
    torch.testing.assert_close(layer(g, x), ref)
    assert "NOT OPTIMIZED" not in granii.explain(layer, file=io.StringIO())


@pytest.mark.parametrize("heads,residual,edge_w", [(1, False, False), (1, True, True),
                                                   (3, False, True), (3, True, False)])
def test_gat(heads, residual, edge_w):
    check_layer(lambda a, b: GATConv(a, b, heads, residual=residual, allow_zero_in_degree=True,
                                     activation=torch.nn.functional.elu), edge_w=edge_w)
    b = block()
    layer = GATConv(6, 4, heads, residual=residual, allow_zero_in_degree=True)
    x = feats(b, 6)
    check_all_plans(layer, (b, x), {}, [x] + list(layer.parameters()))


def test_gat_shows_reuse_and_recompute_compositions():
    g = GRAPHS["undirected"]()
    layer = GATConv(8, 16, 1, allow_zero_in_degree=True)
    granii(layer, g, torch.randn(g.num_nodes(), 8))
    text = granii.explain(layer, file=io.StringIO())
    # reuse: aggregate Theta = H W (spmm_weighted after the GEMM); recompute: aggregate H, then W
    assert "spmm_weighted[A[" in text and "gemm[spmm_weighted[A[" in text
    assert "<- chosen" in text


def test_gat_heads_reach_the_cost_model():
    """With 4 heads, scores and softmax are priced with 4 values per edge, and the weighted SpMM
    over the heads as one call of the full width (32) in both implementations."""
    import inspect
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.costmodel import AnalyticalCost
    from granii.select import price
    seen = []

    class Recorder(AnalyticalCost):
        def predict(self, prim, impl, gi, dims):
            seen.append((prim, impl, dict(dims)))
            return super().predict(prim, impl, gi, dims)

    g = GRAPHS["undirected"]()
    layer = GATConv(6, 8, 4, allow_zero_in_degree=True)       # 4 heads of 8: width 32
    state = new_state(layer, "gat")
    call = prepare(state, layer, (g, torch.randn(g.num_nodes(), 6)), {})
    for plan in call.compiled.plans:
        price(plan, call.gi, call.symbols, Recorder(), False, False, 1)
    assert {d.get("heads") for p, _, d in seen if p in ("sddmm_add", "edge_softmax")} == {4}
    widths = {(i, d["k"]) for p, i, d in seen if p == "spmm_weighted"}
    from granii.kernels import implementations
    # the projected features' product over the heads is one call of their full width (32); the
    # raw features' sum per head (``spmm_heads``) is priced as one-head calls of width k_in (6)
    assert widths == {(i, 32) for i in implementations("spmm_weighted")} | {
        (i, 6) for i in implementations("spmm_heads")}


def test_gat_heads_aggregate_raw_features_on_blocks():
    """With several heads the enumerator also sums the raw features per head and projects each
    head's sum on the destination rows (``spmm_heads -> head_gemm``): derived, not listed, and
    its memory counts a (N_dst, H, k_in) result."""
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.memory import step_bytes
    b = block()
    layer = GATConv(6, 8, 4, allow_zero_in_degree=True)
    call = prepare(new_state(layer), layer, (b, feats(b, 6)), {})
    plans = [p for p in call.compiled.plans if "spmm_heads" in p.composition()]
    assert plans and all(p.composition().endswith("spmm_heads -> head_gemm") for p in plans)
    step = next(s for s in plans[0].steps if s.prim == "spmm_heads")
    assert step_bytes(step, call.symbols, heads=4) == 4 * b.num_dst_nodes() * 4 * 6
    one = GATConv(6, 8, 1, allow_zero_in_degree=True)          # one head: plain re-association
    call = prepare(new_state(one), one, (b, feats(b, 6)), {})
    assert not any("spmm_heads" in p.composition() for p in call.compiled.plans)


def test_per_head_primitives_are_priced_from_one_head_models():
    """``head_gemm`` is H GEMMs of one head's width; the native ``spmm_heads`` one weighted product
    plus a result block per further head (cheaper than H products), DGL's H products."""
    from granii.costmodel import AnalyticalCost
    from granii.graph import graph_info
    from granii.select import _predict
    g = graph_info(GRAPHS["undirected"]())
    model = AnalyticalCost()
    gemm = _predict(model, "gemm", "torch", g, {"m": 500, "k": 64, "n": 16}, 1)
    assert _predict(model, "head_gemm", "torch", g, {"m": 500, "k": 64, "n": 64}, 4) == \
        pytest.approx(4 * gemm)
    one = {impl: _predict(model, "spmm_weighted", impl, g, {"n": g.num_dst, "k": 64}, 1)
           for impl in ("native", "dgl")}
    heads = {impl: _predict(model, "spmm_heads", impl, g, {"n": g.num_dst, "k": 64}, 4)
             for impl in ("native", "dgl")}
    assert one["native"] < heads["native"] < 4 * one["native"]
    assert heads["dgl"] == pytest.approx(4 * one["dgl"])


def test_per_head_primitives_use_their_own_models_when_profiled():
    """Models that have ``head_gemm`` / ``spmm_heads`` price them by those, with the head count
    among the sizes, forward and training (no one-head derivation)."""
    from types import SimpleNamespace as NS
    from granii.select import _predict, step_seconds
    asked = []

    def predict(phase):
        return lambda prim, impl, gi, dims: asked.append((prim, phase, dims)) or 1.0
    model = NS(has_model=lambda prim, impl, phase="forward": prim in ("head_gemm", "spmm_heads"),
               predict=predict("forward"), predict_train=predict("train"))
    dims = {"m": 500, "k": 64, "n": 64}
    assert _predict(model, "head_gemm", "torch", None, dims, 4) == 1.0
    assert step_seconds(model, "spmm_heads", "native", None, {"k": 64}, 4, (0, 1)) == 1.0
    assert asked == [("head_gemm", "forward", dict(dims, heads=4)),
                     ("spmm_heads", "forward", {"k": 64, "heads": 4}),
                     ("spmm_heads", "train", {"k": 64, "heads": 4})]


def test_per_head_primitives_use_the_models_fallen_back_to():
    """Models without per-head ones (a ``--quick`` init) whose fallback (another machine's models,
    transferred) has them: the per-head primitives are priced through those, not derived."""
    from types import SimpleNamespace as NS
    from granii.select import _predict
    asked = []
    other = NS(has_model=lambda prim, impl, phase="forward": prim == "head_gemm",
               fallback=None)
    quick = NS(has_model=lambda prim, impl, phase="forward": prim == "gemm", fallback=other,
               predict=lambda prim, impl, gi, dims: asked.append(prim) or 2.0)
    assert _predict(quick, "head_gemm", "torch", None, {"m": 500, "k": 64, "n": 64}, 4) == 2.0
    assert asked == ["head_gemm"]
    other.has_model = lambda prim, impl, phase="forward": False      # nobody has it: 4 GEMMs
    assert _predict(quick, "head_gemm", "torch", None, {"m": 500, "k": 64, "n": 64}, 4) == 8.0
    assert asked == ["head_gemm", "gemm"]


def _sage_on_loader(per_batch, monkeypatch):
    """A 2-layer SAGE over the batches of a neighbour-sampling loader, DGL beside granii;
    returns the states of granii's layers and how many times a layer ranked plans."""
    import granii.runtime.decide as api
    ranked = []
    real_rank = api.rank
    monkeypatch.setattr(api, "rank", lambda *a, **k: ranked.append(1) or real_rank(*a, **k))
    dgl.seed(0)
    g = dgl.to_bidirected(dgl.rand_graph(300, 1500))
    x = torch.randn(g.num_nodes(), 8)
    torch.manual_seed(0)
    ref = nn.ModuleList([SAGEConv(8, 16, "mean"), SAGEConv(16, 4, "mean")])
    model = copy.deepcopy(ref)
    loader = dgl.dataloading.DataLoader(g, torch.arange(120), dgl.dataloading.NeighborSampler(
        [4, 4]), batch_size=30, shuffle=False)
    first = True
    for inp, _, blocks in loader:      # inference: the decision granii made is the one reused
        h, hr = x[inp], x[inp]
        for layer, lr, b in zip(model, ref, blocks):
            if first:
                granii(layer, b, h, per_batch=per_batch, inspect_now=False)
            with torch.no_grad():
                h, hr = layer(b, h), lr(b, hr)
            torch.testing.assert_close(h, hr, atol=1e-5, rtol=1e-4)
        first = False
    return layer_states(model), len(ranked)


def test_sampled_blocks_reuse_the_first_decision(monkeypatch):
    states, n_ranked = _sage_on_loader(False, monkeypatch)
    assert n_ranked == 2                      # one decision per layer, on the first batch
    assert [s.reused for s in states] == [3, 3]   # the 3 batches after the first
    text = granii.explain(states[0].module, file=io.StringIO())
    assert "reused that decision" in text


def test_sampled_blocks_decide_per_batch_when_asked(monkeypatch):
    states, n_ranked = _sage_on_loader(True, monkeypatch)
    assert [s.reused for s in states] == [0, 0]
    assert n_ranked >= 8                      # every batch, every layer
