"""The dispatcher: measured tie-break (tune), deterministic decisions, fallbacks it must take."""
import copy
import dataclasses

import dgl
import pytest
import torch
import dgl.function as fn
from dgl.nn import GraphConv, SAGEConv
from torch import nn

from granii import granii
from granii.runtime import fastpath, tiebreak
from granii.costmodel import AnalyticalCost
from granii.runtime.dispatch import layer_states
from granii.runtime.tiebreak import TRIAL_MORE_ROUNDS, TRIAL_ROUNDS
from granii.select import TRIAL_PLANS


def _graph():
    dgl.seed(1)
    return dgl.add_self_loop(dgl.rand_graph(300, 2400))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = SAGEConv(12, 16, "mean", feat_drop=0.3, activation=torch.relu)
        self.drop = nn.Dropout(0.4)
        self.b = GraphConv(16, 5)

    def forward(self, g, x):
        return self.b(g, self.drop(self.a(g, x)))


def _two_layers_optimized():
    """``(graph, TwoLayers, its copy after granii(...), features)``, seeded."""
    g = _graph()
    torch.manual_seed(0)
    ref = TwoLayers()
    model = copy.deepcopy(ref)
    x = torch.randn(g.num_nodes(), 12)
    granii(model, g, x, cost_model=AnalyticalCost())
    return g, ref, model, x


def test_trial_calls_give_dgls_results_and_settle():
    """While the candidates take turns, every training call equals DGL's under the same seed
    (dropout draws included); after a bounded number of calls one candidate is kept."""
    g, ref, model, x = _two_layers_optimized()
    # the plans, one implementation variant, one plan of another library's graph kernels and
    # the original forward: one untimed and TRIAL_ROUNDS timed calls each (TRIAL_MORE_ROUNDS
    # for those that measure close), the last backward recorded on the call after
    n_calls = (TRIAL_PLANS + 3) * (TRIAL_MORE_ROUNDS + 1) + 2
    for i in range(n_calls):
        torch.manual_seed(100 + i)
        out = model(g, x)
        torch.manual_seed(100 + i)
        want = ref(g, x)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        out.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
    states = layer_states(model)
    assert all(st.tuned is not None for st in states)
    for st in states:
        times, kept = st.tuned
        assert kept in [label for label, _ in times]
        assert any(label == "original forward" for label, _ in times)
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert "measured on the first calls" in text


def test_deterministic_makes_no_measured_decision():
    g = _graph()
    model = TwoLayers()
    x = torch.randn(g.num_nodes(), 12)
    granii(model, g, x, cost_model=AnalyticalCost(), deterministic=True)
    for _ in range(3 * (TRIAL_ROUNDS + 2)):
        model(g, x)
    assert all(st.tuned is None for st in layer_states(model))
    chosen = [st.last[2].plan.index for st in layer_states(model)]
    again = copy.deepcopy(model)
    for _ in range(3):
        again(g, x)
    assert [st.last[2].plan.index for st in layer_states(again)] == chosen


def test_heterogeneous_graph_runs_the_original_forward():
    g = dgl.heterograph({("a", "r", "b"): (torch.tensor([0, 1]), torch.tensor([1, 0])),
                         ("b", "s", "a"): (torch.tensor([0]), torch.tensor([1]))})
    layer = dgl.nn.HeteroGraphConv({"r": GraphConv(3, 2), "s": GraphConv(3, 2)})
    feats = {"a": torch.randn(2, 3), "b": torch.randn(2, 3)}
    want = layer(g, feats)
    granii(layer, g, feats, cost_model=AnalyticalCost())
    got = layer(g, feats)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_wrong_feature_width_says_what_to_do():
    g = _graph()
    layer = GraphConv(12, 4)
    granii(layer, g, torch.randn(g.num_nodes(), 12), cost_model=AnalyticalCost())
    with pytest.raises(ValueError, match="in_feats=7"):
        layer(g, torch.randn(g.num_nodes(), 7))


@pytest.mark.parametrize("option, value, error, says", [
    ("expected_calls", 0, ValueError, "at least 1"),
    ("expected_calls", -5, ValueError, "at least 1"),
    ("expected_calls", "many", ValueError, "expected_calls"),
    ("reuse_inputs", "false", TypeError, "True or False"),
    ("per_batch", 1, TypeError, "True or False"),
    ("memory_limit", "1GB", TypeError, "number of bytes"),
    ("decisions", [1, 2], ValueError, "save_decisions"),
    ("decisions", {"a": {"k": "plan 1"}}, ValueError, "save_decisions"),
    ("decisions", {"format": 0, "layers": {}}, ValueError, "format 0"),
    ("cost_model", 5, TypeError, "predict"),
])
def test_options_it_cannot_mean_are_refused_naming_them(option, value, error, says):
    """A value no option can mean is refused before anything is wrapped, naming the option (not
    a ZeroDivisionError or a string read as True deep inside)."""
    g = _graph()
    layer = GraphConv(12, 4)
    with pytest.raises(error, match=says):
        granii(layer, g, torch.randn(g.num_nodes(), 12), **{option: value})
    assert "forward" not in layer.__dict__
    with pytest.raises(TypeError, match="torch.nn.Module"):
        granii(None, g, torch.randn(g.num_nodes(), 12))


def test_a_cost_model_folder_path_and_a_cost_model_without_a_name_are_taken(tmp_path):
    """``cost_model=`` a folder's path loads it (a folder that is not one is refused with the
    fix); an object with only ``predict`` (the documented contract) serves as a cost model."""
    from granii.learned import CostModelError

    class Flat:
        def predict(self, prim, impl, gi, dims):
            return 1e-3

    g = _graph()
    x = torch.randn(g.num_nodes(), 12)
    layer = GraphConv(12, 4)
    want = layer(g, x)
    granii(layer, g, x, cost_model=Flat())
    torch.testing.assert_close(layer(g, x), want)
    with pytest.raises(CostModelError, match="cost-model folder"):
        granii(GraphConv(12, 4), g, x, cost_model=str(tmp_path / "nothing"))


def test_the_models_own_exception_comes_back_unchanged():
    """An exception raised by the user's model while granii runs it once reaches the user as it
    was raised (whatever its constructor takes), and the model is left unwrapped."""
    class Refused(Exception):
        def __init__(self, code, detail):
            super().__init__(f"{code}: {detail}")
            self.code = code

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GraphConv(12, 4)

        def forward(self, g, x):
            self.conv(g, x)
            raise Refused(3, "no")

    g = _graph()
    model = Model()
    with pytest.raises(Refused, match="3: no") as raised:
        granii(model, g, torch.randn(g.num_nodes(), 12), cost_model=AnalyticalCost())
    assert raised.value.code == 3
    assert "forward" not in model.conv.__dict__


def test_a_forward_taking_the_features_first_is_told_what_to_pass():
    """granii's deciding run calls ``model(graph, feats)``; a forward written ``(x, g)`` fails
    in it with a note that says so, and works with ``inspect_now=False``."""
    import sys

    class FeaturesFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GraphConv(12, 4)

        def forward(self, x, g):
            return self.conv(g, x)

    g = _graph()
    x = torch.randn(g.num_nodes(), 12)
    model = FeaturesFirst()
    want = model(x, g)
    with pytest.raises(AttributeError) as raised:
        granii(model, g, x, cost_model=AnalyticalCost())
    if sys.version_info >= (3, 11):
        assert "inspect_now=False" in raised.value.__notes__[0]
    granii(model, g, x, cost_model=AnalyticalCost(), inspect_now=False)
    torch.testing.assert_close(model(x, g), want)
    assert layer_states(model)[0].fallback is None


def test_a_wrong_width_is_a_runtime_error_as_in_dgl():
    """DGL's layer refuses a wrong width with torch's RuntimeError; the optimized one refuses it
    with a message that says what to do, catchable as that RuntimeError (and as ValueError)."""
    g = _graph()
    layer = SAGEConv(12, 8, "mean")
    granii(layer, g, torch.randn(g.num_nodes(), 12), cost_model=AnalyticalCost())
    with pytest.raises(RuntimeError, match=r"'fc_self.weight\^T' is \(12, 8\).*in_feats=7"):
        layer(g, torch.randn(g.num_nodes(), 7))


