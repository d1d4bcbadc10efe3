"""``torch.compile`` of a model whose layers granii optimized: the compiler leaves the layers'
calls out of its graphs (``runtime.dispatch``), so they run granii's plans as they do without
it, and the code between them is compiled. Outputs and gradients are the framework's at every
training step and in evaluation, and each layer ran a plan; also with granii called on the
compiled module.

The ``aot_eager`` backend traces as the default one does (dynamo, then autograd ahead of time)
without generating C++, so the test needs no compiler. Before the change, tracing into granii's
dispatcher failed (``TorchRuntimeError`` on fake tensors) on both stacks.
"""
import copy

import pytest
import torch

from granii import granii
from granii.api import what_ran


def _steps(ours, ref, run_ours, run_ref, params):
    """Three training steps and an evaluation, compared with the reference at each."""
    for step in range(3):
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
        out, want = run_ours(), run_ref()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        proj = torch.linspace(-1, 1, want.numel()).reshape(want.shape)
        (out * proj).sum().backward()
        (want * proj).sum().backward()
        for (name, p), q in zip(ref.named_parameters(), params()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"step {step} {name}: {m}")
    ours.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(run_ours(), run_ref(), rtol=1e-4, atol=1e-5)


def _ran_plans(model):
    ran = what_ran(model)
    assert ran and all(r.kind == "plan" for r in ran.values()), ran


class PygNet(torch.nn.Module):
    """GCN, ReLU, then ``second`` (a PyG layer from 8 to 4 features)."""

    def __init__(self, second):
        super().__init__()
        from torch_geometric.nn import GCNConv
        self.c1, self.c2 = GCNConv(16, 8), second

    def forward(self, x, edge_index):
        return self.c2(torch.relu(self.c1(x, edge_index)), edge_index)


@pytest.mark.parametrize("order", ["granii, then compile", "compile, then granii"])
def test_compiled_pyg_model_runs_granii_plans(order):
    """In the second order ``granii(torch.compile(model), ...)`` optimizes the layers of the model
    the compiled module wraps, and returns the compiled module."""
    from torch_geometric.nn import SAGEConv
    torch.manual_seed(0)
    edge_index = torch.randint(0, 120, (2, 900))
    x = torch.randn(120, 16)
    ref = PygNet(SAGEConv(8, 4))
    ours = copy.deepcopy(ref)
    if order == "granii, then compile":
        granii(ours, x, edge_index)
        compiled = torch.compile(ours, backend="aot_eager")
    else:
        compiled = torch.compile(ours, backend="aot_eager")
        assert granii(compiled, x, edge_index) is compiled
    _steps(ours, ref, lambda: compiled(x, edge_index), lambda: ref(x, edge_index),
           ours.parameters)
    _ran_plans(ours)


@pytest.mark.dgl
def test_compiled_dgl_model_runs_granii_plans():
    import dgl
    from dgl.nn import GraphConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = GraphConv(16, 8), SAGEConv(8, 4, "mean")

        def forward(self, g, x):
            return self.c2(g, torch.relu(self.c1(g, x)))

    torch.manual_seed(0)
    g = dgl.add_self_loop(dgl.rand_graph(120, 900))
    x = torch.randn(120, 16)
    ref = Net()
    ours = copy.deepcopy(ref)
    granii(ours, g, x)
    compiled = torch.compile(ours, backend="aot_eager")
    _steps(ours, ref, lambda: compiled(g, x), lambda: ref(g, x), ours.parameters)
    _ran_plans(ours)
