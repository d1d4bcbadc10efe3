"""Real-client models: granii(model, g, x) gives DGL's outputs, gradients and buffers.

Each model is deep-copied before granii() as the reference. Training is compared over several
consecutive calls under the same seed (dropout draws the same masks on both sides), with an SGD
step between calls so parameters change in place as they do in training; eval mode is compared
with and without gradients. Then the things users do with a model: deepcopy, torch.save,
inference_mode, wrapping twice, restore, graphs and features edited in place.

Each compared call checks what it ran (``granii.api.what_ran``): a comparison of DGL's forward
with itself proves nothing, so these models decide without the measured tie-break (``tune=False``:
each call runs the plan ranked first), and the layers of the kinds granii optimizes must have run
a plan on every compared call. The tie-break, which gives DGL's forward turns and may keep it, is
compared call by call on its own (``test_training_through_the_tie_break_matches_dgl``).
"""
import copy
import io
import warnings

import dgl
import numpy as np
import pytest
import torch
from torch import nn

from granii import granii
from granii.api import layer_states
from granii.runtime.state import ORIGINAL
from graphs import directed, edge_weights, undirected, zero_in_degree
import models
from models import CASES, CASES_BY_NAME, of_optimized_kind

RTOL = 1e-4
# A parameter's gradient is a sum over every node or edge (attention vectors, biases, eps), with
# cancellation: its rounding error relative to its largest entry is a few times an output's (GAT's
# attn_r in float32: up to 4.3e-4 seen with plans that agree with DGL to 1e-9 in float64).
RTOL_GRAD = 6e-4
# GAT's attention vectors: their gradient is almost all cancellation (softmax gradients sum to zero
# over each node's in-edges), so float32 rounding is larger still: DGL's own float32 gradient of
# attn_r was up to 2.6e-3 (relative to its largest entry) off a float64 reference on trained models,
# so two float32 computations of it (DGL's and a plan's) may differ by twice that: 5.8e-3 seen
# between DGL and the fused GAT plan on one of six runs of the tie-break test.
RTOL_ATTN = 6e-3
ATOL = 1e-6
CALLS = 3
GRAPHS = {"directed": directed, "undirected": undirected, "zero_in_degree": zero_in_degree}