def test_cache_limit_takes_only_a_number_of_bytes():
    from granii import graph as G
    old = G.CACHE_LIMIT["bytes"]
    for bad in (-1, "abc", None, float("inf"), True):
        with pytest.raises(ValueError, match="number of bytes"):
            G.set_cache_limit(bad)
        assert G.CACHE_LIMIT["bytes"] == old


def test_saved_decisions_are_run_again_without_deciding(tmp_path, monkeypatch):
    """A model's decisions saved to a file and given to a fresh copy: the copy runs the same
    plans, ranks nothing, and gives the same outputs; a damaged file is refused clearly."""
    import granii.runtime.decide as decide
    g = _graph()
    torch.manual_seed(0)
    model = TwoLayers().eval()
    fresh = copy.deepcopy(model)
    x = torch.randn(g.num_nodes(), 12)
    granii(model, g, x, cost_model=AnalyticalCost(), tune=False)
    with torch.no_grad():
        want = model(g, x)
    path = tmp_path / "decisions.json"
    saved = granii.save_decisions(model, path)
    assert all(saved["layers"][st.name] for st in layer_states(model))
    ranked = []
    real = decide.rank
    monkeypatch.setattr(decide, "rank", lambda *a, **k: ranked.append(1) or real(*a, **k))
    granii(fresh, g, x, cost_model=AnalyticalCost(), decisions=str(path))
    with torch.no_grad():
        got = fresh(g, x)
    assert not ranked
    torch.testing.assert_close(got, want)
    assert [st.last for st in layer_states(fresh)] == [None, None]
    assert granii.save_decisions(fresh)["layers"] == saved["layers"]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="save_decisions"):
        granii(copy.deepcopy(fresh), g, x, decisions=str(path))


def test_memory_limit_excludes_plans_above_it():
    """With a limit below the cheapest plan's predicted peak, a plan within it is chosen (or the
    smallest, if none is); explain shows each plan's memory."""
    from granii.memory import plan_memory
    g = _graph()
    x = torch.randn(g.num_nodes(), 64)
    free = GraphConv(64, 64)
    granii(free, g, x, cost_model=AnalyticalCost(), tune=False)
    symbols, ranking = layer_states(free)[0].last[:2]
    peaks = sorted({sum(plan_memory(c.plan, symbols)) for c in ranking})
    assert len(peaks) > 1, "the candidates should differ in memory"
    limited = copy.deepcopy(free)
    granii(limited, g, x, cost_model=AnalyticalCost(), tune=False, memory_limit=peaks[0])
    best = layer_states(limited)[0].last[2]
    assert sum(plan_memory(best.plan, symbols)) == peaks[0]
    with torch.no_grad():
        torch.testing.assert_close(limited(g, x), free(g, x))
    assert "memory (kept + per call)" in granii.explain(limited, file=open("/dev/null", "w"))


def test_one_output_layer_with_bias_is_optimized():
    """A one-element bias (a layer with one output) is added as a 1 x 1 operand: every plan
    equals DGL's layer, output and gradients."""
    from plan_check import check_all_plans
    g = _graph()
    x = torch.randn(g.num_nodes(), 8, requires_grad=True)
    layer = GraphConv(8, 1)
    with torch.no_grad():
        layer.bias.fill_(0.5)
    assert check_all_plans(layer, (g, x), {}, [x, layer.weight, layer.bias]) > 0


def test_extra_forward_arguments_reach_the_inspection_run():
    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GraphConv(6, 3, norm="none")

        def forward(self, g, x, w):
            return self.conv(g, x, edge_weight=w)

    g = _graph()
    x, w = torch.randn(g.num_nodes(), 6), torch.rand(g.num_edges())
    model = Weighted()
    want = model(g, x, w)
    granii(model, g, x, cost_model=AnalyticalCost(), extra_args=(w,))
    assert layer_states(model)[0].last is not None          # decided during granii()
    torch.testing.assert_close(model(g, x, w), want)


def test_per_graph_cache_is_bounded_and_results_stay_right():
    """With a cache limit far below what a layer keeps per graph, entries are dropped and made
    again: outputs still equal DGL's, and once counted the cache holds no more than the limit."""
    import dgl
    from dgl.nn import GraphConv
    from granii import granii as opt
    from granii import graph as G
    g = dgl.add_self_loop(dgl.rand_graph(300, 3000))
    torch.manual_seed(0)
    ref = GraphConv(8, 4, norm="both", allow_zero_in_degree=True)
    layer = copy.deepcopy(ref)
    old = G.CACHE_LIMIT["bytes"]
    try:
        G.set_cache_limit(4096)
        x0 = torch.randn(300, 8)
        opt(layer, g, x0)
        gi = G.graph_info(g)
        for _ in range(G.GraphCache.RECOUNT // 2 + 1):
            x = torch.randn(300, 8)
            assert torch.allclose(layer(g, x), ref(g, x), atol=1e-5)
            assert torch.allclose(layer(g, x0), ref(g, x0), atol=1e-5)
        gi.cache.shrink()
        assert G.nbytes(dict(gi.cache)) <= 4096
        x = torch.randn(300, 8)
        assert torch.allclose(layer(g, x), ref(g, x), atol=1e-5)
    finally:
        G.set_cache_limit(old)


# -- the fast path: repeated calls skip binding and deciding, and every change is still seen ---------
def _normal_path_calls(monkeypatch):
    """A list that grows by one each time a call takes the dispatcher's normal path."""
    from granii.runtime import dispatch
    calls, real = [], dispatch.prepare
    monkeypatch.setattr(dispatch, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _optimized_pair(make, g, x, grad=False, **opts):
    """A DGL layer and an optimized copy, after enough calls for the fast path to exist (for
    features seen again and for new ones: decisions differ by whether the features repeat)."""
    torch.manual_seed(0)
    ref = make()
    layer = copy.deepcopy(ref)
    granii(layer, g, x, cost_model=AnalyticalCost(), tune=False, **opts)
    with torch.set_grad_enabled(grad):
        # a graph's fast path is built once it has had ``_FAST_AFTER`` calls the normal way
        for feats in [x] * fastpath._FAST_AFTER + [x, x.clone(), x.clone()]:
            layer(g, feats)
    return layer, ref


def _gcn():
    return GraphConv(8, 4, norm="both")


def test_repeated_calls_take_the_fast_path_and_read_parameters_live(monkeypatch):
    """After the first calls, new features, in-place parameter updates and training steps run
    without the normal path, with DGL's outputs and gradients: parameters are read per call."""
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(g.num_nodes(), 8)
            torch.testing.assert_close(layer(g, x), ref(g, x))
        for m in (layer, ref):
            m.weight.mul_(-2.0)                   # an optimizer's in-place update
            m.bias.add_(1.0)
        torch.testing.assert_close(layer(g, x), ref(g, x))
    assert normal == []
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=1e-3) for m in (layer, ref))
    for step in range(4):
        outs = [m(g, x) for m in (layer, ref)]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
        for out, o in zip(outs, (opt, opt_ref)):
            o.zero_grad()
            out.square().sum().backward()
            o.step()
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)
        if step == 1:
            normal.clear()                        # the training mode has its fast path now
    assert normal == []
    torch.testing.assert_close(layer.weight, ref.weight, atol=1e-5, rtol=1e-4)


def _new_weight(m, g, x):
    torch.manual_seed(5)
    m.weight = nn.Parameter(torch.randn(8, 4))


def _wider_weight_data(m, g, x):
    torch.manual_seed(5)
    m.weight.data = torch.randn(8, 6)             # the same Parameter object, another shape
    m.bias.data = torch.randn(6)


def _loaded_state(m, g, x):
    torch.manual_seed(5)
    m.load_state_dict(GraphConv(8, 4, norm="both").state_dict())


def _assigned_state(m, g, x):
    torch.manual_seed(5)
    m.load_state_dict(GraphConv(8, 4, norm="both").state_dict(), assign=True)


