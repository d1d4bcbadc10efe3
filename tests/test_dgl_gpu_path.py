"""DGL models on the GPU path: a DGL graph whose features take the GPU's kernels gets the plans
of the framework-neutral core, with GPU implementations only (torch's kernels and torch's CSR
product here; granii's Triton kernels where a current Triton is installed, which the DGL stack's
torch 2.1 does not ship), and DGL's outputs and gradients.

No DGL build with CUDA installs from PyPI, so the path runs here on CPU tensors
(``granii.device.GPU_PATH_ON_CPU``): the same choices and kernels as on a GPU, checked against
DGL's own layers on a directed graph with duplicate edges and nodes without in-edges, in training
(input and parameter gradients) and in evaluation, over several calls."""
import copy

import pytest
import torch

dgl = pytest.importorskip("dgl")
dglnn = pytest.importorskip("dgl.nn")

GPU_IMPLS = {"torch", "torch_csr", "triton", "inline"}


@pytest.fixture
def gpu_path_on_cpu():
    from granii import device
    device.GPU_PATH_ON_CPU[0] = True
    yield
    device.GPU_PATH_ON_CPU[0] = False


def _graph(n=24, e=90, zero_in=4, seed=3):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n - zero_in, (e,), generator=gen)
    return dgl.graph((src, dst), num_nodes=n)


LAYERS = {
    "graphconv": lambda: dglnn.GraphConv(8, 6, norm="both", allow_zero_in_degree=True),
    "graphconv-right": lambda: dglnn.GraphConv(8, 6, norm="right", allow_zero_in_degree=True),
    "sage-mean": lambda: dglnn.SAGEConv(8, 6, "mean"),
    "gat": lambda: dglnn.GATConv(8, 3, num_heads=2, allow_zero_in_degree=True),
    "gin": lambda: dglnn.GINConv(torch.nn.Linear(8, 6), "sum"),
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_dgl_layer_on_the_gpu_path_gives_dgls_results(gpu_path_on_cpu, name, training):
    from granii import granii
    from granii.runtime.dispatch import layer_states
    g, x = _graph(), torch.randn(24, 8)
    torch.manual_seed(1)
    layer = LAYERS[name]()
    ref = copy.deepcopy(layer)
    layer.train(training)
    ref.train(training)
    granii(layer, g, x, tune=False)
    for _ in range(3):
        xa, xb = (x.clone().requires_grad_(training) for _ in range(2))
        with torch.set_grad_enabled(training):
            a, b = layer(g, xa), ref(g, xb)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        if training:
            dy = torch.randn_like(a)
            a.backward(dy)
            b.backward(dy)
            torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-4)
            for p, q in zip(layer.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    st = layer_states(layer)[0]
    assert st.ran.kind == "plan", st.ran
    impls = {i for c in st.chosen.values() for i in c["impls"]}
    assert impls <= GPU_IMPLS and impls - {"inline"}, impls
    assert "gpu" in st.last[-1], st.last[-1]        # priced by the GPU's cost model
