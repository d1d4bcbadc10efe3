"""Relational layers: every RelGraphConv composition, and granii on RelGraphConv and
HeteroGraphConv models, give DGL's outputs and gradients.

Graphs are small generated ones (``granii.hetero_graphs`` at a small scale, and hand-made ones
with empty relations, one dominant relation, zero in-degree nodes, unsorted edge types, blocks).
"""
import copy
import sys

import dgl
import pytest
import torch
from dgl.nn.pytorch import GATConv, GraphConv, HeteroGraphConv, RelGraphConv, SAGEConv

from granii import granii, hetero, hetero_conv, hetero_graphs
from granii.kernels import typed

RTOL = 1e-4
RTOL_GRAD = 3e-4
R = 9


def assert_close(got, want, what, rtol=RTOL):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, DGL {tuple(want.shape)}"
    assert not (torch.isnan(got) != torch.isnan(want)).any(), f"{what}: NaN mismatch"
    if not want.numel():
        return
    err = (got.double() - want.double()).abs().max().item()
    tol = 1e-6 + rtol * want.abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def rel_graph(kind, seed=0):
    """``(g, etypes)``: relations 2 and 7 empty, relation 1 holding most edges, the last fifth of
    the nodes without in-edges, edge types unsorted (``sorted``: sorted by type)."""
    gen = torch.Generator().manual_seed(seed)
    n, e = 50, 600
    u = torch.randint(0, n, (e,), generator=gen)
    v = torch.randint(0, 4 * n // 5, (e,), generator=gen)
    et = torch.randint(0, R, (e,), generator=gen)
    et[torch.rand(e, generator=gen) < 0.6] = 1
    et[(et == 2) | (et == 7)] = 0
    if kind == "block":
        g = dgl.create_block((u, v % 20), num_src_nodes=n, num_dst_nodes=20)
        return g, et
    if kind == "sorted":
        order = torch.argsort(et, stable=True)
        u, v, et = u[order], v[order], et[order]
    if kind == "empty":
        return dgl.graph(([], []), num_nodes=n), torch.zeros(0, dtype=torch.long)
    return dgl.graph((u, v), num_nodes=n), et


def make_layer(reg, self_loop=True, seed=0, **kw):
    torch.manual_seed(seed)
    nb = {None: None, "basis": 3, "bdd": 2}[reg]
    return RelGraphConv(8, 6, R, reg, nb, self_loop=self_loop, **kw)


def grads(layer, x, out):
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    # a graph without edges leaves some inputs unused: DGL gives no gradient, a plan zeros
    z = lambda t: torch.zeros_like(t) if t.grad is None else t.grad.clone()
    gs = {n: z(p) for n, p in layer.named_parameters()}
    gs["x"] = z(x)
    layer.zero_grad()
    x.grad = None
    return gs


# -- every composition, kept and pruned --------------------------------------------------------------
@pytest.mark.parametrize("reg", [None, "basis", "bdd"])
@pytest.mark.parametrize("kind", ["unsorted", "block", "empty"])
def test_every_plan_gives_dgl(reg, kind):
    g, et = rel_graph(kind)
    kept, pruned = hetero.plans_for(reg)
    norm = torch.rand(g.num_edges(), 1) + 0.1
    for with_norm in (False, True):
        layer = make_layer(reg, self_loop=kind != "empty")
        x = torch.randn(g.num_src_nodes(), 8, requires_grad=True)
        nm = norm if with_norm else None
        want = layer(g, x, et, nm)
        want_g = grads(layer, x, want)
        idx = hetero.relational_index(g, et, R)
        for plan in list(kept) + list(pruned):
            out = hetero._rel_run(hetero.RelState("l", layer), plan, idx, layer, g, x, et, nm,
                                  False, (), {})
            what = f"{reg} {kind} norm={with_norm} {hetero.plan_name(plan)}"
            assert_close(out, want, what)
            got_g = grads(layer, x, out)
            for n in want_g:
                assert_close(got_g[n], want_g[n], f"{what}: gradient of {n}", RTOL_GRAD)


def typed_hetero_graph():
    """``(g, etypes)`` of a heterograph made homogeneous: node type ``lone`` isolated, relation
    ``empty`` without edges, ``cites`` holding nine edges in ten, edge types sorted."""
    gen = torch.Generator().manual_seed(4)
    r = lambda n, m: torch.randint(0, n, (m,), generator=gen)
    none = torch.tensor([], dtype=torch.long)
    hg = dgl.heterograph({
        ("paper", "cites", "paper"): (r(30, 450), r(30, 450)),
        ("author", "writes", "paper"): (r(10, 40), r(30, 40)),
        ("paper", "empty", "author"): (none, none),
        ("paper", "written-by", "author"): (r(30, 10), r(8, 10)),
    }, num_nodes_dict={"paper": 30, "author": 10, "lone": 6})
    g = dgl.to_homogeneous(hg)
    et = g.edata[dgl.ETYPE].long()
    lone = g.ndata[dgl.NTYPE] == hg.ntypes.index("lone")
    empty = hg.canonical_etypes.index(("paper", "empty", "author"))
    assert lone.sum() == 6 and (g.in_degrees()[lone] + g.out_degrees()[lone]).sum() == 0
    assert (et == empty).sum() == 0 and (et[1:] >= et[:-1]).all()
    return dgl.graph(g.edges(order="eid"), num_nodes=g.num_nodes()), et


@pytest.mark.parametrize("reg", [None, "basis", "bdd"])
def test_every_plan_on_typed_graph(reg):
    """Isolated node type, an empty relation, one dominant relation: every composition, kept
    and pruned, gives DGL's outputs and gradients (both of DGL's paths: the types are sorted)."""
    g, et = typed_hetero_graph()
    kept, pruned = hetero.plans_for(reg)
    idx = hetero.relational_index(g, et, R)
    for presorted in (False, True):
        layer = make_layer(reg)
        x = torch.randn(g.num_nodes(), 8, requires_grad=True)
        want = layer(g, x, et, presorted=presorted)
        want_g = grads(layer, x, want)
        for plan in list(kept) + list(pruned):
            out = hetero._rel_run(hetero.RelState("l", layer), plan, idx, layer, g, x, et, None,
                                  presorted, (), {})
            what = f"{reg} presorted={presorted} {hetero.plan_name(plan)}"
            assert_close(out, want, what)
            got_g = grads(layer, x, out)
            for n in want_g:
                assert_close(got_g[n], want_g[n], f"{what}: gradient of {n}", RTOL_GRAD)


def test_norm_gradient():
    g, et = rel_graph("unsorted")
    layer = make_layer("basis")
    x = torch.randn(50, 8)
    norm = (torch.rand(g.num_edges(), 1) + 0.1).requires_grad_()
    want = layer(g, x, et, norm)
    (gw,) = torch.autograd.grad(want.sum(), norm)
    idx = hetero.relational_index(g, et, R)
    for plan in hetero.plans_for("basis")[0]:
        out = hetero._rel_run(hetero.RelState("l", layer), plan, idx, layer, g, x, et, norm,
                              False, (), {})
        (got,) = torch.autograd.grad(out.sum(), norm)
        assert_close(got, gw, f"norm gradient, {hetero.plan_name(plan)}", RTOL_GRAD)


# -- the enumeration ---------------------------------------------------------------------------------------
def test_enumeration_and_pruning():
    for reg, n_all in ((None, 4), ("bdd", 4), ("basis", 4 + 15)):
        kept, pruned = hetero.plans_for(reg)
        assert len(kept) + len(pruned) == n_all
        # the per-edge typed product (DGL's order) never beats the compact (src, rel) one
        assert pruned[(("W", "2"),)] is not None
        assert (("W", "1"),) in kept and (("W", "3"),) in kept
    kept, _ = hetero.plans_for("basis")
    assert (("V", "0"), ("a", "2")) in kept          # bases before aggregation, folded combine
    assert (("a", "2"), ("V", "4")) in kept          # bases after aggregation


def test_kernel_calls_do_not_grow_with_relations(monkeypatch):
    calls = []
    for name in ("move", "segment_gemm"):
        f = getattr(typed, name)
        monkeypatch.setattr(typed, name, lambda *a, _f=f, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    counts = []
    for rels in (10, 300):
        gen = torch.Generator().manual_seed(0)
        g = dgl.graph((torch.randint(0, 200, (3000,), generator=gen),
                       torch.randint(0, 200, (3000,), generator=gen)), num_nodes=200)
        et = torch.randint(0, rels, (3000,), generator=gen)
        layer = RelGraphConv(8, 8, rels, "basis", 4)
        idx = hetero.relational_index(g, et, rels)
        per_plan = []
        for plan in hetero.plans_for("basis")[0]:
            calls.clear()
            hetero.run_plan(plan, idx, layer.linear_r, torch.randn(200, 8), None)
            per_plan.append(len(calls))
        counts.append(per_plan)
    assert counts[0] == counts[1] and max(counts[0]) <= 3


def test_moves_built_once_per_graph():
    """Every move of a plan is built on the first call and reused (not rebuilt, not kept again)."""
    g, et = rel_graph("unsorted")
    idx = hetero.relational_index(g, et, R)
    layer = make_layer("basis")
    x = torch.randn(50, 8)
    for plan in hetero.plans_for("basis")[0]:
        hetero.run_plan(plan, idx, layer.linear_r, x, None)
    built = dict(idx._moves)
    for plan in hetero.plans_for("basis")[0]:
        hetero.run_plan(plan, idx, layer.linear_r, x, None)
    assert idx._moves.keys() == built.keys()
    assert all(idx._moves[key] is m for key, m in built.items())
    assert all(isinstance(key, tuple) for key in built)


def test_rates_measured_per_width_bucket():
    assert [hetero._width(k) for k in (1, 8, 9, 16, 17, 64, 300)] == [8, 8, 16, 16, 32, 64, 256]
    r = hetero.rates(12, 16)
    assert r is hetero.rates(16, 13) and set(r) >= {"gemm", "seg", "sparse", "stream", "calls"}
    assert all(v > 0 for v in r.values())


def test_index_keeps_nothing_of_size_nodes_times_relations():
    """The index of a graph with many relations holds tensors of at most max(E, N) entries."""
    g, et = rel_graph("unsorted")
    idx = hetero.relational_index(g, et, 5000)
    held = [t for d in (idx.at, idx.rel, idx.seglen, idx.node) for t in d.values()]
    assert max(t.numel() for t in held) <= max(idx.E, idx.N_src, 5000)


def test_segment_gemm_gradients():
    gen = torch.Generator().manual_seed(2)
    seglen = torch.tensor([3, 0, 7, 1, 0])                     # empty relations among them
    x = torch.randn(11, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(5, 4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: typed.segment_gemm(a, b, seglen), (x, w))


def test_move_matches_reference():
    gen = torch.Generator().manual_seed(0)
    row, col = torch.randint(0, 30, (200,), generator=gen), torch.randint(0, 40, (200,), generator=gen)
    m = typed.Move(row, col, 30, 40, torch.randperm(200, generator=gen))
    x = torch.randn(40, 3, 5, dtype=torch.float64, requires_grad=True)
    val = torch.rand(200, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: typed.move(m, a, b), (x, val))
    assert_close(typed.move(m, x, val), typed.move_reference(m, x, val), "move")


# -- granii on RelGraphConv models --------------------------------------------------------------------------
class RGCN(torch.nn.Module):
    def __init__(self, reg, n, presorted=False, dropout=0.0, norm=None, layer_norm=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(n, 8)
        nb = {None: None, "basis": 3, "bdd": 2}[reg]
        self.l1 = RelGraphConv(8, 8, R, reg, nb, activation=torch.relu, self_loop=True,
                               dropout=dropout, layer_norm=layer_norm)
        self.l2 = RelGraphConv(8, 4, R, reg, nb, self_loop=False)
        self.presorted, self.norm = presorted, norm

    def forward(self, g, etypes):
        h = self.l1(g, self.emb.weight, etypes, self.norm, presorted=self.presorted)
        return self.l2(g, h, etypes, self.norm, presorted=self.presorted)


def side_by_side(model, ref, g, et, calls=4, train=True):
    for m in (model, ref):
        m.train(train)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-3)
    for i in range(calls):
        outs = []
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            torch.manual_seed(100 + i)
            out = m(g, et)
            if train:
                out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(i)))
            outs.append(out)
        assert_close(outs[1], outs[0], f"call {i}")
        if train:
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                if p.grad is None and q.grad is None:            # frozen
                    continue
                assert_close(p.grad, q.grad, f"call {i}: gradient of {n}", RTOL_GRAD)
            opt.step()
            opt_ref.step()


@pytest.mark.parametrize("reg", [None, "basis", "bdd"])
@pytest.mark.parametrize("presorted", [False, True])
def test_granii_rgcn_training_and_eval(reg, presorted):
    g, et = rel_graph("sorted" if presorted else "unsorted", seed=3)
    norm = torch.rand(g.num_edges(), 1) if reg == "basis" else None
    model = RGCN(reg, g.num_nodes(), presorted, dropout=0.3, norm=norm, layer_norm=reg == "bdd")
    ref = copy.deepcopy(model)
    granii(model, g, et)
    side_by_side(model, ref, g, et, calls=12)          # covers the measured tie-break
    side_by_side(model, ref, g, et, calls=2, train=False)
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert "<- chosen" in text and "compositions:" in text
    assert "original forward" not in text.split("measured")[0] or "kept" in text


def test_training_decision_times_forward_and_backward(monkeypatch):
    """In training the two best plans are timed forward + backward on the first call and the
    faster kept at once; no gradient leaks into ``.grad`` (the steps match DGL's), also with a
    frozen typed weight (the plan's output then needs no backward)."""
    monkeypatch.setattr(hetero, "TRIAL_MARGIN", 1e9)           # the second plan is always timed
    g, et = rel_graph("unsorted", seed=5)
    for frozen in (False, True):
        model = RGCN("basis", g.num_nodes())
        if frozen:
            model.emb.weight.requires_grad_(False)
            model.l1.linear_r.requires_grad_(False)
        ref = copy.deepcopy(model)
        granii(model, g, et)
        side_by_side(model, ref, g, et, calls=3)
        st = model.l1.forward.state
        times, kept, how = st.tuned
        assert how == "forward + backward, on the first call" and len(times) == 2
        assert kept == min(times, key=lambda t: t[1])[0] == hetero.plan_name(st.last[3])
        assert "forward + backward" in granii.explain(model, file=open("/dev/null", "w"))


def test_presorted_with_unsorted_types_runs_dgl():
    g, et = rel_graph("unsorted")
    model = RGCN(None, g.num_nodes(), presorted=True)
    ref = copy.deepcopy(model)
    granii(model, g, et)
    side_by_side(model, ref, g, et, calls=2)
    assert "presorted=True with edge types that are not sorted" in granii.explain(
        model, file=open("/dev/null", "w"))


def test_unsupported_input_runs_dgl():
    g, et = rel_graph("unsorted")
    layer = make_layer(None)
    ref = copy.deepcopy(layer)
    x = torch.randn(50, 8, dtype=torch.float64)
    granii(layer, g, torch.randn(50, 8), extra_args=(et,))
    layer.double()
    ref.double()
    assert_close(layer(g, x, et), ref(g, x, et), "float64")
    assert "float32" in granii.explain(layer, file=open("/dev/null", "w"))


def test_plans_over_the_memory_limit_not_run(monkeypatch):
    g, et = rel_graph("unsorted")
    idx = hetero.relational_index(g, et, R)
    kept = hetero.plans_for(None)[0]
    held = {p: hetero.intermediate_bytes(p, idx.sizes(), 8, 6, None, None) for p in kept}
    every_rel = (("W", "0R"),)
    assert max(held, key=held.get) == every_rel           # every node under every relation
    for limit, expect in ((held[every_rel] - 1, "not run: W@N_src x R (its intermediate"),
                          (0, "no composition can run on this input")):
        monkeypatch.setattr(hetero, "INTERMEDIATE_BYTES_LIMIT", limit)
        runs = hetero.runnable(kept, idx.sizes(), 8, 6, None, None)
        assert every_rel not in runs and len(runs) == (len(kept) - 1 if limit else 0)
        layer = make_layer(None)
        ref = copy.deepcopy(layer)
        x = torch.randn(50, 8, requires_grad=True)
        granii(layer, g, x.detach(), extra_args=(et,))
        out = layer(g, x, et)
        assert_close(out, ref(g, x, et), f"limit {limit}")
        assert expect in granii.explain(layer, file=open("/dev/null", "w"))


def test_generated_rgcn_graph():
    hg = hetero_graphs.generate("aifb", scale=0.05, seed=1)
    g, et = hetero_graphs.relational(hg, shuffle=True)
    s = hetero_graphs.stats(g, et)
    assert s["relations"] == 2 * 45 and s["top5_share"] > 0.2
    assert 0.05 < s["src_pairs_per_edge"] < 0.9
    model = RGCN("basis", g.num_nodes())
    model.l1 = RelGraphConv(8, 8, s["relations"], "basis", 4, self_loop=True)
    model.l2 = RelGraphConv(8, 4, s["relations"], "basis", 4)
    ref = copy.deepcopy(model)
    granii(model, g, et)
    side_by_side(model, ref, g, et, calls=3)


# -- HeteroGraphConv -----------------------------------------------------------------------------------------
def small_hetero(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda n, m: torch.randint(0, n, (m,), generator=gen)
    return dgl.heterograph({
        ("user", "follows", "user"): (r(30, 120), r(25, 120)),       # users 25.. without in-edges
        ("user", "plays", "game"): (r(30, 90), r(12, 90)),
        ("game", "played-by", "user"): (r(12, 80), r(30, 80)),
        ("store", "sells", "game"): (torch.tensor([], dtype=torch.long),
                                     torch.tensor([], dtype=torch.long)),
    }, num_nodes_dict={"user": 30, "game": 15, "store": 4, "isolated": 3})


def conv(kind, out=4):
    if kind == "gcn":
        return GraphConv(8, out, norm="both", allow_zero_in_degree=True)
    if kind == "sage":
        return SAGEConv(8, out, "mean")
    return GATConv(8, out, 1, allow_zero_in_degree=True)


class HModel(torch.nn.Module):
    def __init__(self, kind, agg):
        super().__init__()
        torch.manual_seed(0)
        rels = ["follows", "plays", "played-by", "sells"]
        self.h = HeteroGraphConv({r: conv(kind) for r in rels}, aggregate=agg)

    def forward(self, g, x):
        return self.h(g, x)


def h_inputs(g, requires_grad=True):
    gen = torch.Generator().manual_seed(5)
    return {t: torch.randn(g.num_src_nodes(t), 8, generator=gen).requires_grad_(requires_grad)
            for t in g.srctypes}


def compare_hetero(model, ref, g, x, calls=3, train=True):
    """Outputs, parameter and input gradients of ``model`` and ``ref`` over several calls, each
    call under the same seed for both (dropout draws the same masks)."""
    for m in (model, ref):
        m.train(train)
    for i in range(calls):
        outs = []
        for m in (ref, model):
            m.zero_grad()
            for t in x.values():
                t.grad = None
            torch.manual_seed(100 + i)
            out = m(g, x)
            loss = sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(j))).sum()
                       for j, o in enumerate(out[k] for k in sorted(out)))
            if train:
                loss.backward()
            outs.append((out, {n: p.grad.clone() for n, p in m.named_parameters()
                               if p.grad is not None},
                         {t: v.grad.clone() for t, v in x.items() if v.grad is not None}))
        (o_ref, g_ref, x_ref), (o, g_got, x_got) = outs
        assert sorted(o) == sorted(o_ref)
        for k in o_ref:
            assert_close(o[k], o_ref[k], f"call {i}: output {k}")
        assert sorted(g_got) == sorted(g_ref) and sorted(x_got) == sorted(x_ref)
        for n in g_ref:
            assert_close(g_got[n], g_ref[n], f"call {i}: gradient of {n}", RTOL_GRAD)
        for t in x_ref:
            assert_close(x_got[t], x_ref[t], f"call {i}: gradient of input {t}", RTOL_GRAD)