# each: (what changes on both layers, whether the normal path must see it)
LAYER_CHANGES = {
    "weight re-assigned": (_new_weight, True),
    "weight of another shape through .data": (_wider_weight_data, True),
    "bias removed": (lambda m, g, x: setattr(m, "bias", None), True),
    "norm changed": (lambda m, g, x: setattr(m, "_norm", "right"), True),
    "activation set": (lambda m, g, x: setattr(m, "_activation", torch.relu), True),
    "load_state_dict (in place)": (_loaded_state, False),
    "load_state_dict(assign=True)": (_assigned_state, True),
}


@pytest.mark.parametrize("change", list(LAYER_CHANGES))
def test_a_changed_layer_is_seen(change, monkeypatch):
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    apply, seen = LAYER_CHANGES[change]
    for m in (layer, ref):
        apply(m, g, x)
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(layer(g, x), ref(g, x))
    if seen:
        assert normal, "the change must send the call through the normal path"
        assert len(normal) < 3, "after it, the fast path must hold again"


def test_to_float64_runs_dgls_forward_on_double_features():
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    layer.double()
    ref.double()
    with torch.no_grad():
        out = layer(g, x.double())
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, ref(g, x.double()))


def _edges_added(g):
    g.add_edges(torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]))
    return g


def _edges_removed(g):
    g.remove_edges(torch.tensor([0, 3, 9]))
    return g


def _same_sizes(g):
    dgl.seed(7)
    other = dgl.add_self_loop(dgl.rand_graph(g.num_nodes(), g.num_edges() - g.num_nodes()))
    assert (other.num_nodes(), other.num_edges()) == (g.num_nodes(), g.num_edges())
    return other


GRAPH_CHANGES = {"another graph of the same sizes": _same_sizes,
                 "edges added in place": _edges_added,
                 "edges removed in place": _edges_removed}


@pytest.mark.parametrize("change", list(GRAPH_CHANGES))
def test_a_changed_graph_is_seen(change, monkeypatch):
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    normal = _normal_path_calls(monkeypatch)
    g2 = GRAPH_CHANGES[change](g)
    with torch.no_grad():
        torch.testing.assert_close(layer(g2, x), ref(g2, x))
    assert normal


def test_deterministic_algorithms_switched_on_later_decide_without_measuring(monkeypatch):
    """A decision tuned by measurement is not reused once deterministic algorithms are
    switched on: the call decides again, by the cost model alone."""
    from granii.runtime import dispatch
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    torch.manual_seed(0)
    ref = _gcn()
    layer = copy.deepcopy(ref)
    granii(layer, g, x, cost_model=AnalyticalCost())
    with torch.no_grad():
        for _ in range(4 * (TRIAL_MORE_ROUNDS + 2)):
            layer(g, x)
    assert layer_states(layer)[0].tuned is not None
    decided = []
    real = dispatch.decide
    monkeypatch.setattr(dispatch, "decide",
                        lambda *a, **k: decided.append(real(*a, **k)) or decided[-1])
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            torch.testing.assert_close(layer(g, x), ref(g, x))
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(decided) == 1 and not isinstance(decided[0], tiebreak.Trial)


def test_a_thread_count_change_is_seen(monkeypatch):
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    normal = _normal_path_calls(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with torch.no_grad():
            torch.testing.assert_close(layer(g, x), ref(g, x))
    finally:
        torch.set_num_threads(threads)
    assert normal


def _sage():
    return SAGEConv(8, 4, "mean", feat_drop=0.0)


@pytest.mark.parametrize("change", ["dropout p", "eval", "no gradients", "frozen parameters"])
def test_a_changed_mode_or_dropout_is_seen(change, monkeypatch):
    """Training calls with dropout under the same seeds as DGL's layer: a changed dropout
    probability, eval mode, no_grad and parameters that stop requiring gradients."""
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_sage, g, x, grad=True)
    normal = _normal_path_calls(monkeypatch)
    for m in (layer, ref):
        if change == "dropout p":
            m.feat_drop.p = 0.5
        elif change == "eval":
            m.eval()
        elif change == "frozen parameters":
            for p in m.parameters():
                p.requires_grad_(False)
    grad = change != "no gradients"
    with torch.set_grad_enabled(grad):
        for i in range(3):
            torch.manual_seed(10 + i)
            got = layer(g, x)
            torch.manual_seed(10 + i)
            torch.testing.assert_close(got, ref(g, x), atol=1e-5, rtol=1e-4)
    assert normal


def test_a_deep_copy_uses_its_own_parameters():
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    twin, twin_ref = copy.deepcopy(layer), copy.deepcopy(ref)
    with torch.no_grad():
        for m in (twin, twin_ref):
            m.weight.mul_(3.0)
        torch.testing.assert_close(twin(g, x), twin_ref(g, x))
        torch.testing.assert_close(layer(g, x), ref(g, x))
        torch.testing.assert_close(twin(g, x), twin_ref(g, x))


def test_features_changed_in_place_are_seen():
    """The same feature tensor again (its once-per-input work reused), then changed in place."""
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(layer(g, x), ref(g, x))
        x.mul_(2.0)
        torch.testing.assert_close(layer(g, x), ref(g, x))


def test_fast_entries_do_not_keep_a_graph_alive():
    import gc
    import weakref
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, _ = _optimized_pair(_gcn, g, x)
    st = layer_states(layer)[0]
    assert len(st.fast) == 1
    alive = weakref.ref(g)
    del g
    gc.collect()
    assert alive() is None
    assert len(st.fast) == 0


def test_keyword_edge_weights_and_their_absence_each_have_their_fast_path(monkeypatch):
    """Edge weights passed by keyword (new each call), then calls without them: each call
    signature gets its own fast path, with DGL's outputs."""
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    torch.manual_seed(0)
    ref = GraphConv(8, 4, norm="both")
    layer = copy.deepcopy(ref)
    granii(layer, g, x, cost_model=AnalyticalCost(), tune=False)
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        for i in range(2 * fastpath._FAST_AFTER + 8):
            w = torch.rand(g.num_edges())
            kw = {"edge_weight": w} if i % 2 else {}
            torch.testing.assert_close(layer(g, x.clone(), **kw), ref(g, x, **kw))
    # the graph's first calls, then one call per signature that builds its run
    assert 0 < len(normal) <= fastpath._FAST_AFTER + 2


class CheckedSum(nn.Module):
    """A layer whose own check reads the features' values, not only the graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, graph, feat):
        if (feat < -100).any():
            raise ValueError("features below -100")
        with graph.local_scope():
            graph.ndata["h"] = self.lin(feat)
            graph.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            return graph.ndata["h"]


def test_a_check_on_the_features_runs_on_every_fast_call(monkeypatch):
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(CheckedSum, g, x)
    assert layer_states(layer)[0].fallback is None
    normal = _normal_path_calls(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(layer(g, x.clone()), ref(g, x))
        assert normal == []
        bad = x.clone()
        bad[3, 1] = -1000.0
        with pytest.raises(ValueError, match="below -100"):
            layer(g, bad)
        torch.testing.assert_close(layer(g, x.clone()), ref(g, x))


def test_an_attribute_re_assigned_on_every_call_stops_making_fast_runs():
    """An equal but new object each call fails the identity check each time: after a bounded
    number of rebuilt fast runs the calls stay on the normal path, with DGL's outputs."""
    from granii.runtime.fastpath import _FAST_BUILDS
    g = _graph()
    x = torch.randn(g.num_nodes(), 8)
    layer, ref = _optimized_pair(_gcn, g, x)
    suffix = "th"
    with torch.no_grad():
        for _ in range(2 * _FAST_BUILDS):
            layer._norm = "bo" + suffix               # a new str object, equal to "both"
            torch.testing.assert_close(layer(g, x.clone()), ref(g, x))
    (table,) = layer_states(layer)[0].fast.values()
    assert [e.builds for k, e in table.items() if k is not fastpath._SEEN] == [_FAST_BUILDS]