# -- comparing ---------------------------------------------------------------------------------------
def assert_close(got, want, what, rtol=RTOL):
    """Equal up to float re-association: the error is measured against the largest magnitude."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, DGL {tuple(want.shape)}"
    # non-finite where DGL's is: inf or NaN alike, since which of the two an overflow gives
    # depends on the order of the sums (a model whose output overflows gives both)
    bad = torch.isfinite(got) != torch.isfinite(want)
    assert not bad.any(), f"{what}: inf or NaN where DGL has a number (or the reverse)"
    finite = torch.isfinite(want)
    got, want = got.detach().where(finite, 0.0), want.detach().where(finite, 0.0)
    if not want.numel():
        return
    err = (got.double() - want.double()).abs().max().item()
    tol = ATOL + rtol * want.abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (DGL's largest value " \
                       f"{want.abs().max().item():.3g})"


def projection(out):
    """A fixed random direction for the backward, so every output entry matters."""
    gen = torch.Generator().manual_seed(out.numel())
    return torch.randn(out.shape, generator=gen)


def assert_same_grads(model, ref, what):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: '{name}' has a gradient, DGL gives it none"
            continue
        assert p.grad is not None, f"{what}: '{name}' has no gradient, DGL gives it one"
        rtol = RTOL_ATTN if name.rsplit(".", 1)[-1].startswith("attn_") else RTOL_GRAD
        assert_close(p.grad, q.grad, f"{what}: gradient of '{name}'", rtol)


def assert_same_buffers(model, ref, what):
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        if b.is_floating_point():
            assert_close(b, c, f"{what}: buffer '{name}'")
        else:
            assert torch.equal(b, c), f"{what}: buffer '{name}' is {b}, DGL {c}"


def ran_in(model, call):
    """``call()``, and what each optimized layer of ``model`` ran in it: ``{name: Ran}`` (layers
    that did not run left out)."""
    states = layer_states(model)
    for st in states:
        st.ran = None
    out = call()
    return out, {st.name: st.ran for st in states if st.ran is not None}


def assert_plans_ran(model, ran, what):
    """Every layer of a kind granii optimizes ran a plan in the call (``ran``: ``ran_in``'s);
    the other layers a plan or their own forward as a fallback with its reason, never as a
    decision (no tie-break turn, no kept original)."""
    for st in layer_states(model):
        r = ran.get(st.name)
        if of_optimized_kind(st.module):
            assert r is not None and r.kind == "plan", \
                f"{what}: layer '{st.name}' ({type(st.module).__name__}) ran {r}"
        elif r is not None:
            assert r.kind == "plan" or (r.kind == "fallback" and r.reason), \
                f"{what}: layer '{st.name}' ran {r}"


def train_side_by_side(run, model, ref, w=None, calls=CALLS, seed=0, what="", plans=False,
                       record=None):
    """``calls`` training steps of model and ref under the same seeds: outputs, gradients of every
    parameter (and of the edge weights ``w``), buffers; an SGD step after each call, after which
    model gets the reference's values. With ``plans``, each call of model ran plans
    (``assert_plans_ran``); ``record`` (a list) gets what each call of model ran."""
    model.train()
    ref.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-3)
    for i in range(calls):
        outs, w_grads = [], []
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad(set_to_none=True)
            wi = None if w is None else w.clone().requires_grad_()
            torch.manual_seed(seed + i)
            out, ran = ran_in(m, lambda: run(m, wi)) if m is model else (run(m, wi), None)
            if ran is not None:
                if plans:
                    assert_plans_ran(model, ran, f"{what} training call {i + 1}")
                if record is not None:
                    record.append(ran)
            (out * projection(out)).sum().backward()
            outs.append(out)
            w_grads.append(None if wi is None else wi.grad)
        step = f"{what} training call {i + 1}"
        assert_close(outs[1], outs[0], f"{step}: output")
        assert_same_grads(model, ref, step)
        if w is not None:
            assert (w_grads[0] is None) == (w_grads[1] is None), f"{step}: edge-weight gradient"
            if w_grads[0] is not None:
                assert_close(w_grads[1], w_grads[0], f"{step}: gradient of the edge weights",
                             RTOL_GRAD)
        opt.step()
        opt_ref.step()
        assert_same_buffers(model, ref, step)
        sync(model, ref)


def sync(model, ref):
    """Give model the reference's parameters and buffers, in place (as an optimizer step does),
    so that float rounding does not grow from call to call."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(q)
        for b, c in zip(model.buffers(), ref.buffers()):
            b.copy_(c)


def eval_side_by_side(run, model, ref, w=None, what="", plans=False):
    model.eval()
    ref.eval()
    for i in range(2):            # the second call may reuse work of the first
        with torch.no_grad():
            out, ran = ran_in(model, lambda: run(model, w))
            assert_close(out, run(ref, w), f"{what} eval call {i + 1} (no_grad)")
        if plans:
            assert_plans_ran(model, ran, f"{what} eval call {i + 1} (no_grad)")
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    outs = []
    for m in (ref, model):
        out, ran = ran_in(m, lambda: run(m, w))
        if m is model and plans:
            assert_plans_ran(model, ran, f"{what} eval with gradients")
        (out * projection(out)).sum().backward()
        outs.append(out)
    assert_close(outs[1], outs[0], f"{what} eval with gradients: output")
    assert_same_grads(model, ref, f"{what} eval with gradients")
    assert_same_buffers(model, ref, f"{what} eval")


# -- building ---------------------------------------------------------------------------------------
def features(g, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(g.num_src_nodes(), k, generator=gen)


def build_case(case, graph_kind, seed=0, tune=False):
    """(runner, model wrapped by granii, reference, graph, features, edge weights). Without the
    measured tie-break unless ``tune``: each call runs the plan ranked first."""
    g = GRAPHS[graph_kind]()
    x = features(g, case.in_feats)
    w = edge_weights(g) if case.edge_weight else None
    torch.manual_seed(seed)
    model = case.build(g, case.in_feats, graph_kind == "zero_in_degree")
    ref = copy.deepcopy(model)
    granii(model, g, x, tune=tune)
    return (lambda m, wi: case.run(m, g, x, wi)), model, ref, g, x, w


CASE_GRAPHS = [pytest.param(c, k, id=f"{c.name}-{k}") for c in CASES for k in c.graphs]


@pytest.mark.parametrize("case,graph_kind", CASE_GRAPHS)
def test_training_matches_dgl(case, graph_kind):
    run, model, ref, g, x, w = build_case(case, graph_kind)
    train_side_by_side(run, model, ref, w, what=f"{case.name} on {graph_kind}:", plans=True)


@pytest.mark.parametrize("case,graph_kind", CASE_GRAPHS)
def test_eval_matches_dgl(case, graph_kind):
    run, model, ref, g, x, w = build_case(case, graph_kind)
    eval_side_by_side(run, model, ref, w, what=f"{case.name} on {graph_kind}:", plans=True)


# GIN left out: its BatchNorm'd eps gradients leave RTOL_GRAD on some seeds after ~25 calls
# (seeds 26, 27, 29 with the plan ranked first), and the trial needs that many with few seeds
TIE_BREAK_CASES = ["gcn", "gat"]


@pytest.mark.parametrize("name", TIE_BREAK_CASES)
def test_training_through_the_tie_break_matches_dgl(name):
    """With the measured tie-break (``tune``, the default): training calls until every layer's
    trial settled, each compared with DGL. Each call records what it ran: during the trial the
    turns (the predicted best plan first, DGL's forward among them), then the kept decision, a
    plan or DGL's forward, on every call; so the plans were compared, and what is kept runs."""
    case = CASES_BY_NAME[name]
    run, model, ref, g, x, w = build_case(case, "undirected", tune=True)
    record = []
    layers = [st for st in layer_states(model) if of_optimized_kind(st.module)]
    for i in range(30):          # nine timed calls each where candidates measure close
        train_side_by_side(run, model, ref, w, calls=2, seed=10 * i, what=f"{name}:",
                           record=record)
        if all(st.tuned is not None for st in layers) and all(
                r[st.name].reason != "a turn of the measured tie-break"
                for r in record[-2:] for st in layers):
            break
    for st in layer_states(model):
        mine = [r[st.name] for r in record if st.name in r]
        if not of_optimized_kind(st.module) or st.tuned is None:
            assert all(r.kind in ("plan", "fallback") for r in mine), (st.name, mine)
            continue
        turns = [r for r in mine if r.reason == "a turn of the measured tie-break"]
        assert turns and turns[0].kind == "plan", (st.name, mine[:3])
        after = mine[len(turns):]
        kept = st.tuned[1]
        want = ("original", ORIGINAL) if kept == ORIGINAL else ("plan", kept)
        assert after and all((r.kind, r.label) == want for r in after), (st.name, kept, after)


# -- two models, copies, pickles ----------------------------------------------------------------------
def scale_parameters(model, factor):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


def set_dropout(model, p):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p


def test_two_models_of_one_class_each_use_their_own_dropout():
    g = undirected()
    x = features(g, 12)
    run = lambda m, w: m(g, x)
    pairs = []
    for p in (0.1, 0.7):
        torch.manual_seed(0)
        model = models.GAT(12, models.HIDDEN, models.CLASSES, feat_drop=p, attn_drop=p)
        ref = copy.deepcopy(model)
        granii(model, g, x)
        pairs.append((model, ref))
    for seed in range(2):      # interleaved: the second model built after the first ran
        for i, (model, ref) in enumerate(pairs):
            train_side_by_side(run, model, ref, seed=10 * seed, what=f"GAT number {i + 1}:")
    for i, (model, ref) in enumerate(pairs):      # dropout changed after granii()
        set_dropout(model, 0.5)
        set_dropout(ref, 0.5)
        train_side_by_side(run, model, ref, seed=20, what=f"GAT number {i + 1}, p=0.5:")
    for p, (model, ref) in zip((0.3, 0.9), pairs):
        torch.manual_seed(0)
        other = models.GraphSAGE(12, models.HIDDEN, models.CLASSES, feat_drop=p)
        other_ref = copy.deepcopy(other)
        granii(other, g, x)
        train_side_by_side(run, other, other_ref, what=f"GraphSAGE feat_drop={p}:")


@pytest.mark.parametrize("name", ["gcn", "gat", "mixhop", "jknet_cat", "dagnn", "gin", "tagcn",
                                  "gcn_graph_readout"])
def test_deepcopy_of_an_optimized_model_uses_its_own_parameters_and_dropout(name):
    case = CASES_BY_NAME[name]
    run, model, ref, g, x, w = build_case(case, "undirected")
    train_side_by_side(run, model, ref, w, calls=1, what=f"{name} before the copy:")
    dup, dup_ref = copy.deepcopy(model), copy.deepcopy(ref)
    scale_parameters(dup, 1.5)
    scale_parameters(dup_ref, 1.5)
    set_dropout(dup, 0.2)
    set_dropout(dup_ref, 0.2)
    train_side_by_side(run, dup, dup_ref, w, calls=2, what=f"{name} copy, changed:")
    train_side_by_side(run, model, ref, w, calls=2, what=f"{name} original after the copy:")
    scale_parameters(model, 0.5)
    scale_parameters(ref, 0.5)
    train_side_by_side(run, dup, dup_ref, w, calls=2, what=f"{name} copy after the original changed:")
    eval_side_by_side(run, dup, dup_ref, w, what=f"{name} copy:")
    eval_side_by_side(run, model, ref, w, what=f"{name} original:")


@pytest.mark.parametrize("name", ["gcn", "gat", "graphsage", "gin", "mixhop", "dagnn", "appnp",
                                  "gcn_graph_readout"])
def test_torch_save_and_load_of_an_optimized_model(name):
    case = CASES_BY_NAME[name]
    run, model, ref, g, x, w = build_case(case, "undirected")
    train_side_by_side(run, model, ref, w, calls=1, what=f"{name} before saving:")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    loaded_ref = copy.deepcopy(ref)
    train_side_by_side(run, loaded, loaded_ref, w, what=f"{name} loaded:")
    eval_side_by_side(run, loaded, loaded_ref, w, what=f"{name} loaded:")
    scale_parameters(loaded, 2.0)
    eval_side_by_side(run, model, ref, w, what=f"{name} original after changing the loaded one:")


# -- modes and calls ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gcn", "gat", "graphsage", "sgc", "user_layers", "tagcn", "gin"])
def test_inference_mode(name):
    case = CASES_BY_NAME[name]
    run, model, ref, g, x, w = build_case(case, "undirected")
    model.eval()
    ref.eval()
    with torch.inference_mode(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            assert_close(run(model, w), run(ref, w), f"{name} under inference_mode")
        x_inf = x * 1.0               # an inference tensor
        assert_close(case.run(model, g, x_inf, w), case.run(ref, g, x_inf, w),
                     f"{name} under inference_mode, features made there")
    raised = [str(m.message) for m in seen if " raised " in str(m.message)]
    assert not raised, f"{name}: a plan failed under inference_mode: {raised}"
    eval_side_by_side(run, model, ref, w, what=f"{name} after inference_mode:")


def wrapped_layer_names(model):
    return sorted(n for n, m in model.named_modules() if "forward" in m.__dict__)


@pytest.mark.parametrize("name", ["gcn", "gat", "tagcn", "mixhop"])
def test_granii_twice(name):
    case = CASES_BY_NAME[name]
    run, model, ref, g, x, w = build_case(case, "undirected")
    first = wrapped_layer_names(model)
    assert first and "" not in first
    granii(model, g, x)
    assert wrapped_layer_names(model) == first, "the second granii() wrapped other modules"
    train_side_by_side(run, model, ref, w, what=f"{name} wrapped twice:")
    eval_side_by_side(run, model, ref, w, what=f"{name} wrapped twice:")


@pytest.mark.parametrize("name", ["gcn", "gat", "gin", "tagcn"])
def test_restore_gives_back_dgl_layers(name):
    case = CASES_BY_NAME[name]
    run, model, ref, g, x, w = build_case(case, "undirected")
    train_side_by_side(run, model, ref, w, calls=1, what=f"{name} optimized:")
    granii.restore(model)
    assert wrapped_layer_names(model) == []
    for m in model.modules():
        assert not any(k.startswith("_granii") for k in m.__dict__), type(m).__name__
    train_side_by_side(run, model, ref, w, what=f"{name} restored:")
    granii(model, g, x)
    assert wrapped_layer_names(model)
    train_side_by_side(run, model, ref, w, what=f"{name} optimized again:")


def model_state(model):
    """Everything granii() must leave as found."""
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": {n: None if p.grad is None else p.grad.clone()
                  for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def assert_same_state(after, before, what):
    assert after["training"] == before["training"], f"{what}: training flags changed"
    assert after["requires_grad"] == before["requires_grad"], f"{what}: requires_grad changed"
    assert torch.equal(after["rng"], before["rng"]), f"{what}: the random number generator moved"
    assert after["tensors"].keys() == before["tensors"].keys(), f"{what}: state_dict keys changed"
    for k, v in before["tensors"].items():
        assert torch.equal(after["tensors"][k], v), f"{what}: '{k}' changed"
    for k, v in before["grads"].items():
        a = after["grads"][k]
        assert (a is None) == (v is None) and (v is None or torch.equal(a, v)), \
            f"{what}: the gradient of '{k}' changed"


@pytest.mark.parametrize("name", ["gin", "mixhop", "gat", "graphsage", "sgc_cached", "tagcn"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_granii_leaves_the_model_as_found(name, mode):
    """Wrapped in the middle of training (or, for the cached SGC, before its first call):
    gradients, BatchNorm statistics, caches, the random number generator and the training flags
    are as granii() found them."""
    case = CASES_BY_NAME[name]
    g = undirected()
    x = features(g, case.in_feats)
    torch.manual_seed(0)
    model = case.build(g, case.in_feats, False)
    run = lambda m, w: case.run(m, g, x, w)
    if name != "sgc_cached":      # SGConv's cache stays empty: granii() must not fill it
        out = run(model.train(), None)
        (out * projection(out)).sum().backward()
    model.train(mode == "train")
    ref = copy.deepcopy(model)
    before = model_state(model)
    attributes = plain_attributes(model)
    granii(model, g, x)
    assert_same_state(model_state(model), before, f"granii() on {name} in {mode} mode")
    assert plain_attributes(model) == attributes, f"granii() on {name} changed attributes"
    train_side_by_side(run, model, ref, what=f"{name} after granii() in {mode} mode:")


def plain_attributes(model):
    """Identity of every attribute of every submodule that is not a parameter, buffer or
    submodule (caches such as SGConv's), leaving out the forward granii sets."""
    return {(n, k): id(v) for n, m in model.named_modules() for k, v in m.__dict__.items()
            if k not in ("_parameters", "_buffers", "_modules", "forward")
            and not k.startswith("_granii")}


# -- graphs and features changed in place -----------------------------------------------------------
def rewire(g, n_edges=25, seed=5):
    """Replace ``n_edges`` edges by as many other ones: same node and edge counts."""
    gen = torch.Generator().manual_seed(seed)
    eids = torch.randperm(g.num_edges(), generator=gen)[:n_edges]
    g.remove_edges(eids)
    u = torch.randint(0, g.num_nodes(), (n_edges,), generator=gen)
    v = torch.randint(0, g.num_nodes(), (n_edges,), generator=gen)
    g.add_edges(u, v)


@pytest.mark.parametrize("name", ["gcn", "sgc", "gat", "graphsage", "message_passing_gcn",
                                  "gin", "tagcn", "mixhop"])
def test_graph_edited_in_place_with_the_same_counts(name):
    case = CASES_BY_NAME[name]
    g = undirected()
    x = features(g, case.in_feats)
    torch.manual_seed(0)
    model = case.build(g, case.in_feats, True)
    ref = copy.deepcopy(model)
    granii(model, g, x)
    run = lambda m, w: case.run(m, g, x, w)
    eval_side_by_side(run, model, ref, what=f"{name} before the edit:")
    counts = (g.num_nodes(), g.num_edges())
    rewire(g)
    if case.holds_graph:          # the reference holds its own copy of the graph
        rewire(ref.g)
    assert (g.num_nodes(), g.num_edges()) == counts
    eval_side_by_side(run, model, ref, what=f"{name} after the edit:")
    train_side_by_side(run, model, ref, what=f"{name} after the edit:")


FEATURE_MODELS = ["gcn", "sgc", "tagcn", "user_layers", "appnp"]


@pytest.mark.parametrize("name", FEATURE_MODELS)
def test_features_changed_in_place_are_seen(name):
    """Writes autograd sees (in-place ops on the tensor) are always noticed."""
    case = CASES_BY_NAME[name]
    run, model, ref, g, x, w = build_case(case, "undirected")
    for change in (lambda: x.mul_(2), lambda: x[:5].fill_(0.5), lambda: x.add_(1)):
        eval_side_by_side(run, model, ref, what=f"{name} before the change:")
        change()
        eval_side_by_side(run, model, ref, what=f"{name} after an in-place change:")
        train_side_by_side(run, model, ref, calls=2, what=f"{name} after an in-place change:")


@pytest.mark.parametrize("name", FEATURE_MODELS)
def test_features_changed_behind_autograd_with_reuse_off(name):
    """Writes autograd does not see (``x.data``, the array of ``x.numpy()``) are noticed when
    feature reuse is off."""
    case = CASES_BY_NAME[name]
    g = undirected()
    arr = features(g, case.in_feats).numpy().copy()
    x = torch.from_numpy(arr)
    torch.manual_seed(0)
    model = case.build(g, case.in_feats, False)
    ref = copy.deepcopy(model)
    granii(model, g, x, reuse_inputs=False)
    run = lambda m, w: case.run(m, g, x, w)
    for change in (lambda: x.data.mul_(2), lambda: np.multiply(arr, -1.5, out=arr),
                   lambda: x.numpy().__setitem__(slice(0, 5), 0.25)):
        eval_side_by_side(run, model, ref, what=f"{name} before the change:")
        change()
        eval_side_by_side(run, model, ref, what=f"{name} after a change behind autograd:")
        train_side_by_side(run, model, ref, calls=2, what=f"{name} after a change behind "
                                                          "autograd:")


# -- gradients as DGL gives them ----------------------------------------------------------------------
def test_detach_stops_the_gradient_as_in_dgl():
    g = directed()
    x = features(g, 8).requires_grad_()
    torch.manual_seed(0)
    layer = models.DetachConv(8, 4)
    ref = copy.deepcopy(layer)
    granii(layer, g, x)
    outs = []
    for m in (ref, layer):
        out = m(g, x)
        (out * projection(out)).sum().backward()
        outs.append(out)
    assert ref.neigh.weight.grad is None
    assert layer.neigh.weight.grad is None and layer.neigh.bias.grad is None, \
        "a weight behind .detach() received a gradient"
    assert_close(outs[1], outs[0], "output")
    assert_same_grads(layer, ref, "detach")


def test_zero_in_degree_is_refused_as_dgl_refuses_it():
    g = directed()
    x = features(g, 12)
    torch.manual_seed(0)
    model = models.GCN(12, models.HIDDEN, models.CLASSES)
    ref = copy.deepcopy(model)
    granii(model, g, x)
    bad = zero_in_degree()
    xb = features(bad, 12)
    with pytest.raises(dgl.DGLError):
        ref(bad, xb)
    with pytest.raises(dgl.DGLError):
        model(bad, xb)


def test_sampled_graphsage_training_matches_dgl():
    g = undirected(120, 500)
    x = features(g, 12)
    torch.manual_seed(0)
    model = models.SampledSAGE(12, models.HIDDEN, models.CLASSES)
    ref = copy.deepcopy(model)
    sampler = dgl.dataloading.NeighborSampler([4, 4])
    loader = dgl.dataloading.DataLoader(g, torch.arange(60), sampler, batch_size=20,
                                        shuffle=False)
    batches = [(x[inp], blocks) for inp, _, blocks in loader]
    granii(model, batches[0][1], batches[0][0])
    for i, (h, blocks) in enumerate(batches):
        run = lambda m, w: m(blocks, h)
        train_side_by_side(run, model, ref, seed=i, what=f"sampled batch {i}:")
        eval_side_by_side(run, model, ref, what=f"sampled batch {i}:")


# -- calls users make beyond (graph, features) -------------------------------------------------------
def assert_ran_plans(model):
    """Every layer of a kind granii optimizes ran a plan on its last call (not DGL's forward,
    as a fallback or as a decision)."""
    states = [st for st in layer_states(model) if of_optimized_kind(st.module)]
    assert states
    for st in states:
        assert st.ran is not None and st.ran.kind == "plan", (st.name, st.ran)
        assert st.fallback is None


def test_gat_returning_its_attention_runs_dgls_forward_for_those_calls_only():
    """``GATConv(...)(g, x, get_attention=True)`` returns (output, attention): no plan returns the
    attention, so those calls run DGL's forward (the fallback says why) and give DGL's results;
    the layer's plain calls go on running granii's plans."""
    g = undirected()
    x = features(g, 12)
    torch.manual_seed(0)
    layer = dgl.nn.GATConv(12, 6, 4, feat_drop=0.2, attn_drop=0.3, residual=True)
    ref = copy.deepcopy(layer)
    granii(layer, g, x, tune=False)
    state = layer_states(layer)[0]

    def with_attention(m, w):
        out, attn = m(g, x, get_attention=True)
        assert attn.shape == (g.num_edges(), 4, 1)
        return torch.cat([out.flatten(), attn.flatten()])
    train_side_by_side(with_attention, layer, ref)
    assert "tuple" in state.fallback
    plain = lambda m, w: m(g, x)
    train_side_by_side(plain, layer, ref)
    eval_side_by_side(plain, layer, ref)
    assert_ran_plans(layer)


def test_autocast_calls_run_dgls_forward_and_the_plans_run_again_after():
    """Under ``torch.autocast`` DGL's layers take each step's dtype from autocast's rules and
    their own code (GraphConv returns float32: a bfloat16 product plus its float32 bias): those
    calls run DGL's forward, with DGL's outputs, dtypes and gradients, and the fallback says
    why; outside autocast the layers run granii's plans again."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = dgl.nn.GraphConv(12, 8, activation=torch.relu)
            self.b = dgl.nn.SAGEConv(8, 4, "mean")

        def forward(self, g, x):
            return self.b(g, self.a(g, x))
    g = undirected()
    x = features(g, 12)
    torch.manual_seed(0)
    model = Two()
    ref = copy.deepcopy(model)
    granii(model, g, x, tune=False)
    dtypes = []

    def mixed(m, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = m.a(g, x)
            out = m.b(g, hidden)
        dtypes.append((hidden.dtype, out.dtype))
        return out.float()
    train_side_by_side(mixed, model, ref)
    eval_side_by_side(mixed, model, ref)
    assert dtypes[0] == (torch.float32, torch.bfloat16)          # DGL's own
    assert all(d == dtypes[0] for d in dtypes)
    assert all("autocast" in st.fallback for st in layer_states(model))
    plain = lambda m, w: m(g, x)
    train_side_by_side(plain, model, ref)
    assert_ran_plans(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_match_dgl(reentrant):
    """Layers run under ``torch.utils.checkpoint`` (recomputed in the backward, with the same
    random numbers): outputs and gradients are DGL's, dropout included. The non-reentrant kind
    stops its recomputation by raising through the layer, which is not a plan failing; its
    recomputation runs the plan the forward ran. The reentrant kind runs the forward without
    gradients and recomputes with them, a call of another kind: that recomputation runs the
    layer's own forward, and is recorded as such (so there the gradients are DGL's forward's)."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = dgl.nn.GATConv(12, 4, 2, feat_drop=0.3, attn_drop=0.3)
            self.b = dgl.nn.GraphConv(8, 5)

        def forward(self, g, x):
            h = checkpoint(self.a, g, x, use_reentrant=reentrant).flatten(1)
            h = nn.functional.dropout(torch.relu(h), 0.5, self.training)
            return checkpoint(self.b, g, h, use_reentrant=reentrant)
    g = undirected()
    x = features(g, 12).requires_grad_()
    torch.manual_seed(0)
    model = Checkpointed()
    ref = copy.deepcopy(model)
    granii(model, g, x, tune=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)       # no plan reported as failing
        train_side_by_side(lambda m, w: m(g, x), model, ref, plans=True)
    if not reentrant:
        assert_ran_plans(model)
        return
    for st in layer_states(model):        # the last call: the recomputation in the backward
        assert st.ran.kind == "fallback" and "recomputation" in st.ran.reason, st.ran


def test_graphconv_with_a_weight_passed_at_the_call_matches_dgl():
    """``GraphConv(..., weight=False)`` multiplied by the ``weight`` given at each call (e.g. a
    hypernetwork's output): its gradient reaches whatever made it."""
    g = directed()
    x = features(g, 12)
    torch.manual_seed(0)
    model = nn.ModuleDict({"conv": dgl.nn.GraphConv(12, 5, weight=False, norm="both",
                                                    allow_zero_in_degree=True),
                           "make": nn.Linear(1, 12 * 5)})
    ref = copy.deepcopy(model)

    def forward(m, w=None):
        return m["conv"](g, x, weight=m["make"](torch.ones(1, 1)).view(12, 5))
    granii(model["conv"], g, x, extra_kwargs={"weight": torch.randn(12, 5)},
           tune=False)
    train_side_by_side(forward, model, ref)
    eval_side_by_side(forward, model, ref)
    assert_ran_plans(model)


def test_batched_graphs_with_a_readout_match_dgl():
    """A graph classifier: ``dgl.batch`` of graphs of different sizes, two layers, sum readout."""
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = dgl.nn.GraphConv(12, 8, activation=torch.relu)
            self.conv2 = dgl.nn.SAGEConv(8, 8, "mean")
            self.drop = nn.Dropout(0.3)
            self.readout = dgl.nn.SumPooling()
            self.out = nn.Linear(8, 3)

        def forward(self, g, x):
            return self.out(self.readout(g, self.conv2(g, self.drop(self.conv1(g, x)))))

    g = dgl.batch([undirected(40, 150), undirected(70, 300), undirected(25, 80)])
    x = features(g, 12)
    torch.manual_seed(0)
    model = Classifier()
    ref = copy.deepcopy(model)
    granii(model, g, x, tune=False)
    run = lambda m, w: m(g, x)
    train_side_by_side(run, model, ref, plans=True)
    eval_side_by_side(run, model, ref, plans=True)
    assert_ran_plans(model)


# -- falling back is not the way to pass --------------------------------------------------------------
def test_most_layers_of_the_optimized_kinds_run_an_optimized_plan():
    """At least 90% of the layers granii optimizes run an optimized plan in training and in eval
    (what each call ran, not DGL's forward as a fallback or as a decision); every layer that falls
    back has its reason in explain()."""
    counted, optimized, why = 0, 0, []
    for case in CASES:
        run, model, ref, g, x, w = build_case(case, "undirected")
        states = {id(s.module): s for s in layer_states(model)}
        layers = {id(m): (n, m) for n, m in model.named_modules() if of_optimized_kind(m)}
        ran = {k: True for k in layers}
        for training in (True, False):
            model.train(training)
            with torch.set_grad_enabled(training):
                _, last = ran_in(model, lambda: run(model, w))
            for k, (n, m) in layers.items():
                st = states.get(k)
                r = None if st is None else last.get(st.name)
                if r is None or r.kind != "plan":
                    ran[k] = False
                    reason = ("not wrapped" if st is None else "did not run" if r is None
                              else f"{r.kind}: {r.reason}")
                    why.append(f"{case.name}: {n} ({type(m).__name__}, "
                               f"{'training' if training else 'eval'}): {reason}")
        counted += len(layers)
        optimized += sum(ran.values())
        text = granii.explain(model, file=io.StringIO())
        for st in states.values():
            if st.fallback:
                assert st.fallback in text, f"{case.name}: explain() does not give the reason " \
                                            f"'{st.fallback}'"
    share = optimized / counted
    assert share >= 0.9, (f"{optimized} of {counted} layers ({share:.0%}) ran an optimized plan; "
                          "the others:\n" + "\n".join(why))
