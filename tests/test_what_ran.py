"""What each call of an optimized layer ran (``granii.api.what_ran``, ``explain``): a plan, the
layer's own forward as the decision (a turn of the measured tie-break, the forward it kept, a saved
decision) or its own forward as a fallback, with the reason. A fallback and the original forward
are never counted as a plan."""
import copy
import io

import dgl
import dgl.function as fn
import pytest
import torch
from dgl.nn import GATConv, GraphConv, SAGEConv
from torch import nn

from granii import granii
from granii.api import layer_states, what_ran
from granii.runtime.state import AUTOCAST, ORIGINAL

TURN = "a turn of the measured tie-break"


def _graph():
    dgl.seed(0)
    return dgl.to_bidirected(dgl.rand_graph(300, 1500))


def _features(g, k=12):
    return torch.randn(g.num_nodes(), k, generator=torch.Generator().manual_seed(1))


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = GraphConv(12, 16, activation=torch.relu)
        self.b = SAGEConv(16, 4, "mean")

    def forward(self, g, x):
        return self.b(g, self.a(g, x))


def _training_call(model, ref, g, x, i):
    outs = []
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        out = m(g, x)
        r = torch.randn(out.shape, generator=torch.Generator().manual_seed(i))
        (out * r).sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=6e-4, atol=1e-5, msg=name)


def test_each_turn_of_the_tie_break_is_recorded_then_the_kept_decision_runs():
    """Training calls through the measured tie-break: each call records which candidate took
    its turn (the first the predicted best plan, the layer's own forward among them); once the
    trial settles, every call runs the kept decision, recorded as a plan with its label, or as
    the original forward when that was kept. Outputs and gradients are DGL's on every call."""
    g = _graph()
    x = _features(g)
    torch.manual_seed(0)
    model = Two()
    ref = copy.deepcopy(model)
    granii(model, g, x)
    records = []
    for i in range(60):
        _training_call(model, ref, g, x, i)
        records.append(what_ran(model))
        states = layer_states(model)
        if all(st.tuned is not None for st in states) and \
                all(r[st.name].reason != TURN for r in records[-3:] for st in states):
            break
    for st in layer_states(model):
        assert st.tuned is not None, f"{st.name}: the tie-break did not settle in 60 calls"
        mine = [r[st.name] for r in records]
        turns = [r for r in mine if r.reason == TURN]
        after = mine[len(turns):]
        assert turns and all(r.reason != TURN for r in after), mine
        assert turns[0].kind == "plan", turns[0]
        assert ORIGINAL in {r.label for r in turns}
        assert {label for label, _ in st.tuned[0]} <= {r.label for r in turns}
        assert all((r.kind == "original") == (r.label == ORIGINAL) for r in turns)
        kept = st.tuned[1]
        want = ("original", ORIGINAL) if kept == ORIGINAL else ("plan", kept)
        assert after and all((r.kind, r.label) == want for r in after), (kept, after)
        text = granii.explain(model, file=io.StringIO())
        assert ("last call ran: plan " + kept if kept != ORIGINAL
                else "last call ran: the layer's own forward") in text


def udf_message(edges):
    return {"m": edges.src["h"]}


def udf_reduce(nodes):
    return {"h": torch.sum(nodes.mailbox["m"], dim=1)}


class UDFSum(nn.Module):
    """Python message and reduce functions: DGL's forward is no candidate of the tie-break."""

    def __init__(self, k_in, k_out):
        super().__init__()
        self.linear = nn.Linear(k_in, k_out)

    def forward(self, g, h):
        with g.local_scope():
            g.ndata["h"] = self.linear(h)
            g.update_all(udf_message, udf_reduce)
            return g.ndata["h"]


def test_a_tie_break_without_the_layers_forward_settles_on_a_plan():
    g = _graph()
    x = _features(g)
    torch.manual_seed(0)
    model = UDFSum(12, 8)
    ref = copy.deepcopy(model)
    granii(model, g, x)
    for i in range(20):
        _training_call(model, ref, g, x, i)
        ran = what_ran(model)["UDFSum"]
        assert ran.kind == "plan", ran
    st = layer_states(model)[0]
    assert st.tuned is None or st.tuned[1] != ORIGINAL