def _blocks(n_batches, seed=0):
    """Two-layer blocks of ``n_batches`` batches of one neighbour sampler on one graph."""
    dgl.seed(seed)
    g = dgl.add_self_loop(dgl.rand_graph(400, 3000))
    sampler = dgl.dataloading.NeighborSampler([5, 5])
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        seeds = torch.randperm(g.num_nodes(), generator=gen)[:48]
        inp, _, blocks = sampler.sample_blocks(g, seeds)
        out.append((inp, blocks))
    return g, out


class BlockModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = SAGEConv(12, 16, "mean", activation=torch.relu)
        self.b = GraphConv(16, 5, allow_zero_in_degree=True)

    def forward(self, blocks, x):
        return self.b(blocks[1], self.a(blocks[0], x))


def _assert_step_matches(model, ref, run, seed=None):
    """One training step of ``run(model)`` and ``run(ref)`` (each after ``torch.manual_seed(seed)``
    when given): the same outputs and parameter gradients; the gradients are cleared after."""
    outs = []
    for m in (model, ref):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(run(m))
    out, want = outs
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    out.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
        p.grad, q.grad = None, None


def _optimized_on_blocks(model_class, n_batches):
    """``(batches, features, DGL's model, its copy after granii(...) on the first batch)``: the
    two models have the same weights (seed 0)."""
    g, batches = _blocks(n_batches)
    x_all = torch.randn(g.num_nodes(), 12)
    torch.manual_seed(0)
    ref = model_class()
    model = copy.deepcopy(ref)
    inp0, blocks0 = batches[0]
    granii(model, blocks0, x_all[inp0], cost_model=AnalyticalCost())
    return batches, x_all, ref, model


def test_trial_on_sampled_blocks_settles_and_keeps_dgls_results():
    """On blocks used once, the candidates take turns on successive blocks of the sampler
    configuration (each time divided by the block's size); every block's outputs and gradients
    are DGL's, and once settled the kept decision serves the later blocks."""
    batches, x_all, ref, model = _optimized_on_blocks(BlockModel, 6 * (TRIAL_ROUNDS + 1) + 2)
    for inp, blocks in batches:
        _assert_step_matches(model, ref, lambda m: m(blocks, x_all[inp]))
    for st in layer_states(model):
        assert st.tuned is not None, st.name
        times, kept = st.tuned
        assert any(label == "original forward" for label, _ in times)
        assert any(not hasattr(d, "candidates") for d in st.sampled.values())  # a kept one
        assert st.reused > 0


class DropBlockModel(BlockModel):
    def forward(self, blocks, x):
        h = nn.functional.dropout(self.a(blocks[0], x), 0.5, self.training)
        return self.b(blocks[1], h)


def _count_decisions(monkeypatch):
    """Record ``(training, input_repeats)`` of every call that ranks plans."""
    from granii.runtime import decide as deciding
    made, decide = [], deciding._decide

    def counted(state, options, call):
        made.append((call.training, call.input_repeats))
        return decide(state, options, call)
    monkeypatch.setattr(deciding, "_decide", counted)
    return made


def test_inspection_on_blocks_decides_for_the_training_steps(monkeypatch):
    """``granii(model, blocks, x)`` on a model in training mode decides in its own run what the
    training steps use: with gradients, for features not seen before. The first step (the same
    batch, the same features) and the later batches decide nothing more, the run took no turn
    of a tie-break, and every step gives DGL's outputs and gradients, dropout included."""
    made = _count_decisions(monkeypatch)
    batches, x_all, ref, model = _optimized_on_blocks(DropBlockModel, 4)
    assert made == [(True, False), (True, False)]
    for st in layer_states(model):
        trials = [d for d in st.sampled.values() if hasattr(d, "candidates")]
        assert trials and all(t.turn == 0 and not t.times and not t.pending for t in trials)
    for i, (inp, blocks) in enumerate(batches):
        _assert_step_matches(model, ref, lambda m: m(blocks, x_all[inp]), seed=i)
    assert len(made) == 2


def test_inspection_on_a_whole_graph_leaves_no_timing_hook_and_dgls_training(monkeypatch):
    """On a whole graph the run decides for training too; a later call on the same features is
    a repeat (decided for that), no tie-break hook stays on a parameter after the run, and the
    training steps give DGL's outputs and gradients."""
    made = _count_decisions(monkeypatch)
    dgl.seed(0)
    g = dgl.add_self_loop(dgl.rand_graph(300, 2000))
    x = torch.randn(300, 12)
    torch.manual_seed(0)
    ref = nn.ModuleDict({"a": GraphConv(12, 16), "b": GraphConv(16, 4)})

    class Two(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, g, x):
            h = nn.functional.dropout(torch.relu(self.layers["a"](g, x)), 0.5, self.training)
            return self.layers["b"](g, h)
    model, want_model = Two(copy.deepcopy(ref)), Two(ref)
    granii(model, g, x, cost_model=AnalyticalCost())
    assert made == [(True, False), (True, False)]
    assert all(not p._backward_hooks for p in model.parameters())
    for i in range(3):
        _assert_step_matches(model, want_model, lambda m: m(g, x), seed=i)
    # the first layer's features come back: decided once more, as a repeat; the second's are
    # new at each step and take the run's decision
    assert made[2:] == [(True, True)]


def test_inspection_decides_without_gradients_for_inference(monkeypatch):
    """In eval mode, or under ``torch.no_grad()``, the run decides for calls without gradients,
    and an inference call after it decides nothing more."""
    made = _count_decisions(monkeypatch)
    g, batches = _blocks(1)
    x = torch.randn(g.num_nodes(), 12)
    inp, blocks = batches[0]
    model = DropBlockModel().eval()
    granii(model, blocks, x[inp], cost_model=AnalyticalCost())
    trained = DropBlockModel()
    with torch.no_grad():
        granii(trained, blocks, x[inp], cost_model=AnalyticalCost())
    assert made == [(False, False)] * 4
    with torch.no_grad():
        model(blocks, x[inp])
    assert len(made) == 4


def test_backward_clock_times_a_layers_backward_and_lets_go():
    """In training a trial call is timed forward + backward: the clock starts when the output's
    gradient arrives and stops at the last gradient of the layer's inputs and parameters."""
    from granii.runtime.tiebreak import BackwardClock
    layer = nn.Linear(8, 4)
    x = torch.randn(16, 8, requires_grad=True)
    out = layer(x)
    clock = BackwardClock.of(out, layer, (x,), 1.0)
    assert clock.seconds() is None                 # no backward yet
    out.square().sum().backward()
    assert clock.seconds() is not None and clock.seconds() >= 0
    clock.remove()
    assert not clock.handles
    with torch.no_grad():
        assert BackwardClock.of(layer(x), layer, (x,), 1.0) is None
    frozen = nn.Linear(8, 4).requires_grad_(False)
    assert BackwardClock.of(frozen(x.detach()), frozen, (x.detach(),), 1.0) is None


def test_backward_clock_counts_only_the_backward_of_its_call(monkeypatch):
    """The parameters' hooks stay until the trial's next turn reads the clock, which can come a
    training step or more later: a later step's backward fires them again, and must not move the
    clock's end (it once read 10-40 ms for a 0.3 ms layer, the span from one step to the next)."""
    from granii.runtime.tiebreak import BackwardClock
    ticks = iter(range(1000))
    monkeypatch.setattr(tiebreak.time, "perf_counter", lambda: float(next(ticks)))
    layer = nn.Linear(8, 4)
    x = torch.randn(16, 8)
    out = layer(x)
    clock = BackwardClock.of(out, layer, (x,), 1.0)
    out.sum().backward()
    first = clock.seconds()
    assert first is not None and first > 0     # the output's gradient, then the parameters'
    for _ in range(3):                         # later steps: the same parameters, new graphs
        layer(x).sum().backward()
    assert clock.seconds() == first
    clock.remove()


