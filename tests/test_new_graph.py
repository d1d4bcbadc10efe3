"""A new graph object at every call (graph classification: a new ``dgl.batch`` each step).

A layer decides once per class of graphs (sizes and degree statistics within a factor) and
reuses that decision, tie-break included, for the later graphs of the class; a graph unlike the
class decides anew. Every call equals DGL's layer, outputs and gradients, training and eval.
"""
import copy
import gc
import sys
import tracemalloc
from pathlib import Path

import dgl
import pytest
import torch
from dgl.nn import GATConv, GINConv, GraphConv, SAGEConv, SGConv, TAGConv
from torch import nn

from granii import granii
from granii.runtime import decide, dispatch, fastpath, reuse, tiebreak
from granii.api import layer_states
from granii.graph import _INFOS, graph_info

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.graph_classification import GIN, DATASETS, collate, dataset  # noqa: E402

K = 8
LAYERS = {
    "gcn": (lambda: GraphConv(K, K, norm="both"), True),
    "sage": (lambda: SAGEConv(K, K, "mean"), False),
    "gin": (lambda: GINConv(nn.Linear(K, K), "sum"), False),
    "gat": (lambda: GATConv(K, 4, num_heads=2), True),
    "sgc": (lambda: SGConv(K, K, k=2), True),
    "tagcn": (lambda: TAGConv(K, K, k=2), False),
}


def new_graph(seed, n=300, e=2400, loops=False):
    dgl.seed(seed)
    g = dgl.rand_graph(n, e)
    return dgl.add_self_loop(g) if loops else g


def twin(g):
    """Another graph object with ``g``'s edges (in their order): nothing built for ``g`` is
    shared with it."""
    return dgl.graph(g.edges(order="eid"), num_nodes=g.num_nodes())


@pytest.fixture
def rankings(monkeypatch):
    """How many times a layer ranked its plans (``select.rank`` as the dispatcher calls it)."""
    count = [0]
    real = decide.rank

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(decide, "rank", counted)
    return count


def _call(layer, g, x, training):
    if training:
        x = x.detach().clone().requires_grad_()
        out = layer(g, x)
        out.sum().backward()
        return out.detach(), x.grad
    with torch.no_grad():
        return layer(g, x), None


def _close(a, b):
    scale = a.abs().max().clamp(min=1.0)
    return float((a - b).abs().max() / scale) < 1e-4


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_new_graph_each_call_reuses_one_decision(name, training, rankings):
    make, loops = LAYERS[name]
    torch.manual_seed(0)
    ref = make()
    opt = copy.deepcopy(ref)
    if not training:
        ref.eval()
        opt.eval()
    g0 = new_graph(0, loops=loops)
    with torch.set_grad_enabled(training):      # features as the calls' (a hidden layer's)
        granii(opt, g0, torch.randn(g0.num_nodes(), K, requires_grad=training))
    assert rankings[0] == 1
    calls = 14                  # the tie-break's turns, and calls after it
    for i in range(calls):
        g = new_graph(100 + i, loops=loops)
        x = torch.randn(g.num_nodes(), K)
        ref.zero_grad()
        opt.zero_grad()
        out_ref, dx_ref = _call(ref, g, x, training)
        out, dx = _call(opt, twin(g), x, training)
        assert _close(out_ref, out), (name, i)
        if training:
            assert _close(dx_ref, dx), (name, i)
            for (pn, p_ref), p in zip(ref.named_parameters(), opt.parameters()):
                assert _close(p_ref.grad, p.grad), (name, i, pn)
    st = layer_states(opt)[0]
    assert rankings[0] == 1, f"{name}: ranked {rankings[0]} times over {calls} new graphs"
    assert st.ranked == 1
    assert st.class_reused == calls
    assert st.fallback is None


def test_the_tie_break_runs_across_new_graphs_and_its_verdict_serves_the_class(rankings):
    torch.manual_seed(0)
    layer = GraphConv(K, K)
    granii(layer, new_graph(0, loops=True), torch.randn(300, K))
    st = layer_states(layer)[0]
    [records] = list(st.classes.values())
    [record] = records
    assert isinstance(record["decision"], tiebreak.Trial)
    for i in range(40):
        g = new_graph(10 + i, loops=True)
        layer(g, torch.randn(g.num_nodes(), K)).sum().backward()
    kept = record["decision"]
    assert not isinstance(kept, tiebreak.Trial), "the trial should be over after 40 graphs"
    assert st.tuned is not None and st.tuned[1] == kept[0]
    g = new_graph(99, loops=True)
    reused = st.class_reused
    layer(g, torch.randn(g.num_nodes(), K))
    # the class's kept decision ran on the new graph (by the class path: no binding)
    assert st.class_reused == reused + 1
    assert st.ran.label == kept[0]
    assert rankings[0] == 1