@pytest.mark.parametrize("kind", ["gcn", "sage", "gat"])
@pytest.mark.parametrize("agg", ["sum", "mean", "max", "stack"])
def test_hetero_graphconv(kind, agg):
    g = small_hetero()
    model = HModel(kind, agg)
    ref = copy.deepcopy(model)
    x = h_inputs(g)
    granii(model, g, x)
    compare_hetero(model, ref, g, x)
    compare_hetero(model, ref, g, x, calls=1, train=False)
    text = granii.explain(model, file=open("/dev/null", "w"))
    if agg in ("sum", "mean"):              # the relations stacked: hetero_flat
        assert "one typed product with the 2 relation(s) into 'user'" in text
        assert "relations run one by one" not in text
    else:
        assert "one tensor on the relation graph" in text
        assert ("source features on a block" if kind == "gcn" else "cat(x_dst, x_src)") in text
    if agg in ("max", "stack"):
        assert "relations run one by one: an aggregation across relations other than" in text



def test_container_tie_break_then_either_path_gives_dgl():
    """After the relations' own decisions, the container times the routed call against DGL's
    forward (forward + backward) and keeps one; both give DGL's outputs and gradients."""
    from granii.runtime.dispatch import dispatcher_of
    from granii.runtime.state import ORIGINAL
    from granii.runtime.tiebreak import TRIAL_ROUNDS
    g = small_hetero()
    model = HModel("gat", "max")            # max across relations: relation by relation
    ref = copy.deepcopy(model)
    x = h_inputs(g)
    granii(model, g, x)
    state = dispatcher_of(model.h).state
    compare_hetero(model, ref, g, x, calls=hetero_conv.ROUTED_WARMUP)
    assert state.kept is None and state.routed_calls == hetero_conv.ROUTED_WARMUP
    compare_hetero(model, ref, g, x, calls=2 * (TRIAL_ROUNDS + 1) + 1)
    assert state.kept in (hetero_conv.ROUTED, ORIGINAL)
    assert sorted(lb for lb, _ in state.tuned) == sorted([hetero_conv.ROUTED, ORIGINAL])
    assert all(t > 0 for _, t in state.tuned)
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert f"kept {state.kept}" in text
    # every decision settled: no timing hook is left on the parameters
    assert all(not p._backward_hooks for p in model.parameters())
    for kept in (ORIGINAL, hetero_conv.ROUTED):
        state.kept = kept
        compare_hetero(model, ref, g, x, calls=2)
        compare_hetero(model, ref, g, x, calls=1, train=False)