def test_a_plan_replaces_the_original_forward_only_when_clearly_faster():
    """The tie-break keeps the layer's own forward unless a plan's median beat it by
    ``ORIGINAL_MARGIN``; between plans the fastest median wins."""
    from granii.runtime.state import ORIGINAL
    from granii.runtime.tiebreak import ORIGINAL_MARGIN, Trial

    def trial(plan_a, plan_b, original):
        t = Trial([("[a]", None, None), ("[b]", None, None), (ORIGINAL, None, None)])
        for label, s in (("[a]", plan_a), ("[b]", plan_b), (ORIGINAL, original)):
            for _ in range(TRIAL_ROUNDS + 1):
                t.record(label, s)
        return t.winner()[0]
    close = 1.0 - ORIGINAL_MARGIN / 2
    assert trial(close, 1.2, 1.0) == ORIGINAL           # within the margin: DGL's forward stays
    assert trial(0.8, 0.7, 1.0) == "[b]"                 # clearly faster: the fastest plan
    assert trial(1.3, 1.2, 1.0) == ORIGINAL


def test_a_plan_replaces_the_predicted_one_only_when_clearly_faster():
    """Between plans the measurement overrules the cost model's first choice only by
    ``PLAN_MARGIN``: two plans that measure alike keep the predicted one."""
    from granii.runtime.tiebreak import PLAN_MARGIN, Trial

    def trial(predicted, other):
        t = Trial([("[p]", None, None), ("[o]", None, None)])
        for _ in range(TRIAL_MORE_ROUNDS + 1):
            t.record("[p]", predicted)
            t.record("[o]", other)
        assert t.settled()
        return t.winner()[0]
    assert trial(1.0, 1.0 - PLAN_MARGIN / 2) == "[p]"
    assert trial(1.0, 1.0 - 2 * PLAN_MARGIN) == "[o]"
    assert trial(1.0, 1.1) == "[p]"


def test_a_burst_of_slow_calls_does_not_overrule_the_predicted_plan():
    """The measurement overrules the cost model only when each timed call of the faster plan
    beat each of the predicted plan's: two of three predicted calls slowed 7x by other work
    (a median of 21 against 6) keep the prediction; a plan faster in every call replaces it."""
    from granii.runtime.tiebreak import Trial

    def trial(predicted, other):
        t = Trial([("[p]", None, None), ("[o]", None, None)])
        for p, o in zip(predicted, other):
            t.record("[p]", p)
            t.record("[o]", o)
        assert t.settled()
        return t.winner()[0]
    assert trial([9.0, 3.0, 21.0, 22.0], [9.0, 6.0, 6.3, 6.2]) == "[p]"
    assert trial([9.0, 7.0, 21.0, 22.0], [9.0, 6.0, 6.3, 6.2]) == "[o]"


def test_close_candidates_take_more_rounds_on_whole_graphs():
    """After ``TRIAL_ROUNDS`` timed calls each, a fastest candidate that is not the cost model's
    first choice but within ``TRIAL_CLOSE`` of it takes ``TRIAL_MORE_ROUNDS`` with it, and the
    others leave; where the model's choice measures fastest, or far slower, three are enough,
    and on sampled blocks (every turn another block) the trial ends after ``TRIAL_ROUNDS``."""
    from granii.runtime.state import ORIGINAL
    from granii.runtime.tiebreak import TRIAL_CLOSE, Trial

    def trial(times, warm=1):
        t = Trial([(label, None, None) for label in times], warm=warm)
        for _ in range(TRIAL_ROUNDS + warm):
            for label, s in times.items():
                t.record(label, s)
        return t
    close = 1.0 + TRIAL_CLOSE / 2
    t = trial({"[p]": close, "[b]": 1.0, ORIGINAL: 1.0 + 0.9 * TRIAL_CLOSE})
    assert not t.settled()
    assert [c[0] for c in t.candidates] == ["[p]", "[b]"]
    assert ORIGINAL in [lb for lb, _ in t.report()]            # left, still reported
    for _ in range(TRIAL_MORE_ROUNDS - TRIAL_ROUNDS - 1):
        t.record("[p]", close)
        t.record("[b]", 1.0)
    assert not t.settled()
    t.record("[p]", close)
    t.record("[b]", 1.0)
    assert t.settled() and t.winner()[0] == "[b]"
    assert trial({"[p]": 1.0, "[b]": close}).settled()                    # the model's is fastest
    assert trial({"[p]": 1.0 + 2 * TRIAL_CLOSE, "[b]": 1.0}).settled()    # far slower
    assert trial({"[p]": close, "[b]": 1.0}, warm=0).settled()             # sampled blocks


def test_a_turns_backward_clock_stops_at_the_layers_own_input_gradient(monkeypatch):
    """In a measured turn the layer gets views of its inputs that need a gradient
    (``_own_gradients``), and the clock stops when the layer's own contribution to them is
    computed: a hook on the input itself waited for every other use of it (a readout of it,
    the next layer), whose backward then counted as the layer's."""
    from granii.runtime.dispatch import _own_gradients
    from granii.runtime.tiebreak import BackwardClock
    ticks = iter(range(1000))
    monkeypatch.setattr(tiebreak.time, "perf_counter", lambda: float(next(ticks)))
    seen = []

    class Other(torch.autograd.Function):     # another consumer of x: reads the clock 100 times
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append([tiebreak.time.perf_counter() for _ in range(100)][-1])
            return g * 2

    x = torch.randn(16, 8, requires_grad=True)
    h = x * 1.0                                  # a non-leaf input, as a layer's usually is
    layer = nn.Linear(8, 8)

    @dataclasses.dataclass
    class FakeCall:
        leaf_vals: dict
    other = Other.apply(h)               # made before the layer's call: its backward runs after
    call, args, _ = _own_gradients(FakeCall({"feat": h}), (h,), {})
    assert args[0] is not h and args[0]._base is h and call.leaf_vals["feat"] is args[0]
    out = layer(args[0])
    clock = BackwardClock.of(out, layer, args, 1.0)
    summed = BackwardClock([out], [h], 1.0)    # a hook on the input itself
    (out.sum() + other.sum()).backward()
    assert clock.seconds() is not None and clock.start + clock.seconds() < seen[0]
    assert summed.seconds() > 100               # ran on through the other use's backward
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(16, 8) + 2)
    clock.remove()
    summed.remove()


def test_trial_drops_a_candidate_far_slower_after_two_timed_calls():
    """A candidate whose fastest timed call is over ``TRIAL_DROP`` times another's leaves the
    trial (its time is still reported); within that factor all stay, and none goes before each
    has two timed calls (one call of a training run's first steps can be slowed by half)."""
    from granii.runtime.state import ORIGINAL
    from granii.runtime.tiebreak import TRIAL_DROP, Trial
    t = Trial([("[a]", None, None), ("[slow]", None, None), (ORIGINAL, None, None)])
    for label, s in (("[a]", 1.0), ("[slow]", 9.0)):
        t.record(label, s)              # untimed first calls
        t.record(label, s)
    t.drop_slow()
    assert len(t.candidates) == 3       # the original has no timed call yet
    t.record(ORIGINAL, 1.1)
    t.record(ORIGINAL, 1.1)
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]", ORIGINAL]     # far slower: after one call
    near = Trial([("[a]", None, None), ("[b]", None, None)])
    for label, s in (("[a]", 1.0), ("[b]", 2.0)):
        near.record(label, s)
        near.record(label, s)
    near.drop_slow()
    assert len(near.candidates) == 2     # 2x on one timed call each: no verdict yet
    near.record("[a]", 1.0)
    near.record("[b]", 2.0)
    near.drop_slow()
    assert [c[0] for c in near.candidates] == ["[a]"]
    assert [lb for lb, _ in t.report()] == ["[a]", ORIGINAL, "[slow]"]
    t.record("[a]", 0.99 * TRIAL_DROP * 1.1)       # one slow call: its fastest still counts
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]", ORIGINAL]