def test_a_graph_of_another_class_decides_anew(rankings):
    torch.manual_seed(0)
    layer = SAGEConv(K, K, "mean")
    with torch.no_grad():
        granii(layer.eval(), new_graph(0), torch.randn(300, K))
        assert rankings[0] == 1
        layer(new_graph(1, n=320, e=2500), torch.randn(320, K))      # within the class
        assert rankings[0] == 1
        big = new_graph(2, n=3000, e=24000)                           # ten times the sizes
        layer(big, torch.randn(3000, K))
        assert rankings[0] == 2
        # the same sizes, but every edge into a few nodes: other degree statistics
        src = torch.randint(0, 300, (2400,))
        dst = torch.randint(0, 5, (2400,))
        skewed = dgl.graph((src, dst), num_nodes=300)
        x = torch.randn(300, K)
        assert _close(type(layer).forward(layer, skewed, x), layer(skewed, x))
        assert rankings[0] == 3
        layer(new_graph(3), torch.randn(300, K))                      # the first class again
        layer(new_graph(4, n=2900, e=23000), torch.randn(2900, K))    # the second again
        assert rankings[0] == 3
    st = layer_states(layer)[0]
    assert st.ranked == 3 and st.class_reused == 3


def test_zero_in_degree_check_on_a_new_graph_raises_as_dgl():
    torch.manual_seed(0)
    layer = GraphConv(K, K)
    granii(layer, new_graph(0, loops=True), torch.randn(300, K))
    u, v = new_graph(5).edges()
    keep = v >= 10                                 # nodes 0-9 lose their in-edges
    g = dgl.graph((u[keep], v[keep]), num_nodes=300)
    assert (g.in_degrees() == 0).any()
    with pytest.raises(dgl.DGLError, match="0-in-degree"):
        layer(g, torch.randn(300, K))


def _settled(layer, training, calls=120):
    """``layer`` optimized on new graphs until the tie-breaks of its classes are over."""
    with torch.set_grad_enabled(training):
        granii(layer, new_graph(0, loops=True), torch.randn(300, K))
    st = layer_states(layer)[0]
    for i in range(calls):
        g = new_graph(100 + i, loops=True)
        with torch.set_grad_enabled(training):
            x = torch.randn(g.num_nodes(), K, requires_grad=training)
            y = layer(g, x)
            if training:
                y.sum().backward()
        # the classes of this mode (training: gradients to the features too, new each call)
        records = [r for key, rs in st.classes.items()
                   if key[-5:-2] == (training, training, False) for r in rs]
        if i >= 10 and not any(isinstance(r["decision"], tiebreak.Trial) for r in records):
            return i
    raise AssertionError("the tie-breaks did not end")


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("name", ["gcn", "sage", "gin"])
def test_new_graphs_of_a_settled_class_skip_binding(name, training, monkeypatch):
    """Once a class's tie-break is over, a call on a new graph of it runs the kept decision
    without binding the call the normal way (the class path), with DGL's outputs and
    gradients; the graph's own checks still run on it (a zero in-degree node raises)."""
    make, loops = LAYERS[name]
    torch.manual_seed(0)
    ref = make()
    layer = copy.deepcopy(ref)
    last = _settled(layer, training)
    st = layer_states(layer)[0]
    with torch.set_grad_enabled(training):      # the kept decision's first run the normal way
        g = twin(new_graph(100 + last - 6, loops=True))   # leaves its class run behind
        layer(g, torch.randn(g.num_nodes(), K, requires_grad=training))
    bound = []
    real = dispatch.prepare
    monkeypatch.setattr(dispatch, "prepare", lambda *a, **k: bound.append(1) or real(*a, **k))
    for i in range(6):
        g = twin(new_graph(100 + last - i, loops=True))    # a new object of a settled class
        x = torch.randn(g.num_nodes(), K, requires_grad=training)
        outs = []
        for m in (ref, layer):
            with torch.set_grad_enabled(training):
                y = m(g, x)
                gx = torch.autograd.grad(y.square().sum(), x)[0] if training else None
            outs.append((y.detach(), gx))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
        if training:
            torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-5)
    assert bound == [], "calls on new graphs of a settled class took the normal path"
    assert st.ran.kind in ("plan", "original")
    if name == "gcn":                 # GraphConv's zero in-degree check, on a graph of the class
        u, v = new_graph(7, loops=True).edges()
        keep = (v >= 3) | (u != v)
        keep &= v != 1                              # node 1 loses every in-edge
        g = dgl.graph((u[keep], v[keep]), num_nodes=300)
        with pytest.raises(dgl.DGLError, match="0-in-degree"), torch.no_grad():
            ref(g, torch.randn(300, K))
        with pytest.raises(dgl.DGLError, match="0-in-degree"), \
                torch.set_grad_enabled(training):
            layer(g, torch.randn(300, K))