def test_container_tie_break_off_when_deterministic():
    from granii.runtime.dispatch import dispatcher_of
    g = small_hetero()
    model = HModel("sage", "mean")
    ref = copy.deepcopy(model)
    x = h_inputs(g)
    granii(model, g, x, deterministic=True)
    compare_hetero(model, ref, g, x, calls=hetero_conv.ROUTED_WARMUP + 10)
    state = dispatcher_of(model.h).state
    assert state.kept is None and state.tuned is None

@pytest.mark.parametrize("kind", ["sage", "gat"])
def test_hetero_sampled_blocks(kind):
    g = small_hetero(1)
    model = HModel(kind, "sum")
    ref = copy.deepcopy(model)
    sampler = dgl.dataloading.NeighborSampler([3])
    feats = h_inputs(g, requires_grad=False)
    first = None
    for seed in range(3):
        torch.manual_seed(seed)
        _, _, blocks = sampler.sample_blocks(g, {"user": torch.arange(0, 30, 2),
                                                 "game": torch.arange(0, 15, 3)})
        b = blocks[0]
        x = {t: feats[t][b.srcnodes[t].data[dgl.NID]].clone().requires_grad_() for t in b.srctypes}
        if first is None:
            granii(model, b, x)
            first = b
        compare_hetero(model, ref, b, x, calls=1)
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert "one typed product" in text