def test_trial_on_blocks_drops_a_candidate_after_one_call_only_when_far_slower():
    """On sampled blocks every call is timed: after one call each, a candidate over
    ``TRIAL_DROP_ONE`` times the fastest leaves, one within it stays for its second call, and
    then ``TRIAL_DROP`` applies."""
    from granii.runtime.state import ORIGINAL
    from granii.runtime.tiebreak import TRIAL_DROP, TRIAL_DROP_ONE, Trial
    t = Trial([("[a]", None, None), ("[b]", None, None), (ORIGINAL, None, None)], warm=0)
    t.record("[a]", 1.0)
    t.record(ORIGINAL, 1.1 * TRIAL_DROP_ONE)
    t.drop_slow()
    assert len(t.candidates) == 3                   # [b] has no call yet
    t.record("[b]", 0.5 * (TRIAL_DROP + TRIAL_DROP_ONE))
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]", "[b]"]
    t.record("[a]", 1.0)
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]", "[b]"]   # [b] still has one call
    t.record("[b]", 0.5 * (TRIAL_DROP + TRIAL_DROP_ONE))
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]"]


def test_trial_drops_a_candidate_whose_first_call_is_far_slower():
    """Before its timed call, a candidate whose untimed first call exceeds ``TRIAL_FIRST_DROP``
    times another's fastest timed call, and by ``TRIAL_FIRST_EXCESS`` seconds, leaves; within
    either margin (a first call's warm-up) it stays."""
    from granii.runtime.state import ORIGINAL
    from granii.runtime.tiebreak import TRIAL_FIRST_DROP, TRIAL_FIRST_EXCESS, Trial
    unit = TRIAL_FIRST_EXCESS           # a call of the fast plan
    t = Trial([("[a]", None, None), (ORIGINAL, None, None), ("[b]", None, None)])
    t.record("[a]", 3 * unit)           # untimed: no timed call anywhere yet, nothing to compare
    t.record(ORIGINAL, 100 * unit)
    t.drop_slow()
    assert len(t.candidates) == 3
    t.record("[a]", unit)               # timed
    t.record("[b]", 0.9 * TRIAL_FIRST_DROP * unit)      # untimed, within the factor
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]", "[b]"]
    assert t.report() == [("[a]", unit), ("[b]", 0.9 * TRIAL_FIRST_DROP * unit),
                          (ORIGINAL, 100 * unit)]
    t.record("[b]", 1.2 * unit)         # timed, within TRIAL_DROP of [a]: both stay
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]", "[b]"]
    small = 0.01 * TRIAL_FIRST_EXCESS   # a small layer: a 10x first call is only warm-up
    t = Trial([("[a]", None, None), (ORIGINAL, None, None)])
    for label, first, timed in (("[a]", small, small), (ORIGINAL, 10 * small, None)):
        t.record(label, first)
        if timed:
            t.record(label, timed)
    t.drop_slow()
    assert len(t.candidates) == 2


def test_trial_keeps_a_plan_whose_first_call_did_its_one_time_work():
    """A plan's untimed first call does its one-time work (kernels compiled on a GPU, the product
    of fixed features kept): it stays in the trial however slow that call was, while the layer's
    own forward still leaves for a far slower first call; the trial then keeps the plan that
    was fastest when timed."""
    from granii.runtime.state import ORIGINAL
    from granii.runtime.tiebreak import TRIAL_FIRST_DROP, TRIAL_ROUNDS, Trial
    unit = 0.01
    slow_first = 100 * TRIAL_FIRST_DROP * unit
    t = Trial([("[a]", None, None), ("[b]", None, None), (ORIGINAL, None, None)])
    t.record("[a]", unit)               # untimed
    t.record("[b]", slow_first)         # untimed: its one-time work
    t.record(ORIGINAL, slow_first)      # untimed
    t.record("[a]", 5 * unit)           # timed
    t.drop_slow()
    assert [c[0] for c in t.candidates] == ["[a]", "[b]"]
    for _ in range(TRIAL_ROUNDS):
        t.record("[b]", unit)
    for _ in range(TRIAL_ROUNDS - 1):
        t.record("[a]", 5 * unit)
    t.drop_slow()
    assert t.done() and t.winner()[0] == "[b]"


def test_a_plan_mostly_faster_than_the_predicted_one_overrules_it():
    """A plan whose median is below the predicted plan's fastest call replaces it, though one of
    its calls was slower than one of the predicted plan's (GIN's cached plan on an unseen
    graph, ms); one whose median is not stays behind it."""
    from granii.runtime.tiebreak import Trial
    for other, kept in (((0.22, 0.18, 0.17), "[0]"), ((0.22, 0.22, 0.17), "[0n]")):
        t = Trial([("[0n]", None, None), ("[0]", None, None)], warm=0)
        for a, b in zip((0.26, 0.23, 0.22), other):
            t.record("[0n]", a * 1e-3)
            t.record("[0]", b * 1e-3)
        assert t.winner()[0] == kept, other


def test_trial_times_plans_whose_graph_work_differs():
    """Of plans predicted close to the best, the tie-break skips those that run the same graph
    kernels on the same sizes as one already taken (they differ in dense products only)."""
    from types import SimpleNamespace as NS
    from granii.select import Choice, graph_work, trial_candidates

    def choice(cost, *steps):
        st = [NS(prim=p, sig=(p, False, dims)) for p, _, dims in steps]
        return Choice(NS(steps=st), tuple(i for _, i, _ in steps), cost, [])
    agg = ("spmm_heads", "native", ("E", "k_in"))
    best = choice(1.0, ("gemm", "torch", ("N_src", "k_in", "1")), agg)
    twin = choice(1.05, ("gemm", "torch", ("N_dst", "k_in", "1")), agg)      # same graph work
    other = choice(1.2, ("gemm", "torch", ("N_src", "k_in", "k_out")),
                   ("gat_aggregate", "native", ("E", "k_out")))
    far = choice(2.0, ("gat_aggregate", "dgl", ("E", "k_out")))
    assert graph_work(best) == graph_work(twin) != graph_work(other)
    assert trial_candidates([best, twin, other, far], wide=1.0) == [best, other]
    assert trial_candidates([best, twin, far], wide=1.0) == [best]
    # another library's graph kernel within the wide factor is timed too
    assert trial_candidates([best, twin, other, far]) == [best, other, far]
    assert trial_candidates([best, twin, far], wide=1.9) == [best]


def test_trial_times_the_best_plan_with_another_graph_kernel():
    """Besides the other plans, the tie-break times the best plan with another implementation
    of one graph step when it is predicted within the margin; the label in the trial tells the
    two apart and the kept decision names the plan."""
    from types import SimpleNamespace as NS
    from granii.select import Choice, trial_candidates, variants
    st = [NS(prim="row_scale", sig=("row_scale", False, ("N", "k"))),
          NS(prim="spmm", sig=("spmm", False, ("E", "k")))]
    plan = NS(steps=st)
    best = Choice(plan, ("torch", "torch_csr"), 1.0,
                  [(st[0], "torch", 0.2), (st[1], "torch_csr", 0.8)],
                  ((1, "native", 0.01), (1, "dgl", 0.6)))
    other = Choice(NS(steps=[NS(prim="gemm", sig=("gemm", False, ("N", "k", "k_out"))),
                             NS(prim="spmm", sig=("spmm", False, ("E", "k_out")))]),
                   ("torch", "native"), 1.1, [])
    assert [c.impls for c in variants(best)] == [("torch", "native"), ("torch", "dgl")]
    native_rows = variants(best)[0].step_costs      # explain's step by step: the variant's own
    assert [(i, t) for _, i, t in native_rows] == [("torch", 0.2), ("native", pytest.approx(0.81))]
    picked = trial_candidates([best, other], wide=1.0)
    assert [c.impls for c in picked] == [("torch", "torch_csr"), ("torch", "native"),
                                         ("torch", "native")]
    assert picked[1] is other and picked[2].plan is plan
    assert picked[2].cost == pytest.approx(1.01)
    # within the wide factor, DGL's kernel for the step (another library) is timed as well
    assert [c.impls for c in trial_candidates([best, other])][3:] == [("torch", "dgl")]
    best.alternatives = ((1, "dgl", 0.6),)                 # beyond the margin: not timed
    assert len(trial_candidates([best, other], wide=1.0)) == 2


