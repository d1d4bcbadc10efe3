"""Selection's pricing of plan steps the generated code may skip."""
import pytest
import torch

dgl = pytest.importorskip("dgl")


def test_a_row_scaling_by_a_scalar_of_one_is_priced_free():
    """GIN's ``(1 + eps) X`` is skipped at run time when ``eps`` is 0 (``plan.is_one``): ranking
    with the layer prices that scaling at nothing, and at its model's cost when ``eps`` is not
    0."""
    from dgl.nn import GINConv

    from granii.learned import default_cost_model
    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    from granii.select import rank
    torch.manual_seed(0)
    g = dgl.graph((torch.randint(0, 300, (2400,)), torch.randint(0, 300, (2400,))),
                  num_nodes=300)
    x = torch.randn(300, 16)
    model = default_cost_model()
    costs = {}
    for eps in (0.0, 0.5):
        layer = GINConv(torch.nn.Linear(16, 8), "sum", init_eps=eps).eval()
        with torch.no_grad():
            call = prepare(new_state(layer), layer, (g, x), {})
        scaled = [p for p in call.compiled.plans
                  if any(s.prim == "row_scale" and p.leaves.get(s.args[0]) is not None
                         and p.leaves[s.args[0]].source[0] == "scalar" for s in p.steps)]
        assert scaled
        ranking = rank(scaled, call.gi, call.symbols, model, module=layer)
        costs[eps] = [t for c in ranking for s, _, t in c.step_costs
                      if s.prim == "row_scale" and c.plan.leaves.get(s.args[0]) is not None
                      and c.plan.leaves[s.args[0]].source[0] == "scalar"]
    assert costs[0.0] and all(t == 0.0 for t in costs[0.0])
    assert costs[0.5] and all(t > 0.0 for t in costs[0.5])
