"""GEMM with a mostly-zero left operand (``gemm/native``, ``granii/kernels/sparse_rows.py``).

The kernel against a float64 dense product (empty rows, a dense row, widths that are not a
multiple of the vector block, -0.0 and NaN, a bias row or a full addend, float32 and float64, one
and two threads), its gradients by ``gradcheck``; the per-call decision; and models trained on
bag-of-words features (Cora's, shipped) side by side with DGL, where granii picks the kernel.
"""
import copy

import pytest
import torch

from granii import explain, granii
from granii.costmodel import PRICED_AS
from granii.datasets import load_planetoid
from granii.runtime.dispatch import layer_states
from granii.kernels import get, implementations, sparse_rows
from granii.plan import GRAPH
import models
from models import CASES_BY_NAME
import test_real_models
from test_real_models import eval_side_by_side, train_side_by_side

pytestmark = pytest.mark.skipif(not sparse_rows.AVAILABLE, reason="native kernels not built")


def sparse_matrix(n, k, density, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen, dtype=dtype)
    return x * (torch.rand(n, k, generator=gen) < density).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [5, 16, 37, 200])
def test_kernel_matches_the_dense_product(dtype, threads, k):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = sparse_matrix(300, k, 0.05, dtype)
        x[3] = 0.0                                   # an empty row
        x[7] = torch.randn(k, dtype=dtype)           # a dense row
        x[11, 0] = -0.0
        w = torch.randn(k, 9, dtype=dtype)
        ref = x.double() @ w.double()
        for c in (None, torch.randn(9, dtype=dtype), torch.randn(300, 9, dtype=dtype)):
            y, indptr, indices, values = torch.ops.granii.sparse_rows_mm(x, w, c)
            want = ref if c is None else ref + c.double()
            assert y.dtype == dtype
            assert torch.allclose(y.double(), want, atol=1e-4, rtol=1e-4)
        nz = x != 0
        assert indptr[-1].item() == int(nz.sum())
        assert torch.equal(indptr.diff(), nz.sum(1))
        assert torch.equal(indices, nz.nonzero()[:, 1])
        assert torch.equal(values, x[nz])
        g = torch.randn(300, 9, dtype=dtype)
        dw = torch.ops.granii.sparse_rows_mm_wgrad(indptr, indices, values, g, k)
        assert torch.allclose(dw.double(), x.double().t() @ g.double(), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_nan_is_kept_and_zero_rows_give_the_addend():
    x = sparse_matrix(40, 33, 0.1)
    x[5, 20] = float("nan")
    x[6] = 0.0
    w, c = torch.randn(33, 4), torch.randn(4)
    y = torch.ops.granii.sparse_rows_mm(x, w, c)[0]
    assert torch.isnan(y[5]).all() and not torch.isnan(y[torch.arange(40) != 5]).any()
    assert torch.equal(y[6], c)


def test_weight_gradient_is_the_same_whatever_the_thread_count():
    x, g = sparse_matrix(2000, 300, 0.02), torch.randn(2000, 16)
    _, indptr, indices, values = torch.ops.granii.sparse_rows_mm(x, torch.randn(300, 16), None)
    before, out = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out.append(torch.ops.granii.sparse_rows_mm_wgrad(indptr, indices, values, g, 300))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("addend", [None, "row", "full"])
def test_gradcheck(addend):
    x = sparse_matrix(12, 20, 0.2, torch.float64).requires_grad_()
    w = torch.randn(20, 3, dtype=torch.float64, requires_grad=True)
    c = {None: None, "row": torch.randn(3, dtype=torch.float64, requires_grad=True),
         "full": torch.randn(12, 3, dtype=torch.float64, requires_grad=True)}[addend]
    torch.autograd.gradcheck(lambda *a: sparse_rows._SparseRowsMM.apply(*a), (x, w, c))


def test_the_decision_is_made_on_the_values_at_each_call():
    assert "native" in implementations("gemm") and ("gemm", "native") in PRICED_AS
    gemm = get("gemm", "native")
    w = torch.randn(512, 32, requires_grad=True)
    sparse, dense = sparse_matrix(400, 512, 0.01), torch.randn(400, 512)
    assert sparse_rows.mostly_zero(sparse) and not sparse_rows.mostly_zero(dense)
    assert not sparse_rows.mostly_zero(sparse[:, :64].contiguous())   # too small to pay the call
    assert not sparse_rows.mostly_zero(sparse[:, :300])                 # not contiguous
    for x in (sparse, dense, sparse.double().float()):
        y = gemm(x, w)
        assert torch.allclose(y, x @ w, atol=1e-4)
        (g_w,) = torch.autograd.grad(y.sum(), w)
        assert torch.allclose(g_w, x.t() @ torch.ones(400, 32), atol=1e-3)
    assert sparse_rows.time_ratio(0.01) < 1.0 == sparse_rows.time_ratio(None)
    assert sparse_rows.time_ratio(0.5) == 1.0


def test_input_needing_a_gradient_gets_the_dense_gradient():
    x = sparse_matrix(400, 512, 0.01).requires_grad_()
    w = torch.randn(512, 32)
    y = get("gemm", "native")(x, w)
    (g_x,) = torch.autograd.grad((y * y).sum(), x)
    assert torch.allclose(g_x, 2 * (x @ w).detach() @ w.t(), atol=1e-3)


# -- models on bag-of-words features ----------------------------------------------------------------
@pytest.fixture(scope="module")
def cora():
    g, x, *_ = load_planetoid("cora")
    return g, x


def chosen_steps(model):
    """``{(primitive, implementation)}`` of the steps of every layer's chosen plan."""
    return {(step.prim, impl) for st in layer_states(model) if st.last is not None
            for step, impl in zip(st.last[2].plan.steps, st.last[2].impls)}


@pytest.mark.parametrize("name", ["gcn", "gat", "graphsage", "gin", "sgc", "tagcn"])
def test_models_on_cora_features_match_dgl(cora, name, monkeypatch):
    """Cora has 1433 feature columns and 13k edges: some float32 gradients are sums that cancel
    (GAT's attn_r of the output layer is about 1e-6 with terms near 1e-2: a destination's term
    shifts all its scores alike) or run over every node (GIN's eps, about 2.6e4). Their rounding
    error is as large with torch's dense GEMM in the plan, so the tolerance is wider here."""
    monkeypatch.setattr(test_real_models, "ATOL", 1e-5)
    monkeypatch.setattr(test_real_models, "RTOL_GRAD", 2e-3)
    g, x = cora
    case = CASES_BY_NAME[name]
    torch.manual_seed(0)
    model = case.build(g, x.shape[1], False)
    ref = copy.deepcopy(model)
    granii(model, g, x)
    run = lambda m, w: case.run(m, g, x, w)          # noqa: E731
    train_side_by_side(run, model, ref, what=f"{name} on Cora's features:")
    eval_side_by_side(run, model, ref, what=f"{name} on Cora's features:")
    if name in ("gcn", "gat", "graphsage"):           # their first GEMM reads the features
        assert ("gemm", "native") in chosen_steps(model), explain(model)
        assert "density:" in explain(model)


def test_density_steers_the_composition(cora):
    """GCN's first layer on Cora (1433 -> 16): with dense features the aggregation goes first (a
    narrower GEMM after it is not cheaper, the aggregated features are cached), with Cora's
    bag-of-words the product with the weight goes first and reads the nonzeros only."""
    from pathlib import Path
    from granii import learned
    # one fixed set of shipped learned models, whatever machine runs the test: a decision
    # priced by this machine's own models could go either way where the two orders are close
    shipped = learned.load(Path(__file__).resolve().parent.parent / "costmodels" / "6122855f1f51",
                           check=False)
    g, x = cora
    firsts = {}
    for what, feats in (("bag of words", x), ("dense", torch.randn_like(x))):
        torch.manual_seed(0)
        model = models.GCN(x.shape[1], 16, 7)
        granii(model, g, feats, cost_model=shipped)
        model.train()
        model(g, feats).sum().backward()
        state = layer_states(model)[0]
        chosen = state.last[2]
        # the first step on the features (steps on the graph alone, e.g. D A D, run once before)
        firsts[what] = next((step.prim, impl) for step, impl in zip(chosen.plan.steps, chosen.impls)
                            if step.when != GRAPH)
    assert firsts["bag of words"] == ("gemm", "native")
    assert firsts["dense"] != ("gemm", "native")


@pytest.mark.parametrize("name", ["sage", "gat"])
def test_sampled_blocks_of_cora_match_dgl(cora, name):
    """Mini-batch training as DGL's sampling examples write it, on Cora's bag-of-words features:
    each batch's blocks are new, the first layer's input rows are sparse. Outputs and gradients
    of every batch equal DGL's model, and the first layer reads the nonzeros."""
    import dgl
    import torch.nn.functional as F
    from bench.examples import SAGE, BlockGAT

    g, x = cora
    torch.manual_seed(0)
    ref = SAGE(x.shape[1], 32, 7, n_layers=2) if name == "sage" else BlockGAT(x.shape[1], 8, 7,
                                                                               heads=4)
    model = copy.deepcopy(ref)
    sampler = dgl.dataloading.NeighborSampler([5, 5])
    loader = dgl.dataloading.DataLoader(g, torch.arange(0, g.num_nodes(), 7), sampler,
                                        batch_size=128, shuffle=False)
    for i, (inp, _, blocks) in enumerate(loader):
        if i == 3:
            break
        h = x[inp]
        if i == 0:
            granii(model, blocks, h)
        outs = []
        for m in (ref, model):
            m.train()
            m.zero_grad(set_to_none=True)
            torch.manual_seed(10 + i)
            out = m(blocks, h)
            F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long)).backward()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=2e-3, msg=n)
    assert ("gemm", "native") in chosen_steps(model), explain(model)


def test_density_is_read_through_dropout(cora):
    """GATConv applies its feat_drop before the product: the product's operand is the dropout's
    output, whose zeros include the features' zeros, so it is priced with their density."""
    from granii.select import _density
    g, x = cora
    model = models.GAT(x.shape[1], 8, 7)
    granii(model, g, x)
    model.train()
    model(g, x).sum().backward()
    symbols, ranking = layer_states(model)[0].last[:2]
    plan = ranking[0].plan
    gemm = next(st for st in plan.steps if st.prim == "gemm")
    assert gemm.args[0] not in plan.leaves                      # the dropout's output
    assert _density(plan, symbols, gemm.args[0]) == symbols["density:feat"] < sparse_rows.LIMIT
    cheaper = next(c for c in ranking if c.plan is plan).step_costs
    assert any(st.prim == "gemm" and impl == "native" for st, impl, _ in cheaper)

