"""A layer's submodule from the user's code is read inline (``rules.inline_submodule``).

GIN's update function is an MLP whose first step is a linear map; read inline, the aggregation
re-associates with it, ``MLP(A' H) = lin2(relu(norm((A' H) W1)))`` with ``(A' H) W1 = A' (H W1)``,
so a plan aggregates at the hidden width instead of the input's. What cannot be read inline
stays one call of the submodule, as before.
"""
import copy

import dgl
import pytest
import torch
import torch.nn.functional as F
from dgl.nn import GINConv
from torch import nn

import granii
from granii.runtime.bind import prepare
from granii.runtime.dispatch import layer_states
from granii.runtime.state import new_state
from tests.plan_check import check_all_plans, grads
from tests.models import GINMLP


def _graph(n=60, e=300, seed=0):
    torch.manual_seed(seed)
    g = dgl.rand_graph(n, e)
    return g          # directed, with nodes of no in-edge


class DropMLP(nn.Module):
    """An MLP that branches on its own training flag and draws dropout."""

    def __init__(self, k_in, hidden):
        super().__init__()
        self.lin1 = nn.Linear(k_in, hidden, bias=False)
        self.lin2 = nn.Linear(hidden, hidden)
        self.p = 0.3

    def forward(self, x):
        h = self.lin1(x)
        if self.training:
            h = F.dropout(h, self.p, training=True)
        return self.lin2(F.relu(h))


class SortMLP(nn.Module):
    """A forward the frontend does not lower (a sort): it stays one call of the module."""

    def __init__(self, k_in, hidden):
        super().__init__()
        self.lin = nn.Linear(k_in, hidden)

    def forward(self, x):
        return self.lin(torch.sort(x, dim=1).values)


def _compiled(layer, g, x):
    call = prepare(new_state(layer), layer, (g, x), {})
    assert not isinstance(call, str), call
    return call.compiled


def test_gin_mlp_is_read_inline_and_a_plan_aggregates_at_the_hidden_width():
    g, x = _graph(), torch.randn(60, 40, requires_grad=True)
    layer = GINConv(GINMLP(40, 8, 8), "sum").eval()
    comp = _compiled(layer, g, x)
    root = str(comp.layer_ir.root)
    assert "apply_func.lin1.weight" in root and "BatchNorm1d" in root
    first = [p for p in comp.plans if p.composition().startswith("gemm")]
    assert first, [p.composition() for p in comp.plans]
    assert check_all_plans(layer, (g, x), {}, [x, layer.apply_func.lin1.weight,
                                                layer.apply_func.lin2.weight]) >= 2


def test_inline_mlp_in_training_updates_batch_norm_and_matches_dgl():
    g = _graph(seed=1)
    torch.manual_seed(3)
    ref = GINConv(GINMLP(24, 8, 8), "sum", learn_eps=True)
    layer = copy.deepcopy(ref)
    x = torch.randn(60, 24)
    granii.granii(layer, g, x)
    for i in range(8):
        xi = torch.randn(60, 24, requires_grad=True)
        xr = xi.detach().clone().requires_grad_()
        out, want = layer(g, xi), ref(g, xr)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        (ga,), (gb,) = grads(out, [xi]), grads(want, [xr])
        torch.testing.assert_close(ga, gb, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.apply_func.norm.running_mean,
                               ref.apply_func.norm.running_mean)
    st = layer_states(layer)[0]
    assert st.ran.kind in ("plan", "original")


def test_dropout_inside_the_submodule_draws_as_the_module_does_and_follows_its_flag():
    g = _graph(seed=2)
    torch.manual_seed(0)
    ref = GINConv(DropMLP(16, 8), "sum")
    layer = copy.deepcopy(ref)
    x = torch.randn(60, 16)
    granii.granii(layer, g, x)
    for i in range(6):
        if i == 3:                     # only the submodule changes mode: the plan follows it
            layer.apply_func.eval()
            ref.apply_func.eval()
        torch.manual_seed(10 + i)
        out = layer(g, x)
        torch.manual_seed(10 + i)
        want = ref(g, x)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert "dropout" not in str(_compiled(layer, g, x).layer_ir.root).lower()


def test_a_replaced_linear_is_seen():
    g, x = _graph(seed=3), torch.randn(60, 12)
    ref = GINConv(GINMLP(12, 6, 6), "sum").eval()
    layer = copy.deepcopy(ref)
    granii.granii(layer, g, x)
    for i in range(4):
        if i == 2:                     # a bias appears: the plan that had none must not run
            new = nn.Linear(12, 6, bias=True)
            layer.apply_func.lin1 = new
            ref.apply_func.lin1 = copy.deepcopy(new)
        with torch.no_grad():
            torch.testing.assert_close(layer(g, x), ref(g, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["unlowered", "hooked", "widening"])
def test_what_cannot_be_read_inline_stays_one_call_of_the_submodule(case):
    """A forward not lowered, a module with a hook, and an MLP whose first map widens the
    features (nothing that pays moves before the aggregation: GIN on small graphs' labels)."""
    g, x = _graph(seed=4), torch.randn(60, 10)
    mlp = {"unlowered": SortMLP(10, 6), "hooked": GINMLP(10, 6, 6),
           "widening": GINMLP(10, 16, 16)}[case]
    calls = []
    ref = GINConv(copy.deepcopy(mlp), "sum").eval()
    if case == "hooked":
        mlp.register_forward_hook(lambda m, a, o: calls.append(1))
    layer = GINConv(mlp, "sum").eval()
    root = str(_compiled(layer, g, x).layer_ir.root)
    assert "apply_func:" in root and "apply_func.lin" not in root, root
    granii.granii(layer, g, x)
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(layer(g, x), ref(g, x), atol=1e-5, rtol=1e-5)
    if case == "hooked":
        assert calls == [1]