def test_gin_trial_runs_an_implementation_variant_and_keeps_dgls_results():
    """A GIN layer whose SpMM implementations are predicted close takes a variant into its
    trial; every trial call still returns DGL's output, and the kept decision names a plan."""
    from dgl.nn import GINConv
    dgl.seed(0)
    g = dgl.add_self_loop(dgl.rand_graph(400, 3000))
    torch.manual_seed(0)
    ref = GINConv(nn.Linear(16, 16), "sum")
    layer = copy.deepcopy(ref)
    x = torch.randn(400, 16)
    with torch.no_grad():            # inference follows: decide without gradients
        granii(layer, g, x, cost_model=AnalyticalCost())     # prices the SpMM kernels alike
    for i in range(4 * (TRIAL_MORE_ROUNDS + 2)):
        xi = torch.randn(400, 16)
        with torch.no_grad():
            torch.testing.assert_close(layer(g, xi), ref(g, xi), atol=1e-5, rtol=1e-4)
    st = layer_states(layer)[0]
    times, kept = st.tuned
    labels = [lb for lb, _ in times]
    assert kept in labels
    variant = [lb for lb in labels if " " in lb and lb.startswith("[")]
    assert variant and variant[0].split(" ")[0] in labels
    (decision,) = st.chosen.values()
    assert decision["plan"] != "original forward" or kept == "original forward"


def test_layers_of_one_configuration_share_their_enumeration():
    """Two instances of a layer with one configuration share the enumerated plans (they depend
    on the IR alone), each runs with its own parameters and functions, and a layer configured
    otherwise gets plans of its own."""
    g = _graph()
    x = torch.randn(g.num_nodes(), 12)
    torch.manual_seed(0)
    a, b = SAGEConv(12, 6, "mean", activation=torch.relu), SAGEConv(12, 6, "mean",
                                                                     activation=torch.relu)
    c = SAGEConv(12, 6, "mean", activation=torch.tanh)
    refs = [copy.deepcopy(m) for m in (a, b, c)]
    for m in (a, b, c):
        granii(m, g, x, cost_model=AnalyticalCost())

    def plans(m):
        (variants,) = layer_states(m)[0].compiled.values()
        return variants[0].plans
    assert all(p is q for p, q in zip(plans(a), plans(b))) and len(plans(a)) == len(plans(b))
    assert not set(map(id, plans(a))) & set(map(id, plans(c)))
    for m, ref in zip((a, b, c), refs):
        for _ in range(3):
            y = torch.randn(g.num_nodes(), 12)
            torch.testing.assert_close(m(g, y), ref(g, y), atol=1e-5, rtol=1e-4)


def test_a_trial_on_blocks_times_every_call():
    """On sampled blocks (``warm=0``) a candidate's first call counts: the trial settles after
    ``TRIAL_ROUNDS`` calls each, and the medians include the first; on a whole graph the first
    call of each stays untimed."""
    from granii.runtime.tiebreak import Trial

    def run(warm):
        t = Trial([("[a]", None, None), ("[b]", None, None)], warm=warm)
        calls = 0
        while not t.done():
            label = t.next()[0]
            calls += 1
            first = len(t.times.get(label, ())) == 0
            t.record(label, {"[a]": 5.0 if first else 1.0, "[b]": 1.2}[label])
        return t, calls
    blocks, n_blocks = run(warm=0)
    whole, n_whole = run(warm=1)
    assert n_blocks == 2 * TRIAL_ROUNDS and n_whole == 2 * (TRIAL_ROUNDS + 1)
    assert blocks.medians()["[a]"] == 1.0 and whole.medians()["[a]"] == 1.0
    assert blocks.winner()[0] == "[a]" == whole.winner()[0]
    slow_first = Trial([("[a]", None, None), ("[b]", None, None)], warm=0)
    for label, s in (("[a]", 9.0), ("[b]", 1.0), ("[a]", 9.0), ("[b]", 1.0)):
        slow_first.record(label, s)
        slow_first.drop_slow()
    assert [c[0] for c in slow_first.candidates] == ["[b]"]    # slower twice: dropped


def _block(n_src, n_dst, per_dst, seed):
    """A block with ``per_dst`` in-edges on each of ``n_dst`` destinations from ``n_src``
    sources."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n_src, (n_dst * per_dst,), generator=gen)
    dst = torch.arange(n_dst).repeat_interleave(per_dst)
    return dgl.create_block((src, dst), num_src_nodes=n_src, num_dst_nodes=n_dst)


def test_blocks_either_side_of_a_rounding_boundary_share_one_decision():
    """A sampler's blocks scatter around one shape: 87 or 94 sources for 64 destinations
    (log2 of the ratio 0.44 and 0.55, on both sides of the 0.5 that rounding splits at) take one
    sampler decision, not a tie-break each; a block with 4 times the sources gets its own."""
    torch.manual_seed(0)
    layer = GraphConv(16, 8, allow_zero_in_degree=True)
    ref = copy.deepcopy(layer)
    blocks = [_block(87, 64, 8, 0), _block(94, 64, 8, 1), _block(87, 64, 8, 2),
              _block(94, 64, 8, 3), _block(256, 64, 8, 4)]
    with torch.no_grad():
        granii(layer, blocks[0], torch.randn(87, 16), cost_model=AnalyticalCost())
    for b in blocks:
        x = torch.randn(b.num_src_nodes(), 16)
        with torch.no_grad():
            torch.testing.assert_close(layer(b, x), ref(b, x), atol=1e-5, rtol=1e-4)
    state = layer_states(layer)[0]
    mode = next(k for k in state.sampled if k[3] == (3, 0))[4:]          # the no-grad calls'
    shapes = sorted(k[3] for k in state.sampled if k[4:] == mode)
    assert shapes == [(3, 0), (3, 2)], shapes
    assert state.reused >= 3


def test_feature_density_prices_plans_but_does_not_split_sampler_decisions():
    """Hidden features after ReLU and dropout change density from batch to batch around the
    sparse-rows limit; each density seen would otherwise start a tie-break of its own. Blocks
    at 4% and 5% density (3% to 5% in a sample of rows) share the first block's decision, with
    DGL's outputs."""
    from granii.kernels import sparse_rows
    if not sparse_rows.AVAILABLE:
        pytest.skip("the density is read by the native extension")

    def feats(n, density, seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, 64, generator=gen) * (torch.rand(n, 64, generator=gen) < density)

    torch.manual_seed(0)
    layer = GraphConv(64, 8, allow_zero_in_degree=True)
    ref = copy.deepcopy(layer)
    granii(layer, _block(2000, 500, 8, 0), feats(2000, 0.04, 0), cost_model=AnalyticalCost())
    seen = set()
    for i, density in enumerate((0.04, 0.05, 0.04, 0.05)):
        n = 2001 + i                                        # each batch's blocks differ
        block, x = _block(n, 500, 8, i + 1), feats(n, density, i + 1)
        with torch.no_grad():
            torch.testing.assert_close(layer(block, x), ref(block, x), atol=1e-5, rtol=1e-4)
        seen.add(sparse_rows.sampled_density(x))
    assert len(seen) > 1 and max(seen) < sparse_rows.LIMIT   # what the dispatcher reads
    state = layer_states(layer)[0]
    modes = [k[4:] for k in state.sampled]
    assert len(modes) == len(set(modes)), list(state.sampled)   # one decision per mode
    assert state.reused >= 3


# -- configuration held by identity -------------------------------------------------------------------
class SumThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 6)

    def forward(self, g, h):
        with g.local_scope():
            g.srcdata["h"] = h
            g.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
            return self.fc(g.dstdata["h"])


