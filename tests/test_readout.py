"""Readouts (DGL's ``SumPooling``/``AvgPooling``, ``dgl.sum_nodes``/``mean_nodes`` in user code)
run granii's plan on batches of graphs: outputs and gradients equal DGL's, graphs without nodes
included, every call; what granii cannot lower (max, weighted readouts) runs DGL's forward with
the reason."""
import copy

import dgl
import pytest
import torch
from dgl.nn import AvgPooling, MaxPooling, SumPooling
from torch import nn

from granii import granii
from granii.api import layer_states, what_ran
from granii.kernels import native

RTOL = 1e-5


def batch(seed, sizes=(5, 0, 7, 3, 9)):
    dgl.seed(seed)
    torch.manual_seed(seed)
    return dgl.batch([dgl.rand_graph(n, 2 * n) for n in sizes])


def close(a, b):
    return torch.allclose(a, b, rtol=RTOL, atol=RTOL * max(1.0, float(b.abs().max())))


class UserReadout(nn.Module):
    """A user layer: one sum aggregation, then the mean of each graph's nodes."""

    def __init__(self, k):
        super().__init__()
        self.lin = nn.Linear(k, k)

    def forward(self, bg, h):
        with bg.local_scope():
            bg.ndata["h"] = h
            bg.update_all(dgl.function.copy_u("h", "m"), dgl.function.sum("m", "s"))
            bg.ndata["z"] = self.lin(bg.ndata["s"])
            return dgl.mean_nodes(bg, "z")


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("make", [SumPooling, AvgPooling, lambda: UserReadout(6)],
                         ids=["sum", "avg", "user"])
def test_readout_plans_equal_dgl_on_new_batches(make, training):
    torch.manual_seed(0)
    ref = make()
    opt = copy.deepcopy(ref)
    g0 = batch(0)
    granii(opt, g0, torch.randn(g0.num_nodes(), 6))
    kinds = set()
    for step in range(12):
        g = batch(step + 1, sizes=(4 + step % 3, 0, 6, 2 + step % 5))
        x = torch.randn(g.num_nodes(), 6, requires_grad=training)
        outs = []
        for model in (ref, opt):
            model.train(training)
            y = model(g, x)
            gx = torch.autograd.grad(y.pow(2).sum(), x)[0] if training else None
            outs.append((y.detach(), gx))
        (y_ref, g_ref), (y_opt, g_opt) = outs
        assert y_opt.shape == (4, 6)
        assert close(y_opt, y_ref), step
        assert y_opt[1].abs().max() == 0             # the graph without nodes reads 0
        if training:
            assert close(g_opt, g_ref), step
        kinds.add(what_ran(opt)[layer_states(opt)[0].name].kind)
    assert "plan" in kinds          # the plan ran (the tie-break may keep DGL's forward after)
    assert "fallback" not in kinds


def test_readout_follows_new_batch_sizes_on_the_same_graph():
    """``set_batch_num_nodes`` changes the segments without changing the structure."""
    ref, opt = SumPooling(), SumPooling()
    g = batch(3, sizes=(4, 4, 4))
    x = torch.randn(12, 3)
    granii(opt, g, x)
    for _ in range(3):
        assert close(opt(g, x), ref(g, x))
    g.set_batch_num_nodes(torch.tensor([2, 10, 0]))
    for _ in range(3):
        y = opt(g, x)
        assert y.shape == (3, 3) and close(y, ref(g, x))


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_readout_kernel_gradient_is_the_transpose():
    """``readout_sum``'s native product and its backward against ``index_add_``."""
    from granii.graph import graph_info
    from granii.kernels.readout import readout_mean, readout_sum
    g = batch(5)
    gi = graph_info(g)
    x = torch.randn(g.num_nodes(), 4, dtype=torch.float64, requires_grad=True)
    seg = torch.repeat_interleave(torch.arange(5), g.batch_num_nodes())
    counts = g.batch_num_nodes().double().clamp(min=1).unsqueeze(1)
    for fn, scale in ((readout_sum, 1.0), (readout_mean, counts)):
        want = torch.zeros(5, 4, dtype=torch.float64).index_add(0, seg, x) / scale
        assert torch.allclose(fn(gi, x), want)
        assert torch.autograd.gradcheck(lambda t: fn(gi, t), (x,))


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_batch_segments_are_the_running_sums_and_the_graph_of_each_node():
    """``GraphInfo.segments`` by ``batch_segments``, graphs without nodes included, against
    ``cumsum`` and ``repeat_interleave``; counts that do not add up to the graph's nodes are the
    user's error, said as before; the readout's backward reads the graph of each node without
    the graph, which may be gone by then."""
    from granii.graph import graph_info
    from granii.kernels.readout import readout_sum
    g = batch(7, sizes=(0, 3, 0, 5, 2, 0))
    counts, offsets, offsets32, of = graph_info(g).segments()
    want = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    assert torch.equal(offsets, want) and torch.equal(offsets32, want.int())
    assert torch.equal(of, torch.repeat_interleave(torch.arange(6), counts))
    g.set_batch_num_nodes(torch.tensor([2, 2, 2, 2, 2, 2]))
    with pytest.raises(ValueError, match="add up to 12, the graph has 10 nodes"):
        graph_info(g).segments()
    g = batch(8)
    x = torch.randn(g.num_nodes(), 3, requires_grad=True)
    y = readout_sum(graph_info(g), x)
    del g
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("make, why", [
    (MaxPooling, "max_nodes"),
])
def test_readouts_granii_does_not_lower_run_dgls_forward(make, why):
    ref, opt = make(), make()
    g = batch(1)
    x = torch.randn(g.num_nodes(), 5)
    granii(opt, g, x)
    assert torch.equal(opt(g, x), ref(g, x))
    ran = what_ran(opt)[layer_states(opt)[0].name]
    assert ran.kind == "fallback" and why in ran.reason


def test_weighted_readout_runs_dgls_forward():
    class Weighted(nn.Module):
        def forward(self, g, h):
            with g.local_scope():
                g.ndata["h"] = h
                g.ndata["w"] = torch.ones(g.num_nodes(), 1) * 2
                return dgl.sum_nodes(g, "h", "w")
    ref, opt = Weighted(), Weighted()
    g = batch(2)
    x = torch.randn(g.num_nodes(), 5)
    granii(opt, g, x)
    assert close(opt(g, x), ref(g, x))
    ran = what_ran(opt)[layer_states(opt)[0].name]
    assert ran.kind == "fallback" and "weight" in ran.reason