def test_hetero_falls_back_where_pair_needed():
    g = small_hetero()
    torch.manual_seed(0)
    model = HeteroGraphConv({"follows": GATConv((8, 8), 4, 1, allow_zero_in_degree=True),
                             "plays": SAGEConv(8, 4, "mean", feat_drop=0.5),
                             "played-by": GATConv((8, 8), 4, 1, allow_zero_in_degree=True),
                             "sells": GraphConv(8, 4, allow_zero_in_degree=True)})
    ref = copy.deepcopy(model)
    x = h_inputs(g)
    granii(model, g, x)
    for i in range(2):
        torch.manual_seed(i)
        out = model(g, x)
        torch.manual_seed(i)
        want = ref(g, x)
        for k in want:
            assert_close(out[k], want[k], f"{k}")
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert "separate weights" in text and "dropout in training" in text


# -- HeteroGraphConv of GraphConv: one typed product per destination type ---------------------------------
from granii import hetero_flat  # noqa: E402
from granii.runtime.dispatch import dispatcher_of# noqa: E402
from granii.runtime.state import ORIGINAL
from granii.runtime.tiebreak import TRIAL_ROUNDS


class RGCNHetero(torch.nn.Module):
    """DGL's rgcn-hetero example layer: GraphConv(norm="right", weight=False, bias=False) per
    relation, the weights passed per call (``mod_kwargs``), from bases when ``bases``."""

    def __init__(self, rels, k_in, k_out, bases=0, agg="sum"):
        super().__init__()
        torch.manual_seed(0)
        self.rels = list(rels)
        self.conv = HeteroGraphConv({r: GraphConv(k_in, k_out, norm="right", weight=False,
                                                  bias=False) for r in self.rels}, aggregate=agg)
        if bases:
            self.basis = dgl.nn.WeightBasis((k_in, k_out), bases, len(self.rels))
        else:
            self.weight = torch.nn.Parameter(torch.randn(len(self.rels), k_in, k_out) * 0.3)
        self.loop = torch.nn.Linear(k_in, k_out)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, g, x):
        w = self.basis() if hasattr(self, "basis") else self.weight
        wdict = {r: {"weight": wr.squeeze(0)} for r, wr in zip(self.rels, torch.split(w, 1))}
        dst = {k: v[: g.num_dst_nodes(k)] for k, v in x.items()} if g.is_block else x
        hs = self.conv(g, x, mod_kwargs=wdict)
        return {t: self.drop(torch.relu(h + self.loop(dst[t]))) for t, h in hs.items()}