class Doubled(nn.Module):
    """Has a Linear's ``weight`` and ``bias``, but doubles its product."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())

    def forward(self, x):
        return 2 * nn.functional.linear(x, self.weight, self.bias)


def _new_at(address, make, bound=20000):
    """An object from ``make()`` at ``address`` (a freed object's): made again until one lands
    there (the others are kept, so each try takes a new place); ``None`` after ``bound`` tries."""
    kept = []
    for _ in range(bound):
        obj = make()
        if id(obj) == address:
            return obj
        kept.append(obj)
    return None


def test_a_new_submodule_at_a_freed_ones_address_is_noticed():
    """A plan assumed ``self.fc`` is the ``nn.Linear`` it lowered (``x W^T + b``). Replacing it
    by another module made at the freed Linear's address (``id`` equal) must not run that plan:
    the configuration check holds the object, not its ``id``, so the layer is lowered again and
    gives the new module's result (it used to run the Linear's plan: half the result)."""
    g = _graph()
    x = torch.randn(g.num_nodes(), 12)
    torch.manual_seed(0)
    layer = SumThenLinear()
    granii(layer, g, x, cost_model=AnalyticalCost(), tune=False)
    weight, bias = layer.fc.weight.detach().clone(), layer.fc.bias.detach().clone()
    address = id(layer.fc)
    del layer.fc
    new = _new_at(address, lambda: Doubled.__new__(Doubled))
    if new is None:
        pytest.skip("no object was made at the freed address")
    Doubled.__init__(new, weight, bias)
    layer.fc = new
    ref = SumThenLinear()
    ref.fc = Doubled(weight, bias)
    with torch.no_grad():
        torch.testing.assert_close(layer(g, x), ref(g, x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer(g, x), ref(g, x), rtol=1e-4, atol=1e-5)


def test_a_configuration_object_is_held_by_identity():
    """``rules.Same``: the object itself (weakly where it can be), not its ``id``: a new object
    at a freed one's address is another object; builtins without weak references are held."""
    from granii.frontend.rules import Same, config_summary

    class Act:
        def __call__(self, x):
            return x

    act = Act()
    same = config_summary(act)
    assert isinstance(same, Same) and same.holds(act) and not same.holds(Act())
    address = id(act)
    del act
    new = _new_at(address, Act)
    assert not same.holds(new) and same.get() is None
    relu = config_summary(torch.relu)            # no weak reference to a builtin: held
    assert relu.holds(torch.relu) and relu == config_summary(torch.relu)
    assert relu != config_summary(torch.tanh) and relu != 3


# -- a stale native build ---------------------------------------------------------------------------
def _fake_library(path, sha):
    """A file standing for the built extension, carrying the sources' hash as setup.py compiles
    it in (``h<hex>``), older than every source."""
    import os
    path.write_bytes(b"\x7fELF" + b"\0" * 64 + b"h" + sha.encode() + b"\0" + b"\0" * 64)
    os.utime(path, (1, 1))
    return path


def test_a_native_build_from_other_sources_is_refused_before_it_is_loaded(tmp_path, monkeypatch):
    """A library built from other sources than csrc/ holds is not loaded (its operators would
    be registered and its kernels used): one warning says how to rebuild, and the DGL/torch
    kernels are used. It used to be loaded and used after a warning."""
    import warnings
    from granii.kernels import native
    here = native.sources_sha()
    if here is None:
        pytest.skip("no kernel sources beside the package")
    lib = _fake_library(tmp_path / "_native.so", "0" * 16)
    monkeypatch.setattr(native, "library", lambda: lib)
    monkeypatch.setattr(native, "_import", lambda: pytest.fail("the stale build was loaded"))
    with pytest.warns(native.NativeKernelsUnavailable, match="bash scripts/env.sh") as seen:
        mod, reason = native._load()
    assert mod is None and "other sources" in reason and "not used" in reason
    assert len(seen) == 1
    # a build older than the sources but made from the same ones (a source touched, not
    # changed) is loaded, without a warning
    _fake_library(lib, here)
    built = type("Built", (), {"sources_sha": "h" + here, "__file__": str(lib)})
    monkeypatch.setattr(native, "_import", lambda: built)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native._load() == (built, None)
    # newer than the sources but carrying another hash: refused once loaded
    built.sources_sha = "h" + "1" * 16
    with pytest.warns(native.NativeKernelsUnavailable, match="bash scripts/env.sh"):
        assert native._load()[0] is None


# -- granii's warnings in the tests -------------------------------------------------------------------
def test_a_plan_that_raises_warns_runs_dgls_forward_and_says_why(monkeypatch):
    """A plan that raises on its first run: the call runs the layer's own forward (DGL's result),
    with a RuntimeWarning, and the record says it was a fallback and why. The test suite turns
    that warning into an error everywhere else (pyproject.toml): no test expects one."""
    import granii.runtime.decide as dispatch
    from granii.api import what_ran
    real = dispatch.compile_plan

    def broken(plan, impls):
        fn, code = real(plan, impls)

        def raising(*args):
            raise ValueError("a broken kernel")
        return raising, code
    monkeypatch.setattr(dispatch, "compile_plan", broken)
    g = _graph()
    x = torch.randn(g.num_nodes(), 12)
    torch.manual_seed(0)
    layer = GraphConv(12, 5)
    want = copy.deepcopy(layer)(g, x)
    with pytest.warns(RuntimeWarning, match="raised ValueError: a broken kernel; running the "
                                            "original forward"):
        granii(layer, g, x, cost_model=AnalyticalCost(), tune=False)
        torch.testing.assert_close(layer(g, x), want)
    ran = what_ran(layer)["GraphConv"]
    assert ran.kind == "fallback" and "a broken kernel" in ran.reason


def test_the_suite_fails_on_a_plan_that_raises():
    """pyproject.toml's filters: granii's warning that a plan raised is an error in the tests."""
    import warnings
    with pytest.raises(RuntimeWarning):
        warnings.warn("granii: layer 'conv': plan [0] raised ValueError: x; running the original "
                      "forward from now on for this input", RuntimeWarning)


def test_a_training_turn_finds_the_backward_index_built():
    """Every layer's backward on a graph reads the native index of ``A^T``; a measured turn in
    training builds it before it is timed, so no candidate's time carries what the whole step
    shares (on a new graph each step, the turn that happened to build it first paid for it)."""
    from dgl.nn import GINConv

    from granii.graph import graph_info
    from granii.kernels import native
    if not native.available():
        pytest.skip("the native extension is not built")
    g = dgl.rand_graph(300, 2400)
    layer = GINConv(nn.Linear(8, 8), "sum")
    x = torch.randn(300, 8, requires_grad=True)
    granii(layer, g, x, cost_model=AnalyticalCost())
    gi = graph_info(g)
    gi.cache.pop(("native_csr", "at"), None)
    out = layer(g, x)
    assert layer_states(layer)[0].ran.reason == "a turn of the measured tie-break"
    assert ("native_csr", "at") in gi.cache
    out.sum().backward()
    layer.eval()
    gi.cache.pop(("native_csr", "at"), None)
    layer(g, x)                              # no backward follows: nothing built for it
    assert ("native_csr", "at") not in gi.cache


def test_an_original_forward_out_of_memory_in_its_turn_leaves_the_trial(monkeypatch):
    """A layer's own forward that runs out of memory in its tie-break turn (PyG's GAT on a large
    graph, where granii's plans fit) is dropped from the trial with a warning; that call runs a
    plan instead, with the random numbers given back, and every call gives DGL's results."""
    from granii.runtime import dispatch
    g, ref, model, x = _two_layers_optimized()
    real = dispatch.original_forward
    ran_out = []

    def out_of_memory(layer, args, kwargs):
        if dispatcher_turn(layer):
            ran_out.append(layer)
            torch.rand(3)                   # draws, as a forward would, before it fails
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 90 GiB")
        return real(layer, args, kwargs)

    def dispatcher_turn(layer):
        return any(st.module is layer for st in layer_states(model))
    monkeypatch.setattr(dispatch, "original_forward", out_of_memory)
    with pytest.warns(RuntimeWarning, match="ran out of memory"):
        for i in range(40):
            torch.manual_seed(100 + i)
            out = model(g, x)
            torch.manual_seed(100 + i)
            torch.testing.assert_close(out, ref(g, x), atol=1e-5, rtol=1e-4)
            out.square().sum().backward()
    assert ran_out, "no turn of the original forward was tried"
    for st in layer_states(model):
        assert st.tuned is not None
        times, kept = st.tuned
        assert kept != "original forward"
        assert all(label != "original forward" for label, _ in times)
        assert st.ran.kind == "plan"