def test_a_saved_decision_of_the_original_forward_is_recorded_as_the_original():
    g = _graph()
    x = _features(g)
    torch.manual_seed(0)
    model = Two().eval()
    fresh = copy.deepcopy(model)
    granii(model, g, x, tune=False)
    with torch.no_grad():
        model(g, x)
    assert {r.kind for r in what_ran(model).values()} == {"plan"}
    saved = granii.save_decisions(model)
    for calls in saved["layers"].values():
        for key in calls:
            calls[key] = {"plan": ORIGINAL}
    granii(fresh, g, x, decisions=saved)
    for _ in range(3):                         # the normal path, then the fast path
        with torch.no_grad():
            torch.testing.assert_close(fresh(g, x), model(g, x), rtol=1e-4, atol=1e-5)
        ran = what_ran(fresh)
        assert {(r.kind, r.label) for r in ran.values()} == {("original", ORIGINAL)}, ran
        assert all(st.fallback is None for st in layer_states(fresh))


def test_the_fast_path_records_the_plan_it_runs(monkeypatch):
    """Calls that take the fast path (no binding, no lookup) record the plan they run, as the
    normal path's call did."""
    from granii.runtime import dispatch, fastpath
    g = _graph()
    x = _features(g)
    torch.manual_seed(0)
    model = Two().eval()
    granii(model, g, x, tune=False)
    normal = []
    real = dispatch._dispatch
    monkeypatch.setattr(dispatch, "_dispatch", lambda st, *a: normal.append(st.name) or real(st, *a))
    labels = []
    for _ in range(fastpath._FAST_AFTER + 3):     # the fast path is built after a few calls
        normal.clear()
        with torch.no_grad():
            model(g, x)
        labels.append({n: (r.kind, r.label) for n, r in what_ran(model).items()})
    assert not normal, "the last call did not take the fast path"
    assert labels[-1] == labels[-2]
    for st in layer_states(model):
        assert labels[-1][st.name] in {("plan", f"[{c['plan']}]") for c in st.chosen.values()}


def test_a_call_shape_that_always_falls_back_is_recorded_each_time():
    """GATConv(..., get_attention=True) falls back (no plan returns the attention); the reason is
    kept per call shape and reused: a later such call after a plain one is still recorded as a
    fallback, with the reason (the fallback used to keep the plain call's ``None``)."""
    g = _graph()
    x = _features(g)
    torch.manual_seed(0)
    layer = GATConv(12, 4, 2)
    granii(layer, g, x, tune=False)
    st = layer_states(layer)[0]
    for _ in range(2):
        layer(g, x)
        assert what_ran(layer)["GATConv"].kind == "plan" and st.fallback is None
        layer(g, x, get_attention=True)
        ran = what_ran(layer)["GATConv"]
        assert ran.kind == "fallback" and "tuple" in ran.reason, ran
        assert st.fallback == ran.reason
    assert ran.reason in granii.explain(layer, file=io.StringIO())


def test_autocast_calls_are_recorded_as_fallbacks():
    g = _graph()
    x = _features(g)
    torch.manual_seed(0)
    model = Two()
    granii(model, g, x, tune=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(g, x)
    assert {(r.kind, r.reason) for r in what_ran(model).values()} == {("fallback", AUTOCAST)}
    text = granii.explain(model, file=io.StringIO())
    assert "last call ran: the original forward (not optimized): autocast" in text
    model(g, x)
    assert {r.kind for r in what_ran(model).values()} == {"plan"}


def test_what_ran_before_any_call_and_on_a_plain_module():
    g = _graph()
    torch.manual_seed(0)
    model = Two()
    granii(model, g, _features(g), inspect_now=False)
    assert what_ran(model) == {"a": None, "b": None}
    with pytest.raises(TypeError, match="what_ran"):
        what_ran("not a model")