def hetero_rels(rels, seed=0, n=40):
    """A heterograph with ``rels`` relations over three node types: one relation holding most
    edges, one empty, destination nodes without in-edges, an isolated node type."""
    gen = torch.Generator().manual_seed(seed)
    types = ["a", "b", "c"]
    data = {}
    for i in range(rels):
        s, d = types[i % 3], types[(i // 3) % 3]
        m = 0 if i == 1 else (400 if i == 0 else 30)
        data[(s, f"r{i}", d)] = (torch.randint(0, n, (m,), generator=gen),
                                 torch.randint(0, n - 8, (m,), generator=gen))
    return dgl.heterograph(data, num_nodes_dict={"a": n, "b": n, "c": n, "lonely": 5})


def typed_inputs(g, k, requires_grad=True, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return {t: torch.randn(g.num_src_nodes(t), k, generator=gen).requires_grad_(requires_grad)
            for t in g.srctypes}


@pytest.mark.parametrize("bases", [0, 3])
@pytest.mark.parametrize("agg", ["sum", "mean"])
def test_rgcn_hetero_example_runs_typed_products(bases, agg):
    g = hetero_rels(12)
    model = RGCNHetero(g.etypes, 8, 6, bases, agg)
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    granii(model, g, x)
    state = dispatcher_of(model.conv).state
    compare_hetero(model, ref, g, x, calls=1)
    assert state.flat_calls >= 1 and state.flat_reason is None
    assert set(state.flat_info) == {"a", "b", "c"}
    # the container's tie-break starts on the next call: typed products against DGL's forward
    compare_hetero(model, ref, g, x, calls=2 * (TRIAL_ROUNDS + 1) + 1)
    assert state.kept in (hetero_conv.FLAT, ORIGINAL)
    assert sorted(lb for lb, _ in state.tuned) == sorted([hetero_conv.FLAT, ORIGINAL])
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert "into 'a': 6 relation(s) stacked" in text and "<- chosen" in text
    for kept in (hetero_conv.FLAT, ORIGINAL):
        state.kept = kept
        compare_hetero(model, ref, g, x, calls=2)
        compare_hetero(model, ref, g, x, calls=2, train=False)


@pytest.mark.parametrize("plan", hetero.plans_for(None)[0], ids=hetero.plan_name)
@pytest.mark.parametrize("train", [True, False])
def test_every_typed_plan_gives_dgl(monkeypatch, plan, train):
    """Each composition, forced, with norms of every kind, module weights and biases."""
    monkeypatch.setattr(hetero_flat, "decide", lambda *a, **k: (plan, [(plan, 0.0)], None))
    g = hetero_rels(9, seed=1)
    norms = ["none", "right", "left", "both"]
    torch.manual_seed(0)
    model = HeteroGraphConv({r: GraphConv(8, 5, norm=norms[i % 4], bias=i % 2 == 0)
                             if i % 3 else SAGEConv(8, 5, "mean", bias=i % 2 == 0)
                             for i, r in enumerate(g.etypes)})
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    granii(model, g, x)
    compare_hetero(model, ref, g, x, calls=2, train=train)
    assert dispatcher_of(model).state.flat_calls >= 2


def test_typed_products_without_weights():
    g = hetero_rels(6, seed=2)
    torch.manual_seed(0)
    model = HeteroGraphConv({r: GraphConv(8, 8, norm="both", weight=False) for r in g.etypes},
                            aggregate="mean")
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    granii(model, g, x)
    compare_hetero(model, ref, g, x)
    assert dispatcher_of(model).state.flat_calls >= 3


def test_typed_products_on_hetero_blocks():
    g = hetero_rels(9, seed=3)
    model = RGCNHetero(g.etypes, 8, 6)
    ref = copy.deepcopy(model)
    sampler = dgl.dataloading.NeighborSampler([4])
    feats = typed_inputs(g, 8, requires_grad=False)
    for seed in range(3):
        torch.manual_seed(seed)
        _, _, (b,) = sampler.sample_blocks(g, {"a": torch.arange(0, 30, 2),
                                               "c": torch.arange(0, 20, 3)})
        x = {t: feats[t][b.srcnodes[t].data[dgl.NID]].clone().requires_grad_()
             for t in b.srctypes}
        if seed == 0:
            granii(model, b, x)
        compare_hetero(model, ref, b, x, calls=1)
    assert dispatcher_of(model.conv).state.flat_calls >= 3


def test_kernel_calls_of_typed_products_do_not_grow_with_relations(monkeypatch):
    """From 12 to 120 relations each composition makes the same number of sparse and typed
    kernel calls (at most 3 per destination type), and no relation's module runs."""
    counted = []
    for name in ("move", "segment_gemm"):
        f = getattr(typed, name)
        monkeypatch.setattr(typed, name,
                            lambda *a, _f=f, _n=name, **k: (counted.append(_n), _f(*a, **k))[1])
    per_size = []
    for rels in (12, 120):
        g = hetero_rels(rels, seed=4)
        per_plan = []
        for plan in hetero.plans_for(None)[0]:
            monkeypatch.setattr(hetero_flat, "decide", lambda *a, p=plan, **k: (p, [], None))
            model = RGCNHetero(g.etypes, 8, 6)
            x = typed_inputs(g, 8)
            granii(model, g, x, deterministic=True)   # no timed tie-break: one path each call
            ran = []
            for m in model.conv.mods.values():
                m.register_forward_pre_hook(lambda *a: ran.append(1))
            counted.clear()
            model(g, x)
            assert not ran
            per_plan.append(len(counted))
        per_size.append(per_plan)
    assert per_size[0] == per_size[1] and max(per_size[0]) <= 3 * 3


@pytest.mark.parametrize("agg", ["sum", "mean"])
@pytest.mark.parametrize("bias", [True, False])
def test_gat_relations_stacked(agg, bias):
    """GATConv relations (2 heads): one softmax per (destination, relation) pair on the
    stacked graph; outputs and gradients as DGL's, in training and eval, also on blocks."""
    g = hetero_rels(9, seed=8)
    torch.manual_seed(0)
    model = HeteroGraphConv({r: GATConv(8, 3, 2, negative_slope=0.1, bias=bias,
                                        allow_zero_in_degree=True) for r in g.etypes},
                            aggregate=agg)
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    granii(model, g, x)
    state = dispatcher_of(model).state
    compare_hetero(model, ref, g, x, calls=2)
    compare_hetero(model, ref, g, x, calls=1, train=False)
    assert state.flat_reason is None and state.flat_calls >= 3
    assert "fused GAT kernel" in granii.explain(model, file=open("/dev/null", "w"))
    sampler = dgl.dataloading.NeighborSampler([3])
    for seed in range(2):
        torch.manual_seed(seed)
        _, _, (b,) = sampler.sample_blocks(g, {"a": torch.arange(0, 30, 2),
                                               "b": torch.arange(0, 20, 3)})
        xb = {t: x[t].detach()[b.srcnodes[t].data[dgl.NID]].clone().requires_grad_()
              for t in b.srctypes}
        compare_hetero(model, ref, b, xb, calls=1)


def test_gat_dropout_in_training_runs_relation_by_relation():
    g = hetero_rels(6, seed=9)
    torch.manual_seed(0)
    model = HeteroGraphConv({r: GATConv(8, 3, 2, attn_drop=0.3, allow_zero_in_degree=True)
                             for r in g.etypes})
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    granii(model, g, x)
    compare_hetero(model, ref, g, x, calls=2)
    assert "dropout inside the relation's GATConv in training" in granii.explain(
        model, file=open("/dev/null", "w"))
    compare_hetero(model, ref, g, x, calls=1, train=False)
    assert dispatcher_of(model).state.flat_reason is None


@pytest.mark.parametrize("train", [True, False])
def test_sage_relations_stacked_unless_dropout_draws(train):
    """Mean SAGEConv relations (destination features through fc_self) run stacked, except
    with feature dropout in training: there DGL draws a mask per relation."""
    g = hetero_rels(9, seed=7)
    torch.manual_seed(0)
    model = HeteroGraphConv({r: SAGEConv(8, 6, "mean", feat_drop=0.4) for r in g.etypes},
                            aggregate="mean")
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    granii(model, g, x)
    state = dispatcher_of(model).state
    before = state.flat_calls
    compare_hetero(model, ref, g, x, calls=2, train=train)
    if train:
        assert state.flat_calls == before
        assert "feature dropout inside the relation's SAGEConv in training" in granii.explain(
            model, file=open("/dev/null", "w"))
    else:
        assert state.flat_calls == before + 2


@pytest.mark.parametrize("what", ["activation", "edge_weight", "some_weights"])
def test_typed_products_fall_back_with_reason(what):
    g = hetero_rels(6, seed=5)
    torch.manual_seed(0)
    act = torch.relu if what == "activation" else None
    mods = {r: GraphConv(8, 8, activation=act, weight=not (what == "some_weights" and i == 0))
            for i, r in enumerate(g.etypes)}
    model = HeteroGraphConv(mods)
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    kw = {}
    if what == "edge_weight":
        kw = {"mod_kwargs": {r: {"edge_weight": torch.rand(g.num_edges(r))} for r in g.etypes}}
    granii(model, g, x)
    state = dispatcher_of(model).state
    before = state.flat_calls
    for _ in range(2):
        out, want = model(g, x, **kw), ref(g, x, **kw)
        for k in want:
            assert_close(out[k], want[k], k)
    assert state.flat_calls == before
    reason = {"activation": "an activation inside", "edge_weight": "keyword arguments",
              "some_weights": "weights on some relations only"}[what]
    assert reason in granii.explain(model, file=open("/dev/null", "w"))


def test_relations_of_different_widths_raise_as_dgl():
    g = hetero_rels(6, seed=5)
    mods = {r: GraphConv(8, 4) for r in g.etypes}
    mods[g.etypes[0]] = GraphConv(8, 8, weight=False)
    model = HeteroGraphConv(mods)
    x = typed_inputs(g, 8)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        copy.deepcopy(model)(g, x)
    with pytest.raises(RuntimeError, match="stack expects each tensor") as raised:
        granii(model, g, x)
    if sys.version_info >= (3, 11):
        assert any("left unchanged" in n for n in raised.value.__notes__)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_missing_destination_features_raise_as_dgl():
    g = hetero_rels(6, seed=6)
    model = HeteroGraphConv({r: GraphConv(8, 4) for r in g.etypes})
    ref = copy.deepcopy(model)
    x = typed_inputs(g, 8)
    granii(model, g, x)
    del x["b"]
    with pytest.raises(KeyError):
        ref(g, x)
    with pytest.raises(KeyError):
        model(g, x)


# -- HGTConv ---------------------------------------------------------------------------------------------
from dgl.nn.pytorch import HGTConv  # noqa: E402

from granii import hetero_hgt  # noqa: E402


def hgt_graph(kind):
    g, et = rel_graph(kind, seed=7)
    nt = torch.randint(0, 3, (g.num_src_nodes(),), generator=torch.Generator().manual_seed(8))
    return g, et, nt


@pytest.mark.parametrize("kind", ["unsorted", "block"])
@pytest.mark.parametrize("in_size", [8, 12])
def test_hgt_every_plan_gives_dgl(kind, in_size):
    g, et, nt = hgt_graph(kind)
    torch.manual_seed(0)
    layer = HGTConv(in_size, 4, 2, 3, R, dropout=0.0, use_norm=in_size == 12)
    x = torch.randn(g.num_src_nodes(), in_size, requires_grad=True)
    params = [x] + list(layer.parameters())
    want = layer(g, x, nt, et)
    seed_grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    want_g = torch.autograd.grad(want, params, seed_grad, allow_unused=True)
    idx = hetero.relational_index(g, et, R)
    for plan in hetero_hgt.enumerate_plans():
        out = hetero_hgt.run(plan, idx, layer, g, x, nt, False)
        what = f"HGT {kind} {hetero_hgt.plan_name(plan)}"
        assert_close(out, want, what)
        got_g = torch.autograd.grad(out, params, seed_grad, allow_unused=True)
        for i, (a, b) in enumerate(zip(got_g, want_g)):
            if b is None:
                assert a is None or not a.abs().max() > 0, f"{what}: gradient {i}"
            else:
                assert_close(a, b, f"{what}: gradient {i}", RTOL_GRAD)


class HGTModel(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(n, 8)
        self.l1 = HGTConv(8, 4, 2, 3, R, dropout=0.2)
        self.l2 = HGTConv(8, 4, 1, 3, R, dropout=0.2, use_norm=True)
        self.nt = None

    def forward(self, g, et):
        return self.l2(g, self.l1(g, self.emb.weight, self.nt, et), self.nt, et)


def test_granii_hgt_training_and_eval():
    g, et, nt = hgt_graph("unsorted")
    model = HGTModel(g.num_nodes())
    model.nt = nt
    ref = copy.deepcopy(model)
    granii(model, g, et)
    side_by_side(model, ref, g, et, calls=10)
    side_by_side(model, ref, g, et, calls=2, train=False)
    text = granii.explain(model, file=open("/dev/null", "w"))
    assert text.count("<- chosen") + text.count("kept DGL's forward") == 2
    assert "pruned  att@edges" in text