def test_a_graph_called_often_gets_its_own_fast_path():
    """The class path serves a graph's first calls; a graph called again and again gets a fast
    path of its own (cheaper: its checks ran once)."""
    torch.manual_seed(0)
    layer = GraphConv(K, K)
    _settled(layer, False)
    st = layer_states(layer)[0]
    g = new_graph(900, loops=True)
    x = torch.randn(300, K)
    with torch.no_grad():
        for _ in range(fastpath._FAST_AFTER + 2):
            layer(g, x.clone())
    table = st.fast[graph_info(g)]
    assert any(k is not fastpath._SEEN for k in table)


def test_a_layer_called_several_times_on_a_new_graph_places_it_once_per_guard(monkeypatch):
    """A readout after every layer calls one layer several times on each new batch: the class
    of the graph is looked up on the first call with each call guard, the later calls with that
    guard reuse it (``state.class_last``); each call is still DGL's result, and a new graph, or
    features of another width, looks up its class again."""
    from dgl.nn import SumPooling
    torch.manual_seed(0)
    ref, layer = SumPooling(), SumPooling()
    granii(layer, dgl.batch([new_graph(0, n=20, e=60)] * 8), torch.randn(160, K))
    st = layer_states(layer)[0]
    for i in range(40):                          # the tie-breaks' turns end on these graphs
        g = dgl.batch([new_graph(i, n=20, e=60)] * 8)
        for width in (K, 3):
            layer(g, torch.randn(g.num_nodes(), width))
        records = [r for rs in st.classes.values() for r in rs]
        if i >= 4 and len(records) == 2 and not any(
                isinstance(r["decision"], tiebreak.Trial) for r in records):
            break
    g = dgl.batch([new_graph(49, n=20, e=60)] * 8)   # the kept decisions' first runs, the normal
    for width in (K, 3):                              # way, leave their class runs behind
        layer(g, torch.randn(g.num_nodes(), width))
    placed = []
    real = reuse._class_of
    monkeypatch.setattr(reuse, "_class_of", lambda *a: placed.append(1) or real(*a))
    for i in range(4):
        g = dgl.batch([new_graph(50 + i, n=20, e=60)] * 8)
        before = st.class_reused
        for width in (K, K, K, 3, 3):
            x = torch.randn(g.num_nodes(), width)
            torch.testing.assert_close(layer(g, x), ref(g, x))
        assert st.class_reused - before == 5, "every call should take the class path"
    assert len(placed) == 4 * 2, placed


@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
def test_index_counted_from_the_edge_list_is_dgls(idtype):
    g = dgl.rand_graph(200, 1500, idtype=idtype)
    indptr, src, eids = graph_info(g).csc()            # counted, in the kernels' int32
    assert "csc" not in g.formats()["created"]
    d_indptr, d_src, d_eids = g.adj_tensors("csc")
    assert indptr.dtype == torch.int32 and torch.equal(indptr.to(idtype), d_indptr)

    def entries(ip, s, e):
        rows = torch.repeat_interleave(torch.arange(200), (ip[1:] - ip[:-1]).long())
        return sorted(zip(rows.tolist(), s.tolist(), e.tolist()))
    assert entries(indptr, src, eids) == entries(d_indptr, d_src, d_eids)
    g2 = dgl.rand_graph(200, 1500, idtype=idtype)
    info = graph_info(g2)
    counted = info.in_degrees(), info.out_degrees()
    assert "csc" not in g2.formats()["created"]     # counted without DGL's index
    assert torch.equal(counted[0], g2.in_degrees().float())
    assert torch.equal(counted[1], g2.out_degrees().float())


@pytest.mark.parametrize("name", ["mutag", "proteins"])
def test_gin_example_model_on_batched_graphs(name, rankings):
    """DGL's GIN example model, a new ``dgl.batch`` each step: training steps (Adam) and
    evaluation equal DGL's, loss and gradients, with one ranking per layer and graph class."""
    stats = DATASETS[name]
    torch.manual_seed(0)
    ref = GIN(stats["labels"], 16, stats["classes"])
    opt = copy.deepcopy(ref)
    g0, f0, _ = collate_again(name, 0)
    granii(opt, g0, f0)
    optim = torch.optim.Adam(ref.parameters(), lr=0.01)
    loss_fcn = nn.CrossEntropyLoss()
    for step in range(8):
        losses = []
        for model in (ref, opt):
            g, feat, labels = collate_again(name, step)
            model.train()
            model.zero_grad()
            torch.manual_seed(step)                 # the same dropout masks
            loss = loss_fcn(model(g, feat), labels)
            loss.backward()
            losses.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        optim.step()
        # each step compared from the same weights (float differences would grow over steps)
        opt.load_state_dict(ref.state_dict())
        (l_ref, g_ref), (l_opt, g_opt) = losses
        assert _close(l_ref, l_opt), step
        for a, b in zip(g_ref, g_opt):
            assert _close(a, b), step
    for step in range(3):
        outs = []
        for model in (ref, opt):
            g, feat, _ = collate_again(name, step)
            model.eval()
            outs.append(model(g, feat).detach())
        assert _close(*outs)
    layers = len(layer_states(opt))
    # training steps: the first batches' class (and perhaps a second, the batches' sizes
    # scatter); evaluation: its own mode
    assert rankings[0] <= 3 * layers, rankings[0]
    assert sum(s.class_reused for s in layer_states(opt)) >= layers * 8


_COLLATED = {}


def collate_again(name, step):
    """Batch ``step`` of ``_batches(name, 8, 24)`` as a new graph object (a loader collates
    anew each time)."""
    if name not in _COLLATED:
        _COLLATED[name] = dataset(name, 0)[:8 * 24]
    return collate(_COLLATED[name][step * 24:(step + 1) * 24])


def test_memory_stays_flat_over_many_new_graphs():
    """Once-per-graph caches die with their graphs, and what a layer keeps per decision does
    not grow with the number of graphs seen."""
    torch.manual_seed(0)
    layer = GraphConv(K, K)
    granii(layer, new_graph(0, n=40, e=160, loops=True), torch.randn(40, K))
    st = layer_states(layer)[0]

    def run(lo, hi):
        for i in range(lo, hi):
            n = 30 + i % 23                          # sizes as a loader's batches scatter
            g = new_graph(i, n=n, e=4 * n + i % 37, loops=True)
            layer(g, torch.randn(n, K)).sum().backward()
    run(1, 300)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    run(300, 1300)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 256 * 1024, f"{grown} bytes more after 1000 new graphs"
    assert len(_INFOS) < 20
    assert len(st.decisions) < 20 and len(st.fast) < 20
    assert len(st.verified) <= reuse._VERIFIED_KEPT
    assert st.ranked <= 3


def test_a_readout_turn_is_timed_with_the_batchs_segments_made(monkeypatch):
    """The readout of the model's input is the first readout on each new batch: the batch's
    segments, which every later readout on it reads, are made before its measured turns start
    the clock, in the plans' turns and in DGL's, so the turns compare the readouts alone (the
    plan's turns paid for them, and DGL's readout won the trial)."""
    from dgl.nn import SumPooling
    layer = SumPooling()
    granii(layer, dgl.batch([new_graph(0, n=20, e=60)] * 8), torch.randn(160, K))
    seen, in_turn = [], [False]
    real_run, real_turn = dispatch._run, dispatch._trial_call

    def run(state, dkey, label, fn, order, call, *rest):
        if in_turn[0]:
            seen.append((label, "segments" in call.gi.cache))
        return real_run(state, dkey, label, fn, order, call, *rest)

    def turn(*args):
        in_turn[0] = True
        try:
            return real_turn(*args)
        finally:
            in_turn[0] = False
    monkeypatch.setattr(dispatch, "_run", run)
    monkeypatch.setattr(dispatch, "_trial_call", turn)
    for i in range(12):
        g = dgl.batch([new_graph(i + 1, n=20, e=60)] * 8)
        x = torch.randn(g.num_nodes(), K)
        torch.testing.assert_close(layer(g, x), SumPooling()(g, x))
    labels = {label for label, _ in seen}
    assert "original forward" in labels and len(labels) >= 2, seen     # turns were measured
    assert all(made for _, made in seen), seen


def test_the_graph_classification_bench_runs_both_models_on_the_same_batches():
    """``bench.graph_classification``'s run of one data set: both copies trained and evaluated,
    epoch by epoch in turns, on the same batches (their first epoch's losses agree up to float
    re-association), granii's copy on its plans, and the steady steps of each model timed."""
    from bench.graph_classification import run_one
    row = run_one("mutag", 2, steady_count=20)
    assert row["train_steps"] == 4 and row["eval_batches"] == 6
    assert float(row["first_epoch_loss_rel_diff"]) < 1e-4
    assert row["class_reused"] > 0 and row["rankings"] > 0
    assert all(row[k] > 0 for k in ("steady_dgl_ms", "steady_granii_ms", "steady_skeleton_ms"))
