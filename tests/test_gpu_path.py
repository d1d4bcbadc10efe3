"""granii's GPU path through the one entry point: ``granii(model, x, edge_index)`` on PyG models
whose tensors take the GPU's kernels (``granii/device.py``): the Triton kernels, cuSPARSE through
torch, torch's own CUDA kernels; never the C++ kernels or DGL's.

Each check compares with PyG's own layers on the same parameters, over several calls (the
measured tie-break's turns and the settled plan), in training (outputs and the gradients of every
parameter) and in evaluation, on a directed graph with nodes without in-edges and duplicate
edges, with and without edge weights; and it asserts what ran: every layer a plan (no fallback)
whose steps are GPU implementations, with the Triton kernels among them.

Without a GPU the path runs on CPU tensors (``granii.device.GPU_PATH_ON_CPU``) with the Triton
kernels under Triton's interpreter, which must be on before they are defined: the checks run in a
child process (this file as a script, ``--worker cpu``). ``scripts/gpu_check.sh`` runs the same
worker with ``cuda`` on a GPU. Skipped where Triton is missing or older than 3.0 (the DGL stack).
"""
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GPU_IMPLS = {"torch", "torch_csr", "triton", "inline"}


def graph(dev, n=24, e=90, zero_in=4, seed=3):
    """Directed edges, duplicates allowed, the last ``zero_in`` nodes without in-edges."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n - zero_in, (e,), generator=gen)
    w = torch.rand(e, generator=gen) + 0.5
    return torch.stack([src, dst]).to(dev), w.to(dev), n


def models():
    from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            if kind == "gcn":
                self.c1, self.c2 = GCNConv(12, 16), GCNConv(16, 5)
            elif kind == "sage":
                self.c1, self.c2 = SAGEConv(12, 16), SAGEConv(16, 5)
            elif kind == "gat":
                self.c1, self.c2 = GATConv(12, 4, heads=4), GATConv(16, 5, heads=1)
            else:
                self.c1 = GINConv(torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU()))
                self.c2 = GINConv(torch.nn.Linear(16, 5), train_eps=True)

        def forward(self, x, edge_index, w=None):
            if self.kind == "gcn" and w is not None:
                return self.c2(torch.relu(self.c1(x, edge_index, w)), edge_index, w)
            return self.c2(torch.relu(self.c1(x, edge_index)), edge_index)
    return {"gcn": lambda: Net("gcn"), "gcn_weighted": lambda: Net("gcn"),
            "sage": lambda: Net("sage"), "gat": lambda: Net("gat"), "gin": lambda: Net("gin")}


def check_model(name, dev):
    """PyG's outputs and gradients through granii on ``dev``; the layers ran GPU plans."""
    import copy

    from granii import granii
    from granii.runtime.dispatch import layer_states
    torch.manual_seed(0)
    edge_index, w, n = graph(dev)
    x = torch.randn(n, 12, device=dev)
    model = models()[name]().to(dev)
    args = (x, edge_index, w) if name == "gcn_weighted" else (x, edge_index)
    ours = copy.deepcopy(model)
    granii(ours, *args[:2], extra_args=args[2:])
    for step in range(8):                       # the tie-break's turns, then the settled plan
        for m in (model, ours):
            m.zero_grad(set_to_none=True)
            out = m(*args)
            (out * torch.linspace(-1, 1, out.numel(), device=dev).reshape(out.shape)).sum() \
                .backward()
        want, got = model(*args), ours(*args)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for (pn, p), q in zip(model.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, pn=pn: f"{name} step {step} {pn}: {m}")
    model.eval()
    ours.eval()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ours(*args), model(*args), rtol=1e-4, atol=1e-5)
    states = layer_states(ours)
    assert states, "granii optimized no layer"
    ran = []
    for st in states:
        assert st.ran.kind != "fallback", f"{name} {st.name} fell back: {st.ran}"
        assert st.chosen, f"{name} {st.name}: nothing chosen"
        for choice in st.chosen.values():
            impls = set(choice.get("impls") or ())
            assert impls <= GPU_IMPLS, f"{name} {st.name}: CPU kernels on the GPU: {impls}"
            ran.append(sorted(impls))
    assert any("triton" in r or "torch_csr" in r for r in ran), ran
    return ran


def check_explain_and_fallback(dev):
    """``explain`` names the GPU's cost model; a float64 input on the GPU runs PyG's own forward
    and says why."""
    from torch_geometric.nn import GCNConv

    from granii import granii
    from granii.runtime.dispatch import layer_states
    edge_index, _, n = graph(dev)
    conv = GCNConv(12, 5).to(dev)
    x = torch.randn(n, 12, device=dev)
    granii(conv, x, edge_index)
    conv(x, edge_index)
    text = granii.explain(conv)
    # the model fitted on this GPU where one is shipped (costmodels/gpu), else the analytical one
    assert "fitted-gpu (" in text or "analytical-gpu (" in text, text
    conv64 = GCNConv(12, 5).to(dev).double()
    granii(conv64, x.double(), edge_index)
    want = torch.nn.Module.__call__(conv64, x.double(), edge_index)
    st = layer_states(conv64)[0]
    assert st.ran.kind == "fallback" and "float64" in st.ran.reason, st.ran
    granii.restore(conv64)
    torch.testing.assert_close(conv64(x.double(), edge_index), want)


def layers():
    from torch_geometric import nn
    return {"SGConv": lambda: nn.SGConv(12, 5, K=2), "GraphConv": lambda: nn.GraphConv(12, 5),
            "TAGConv": lambda: nn.TAGConv(12, 5, K=2), "APPNP": lambda: nn.APPNP(K=3, alpha=0.1)}


def check_layer(name, dev):
    """One PyG layer through granii on ``dev`` (training, features needing a gradient): PyG's
    output and gradients at every call; each decision a GPU plan or PyG's own forward."""
    import copy

    from granii import granii
    from granii.runtime.dispatch import layer_states
    torch.manual_seed(1)
    edge_index, _, n = graph(dev)
    conv = layers()[name]().to(dev)
    ours = copy.deepcopy(conv)
    x = torch.randn(n, 12, device=dev, requires_grad=True)
    granii(ours, x, edge_index)
    for step in range(6):
        grads = []
        for m in (conv, ours):
            x.grad = None
            m.zero_grad(set_to_none=True)
            out = m(x, edge_index)
            out.pow(2).sum().backward()
            grads.append([x.grad] + [p.grad for p in m.parameters()])
        torch.testing.assert_close(ours(x, edge_index), conv(x, edge_index), rtol=1e-4,
                                   atol=1e-5)
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name} step {step}: {m}")
    st = layer_states(ours)[0]
    assert st.ran.kind != "fallback", f"{name} fell back: {st.ran}"
    impls = {i for c in st.chosen.values() for i in (c.get("impls") or ())}
    assert impls <= GPU_IMPLS, f"{name}: CPU kernels on the GPU: {impls}"
    return sorted(impls)


def check_every_choice(dev):
    """Every plan and kernel choice of GCN (with edge weights), SAGE, GAT and GIN layers on the
    GPU path (``pyg.plan_choices``: each implementation of each step runs in place once), with
    gradients: the layer's outputs and gradients. The dispatcher runs only the few it picks."""
    from torch_geometric import nn

    from granii import pyg
    edge_index, w, n = graph(dev)
    specs = {"GCNConv": (lambda: nn.GCNConv(12, 6), True),
             "SAGEConv": (lambda: nn.SAGEConv(12, 6), False),
             "GATConv": (lambda: nn.GATConv(12, 3, heads=2), False),
             "GINConv": (lambda: nn.GINConv(torch.nn.Linear(12, 6), train_eps=True), False)}
    ran = 0
    for name, (make, weighted) in specs.items():
        torch.manual_seed(2)
        conv = make().to(dev)
        x = torch.randn(n, 12, device=dev, requires_grad=True)
        args = (x, edge_index, w) if weighted else (x, edge_index)
        want = conv(*args)
        dy = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, [x, *conv.parameters()], dy)
        prepared = pyg.prepare(conv, *args)
        choices = pyg.plan_choices(prepared)
        assert choices, f"{name}: no plan runs on the GPU path"
        for plan, impls in choices:
            assert set(impls) <= GPU_IMPLS, (name, impls)
            got = pyg.run(prepared, plan, impls)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name} [{plan.index}] {impls}: {m}")
            grads = torch.autograd.grad(got, [x, *conv.parameters()], dy, allow_unused=True)
            for g, wg in zip(grads, want_grads):
                torch.testing.assert_close(g if g is not None else torch.zeros_like(wg), wg,
                                           rtol=1e-4, atol=1e-5)
            ran += 1
    return ran


def check_graph_inputs(dev):
    """A ``torch.sparse`` CSR adjacency (SAGE) and PyG's ``EdgeIndex`` (GCN) on the GPU path:
    every plan and kernel choice gives the layer's output."""
    from torch_geometric import EdgeIndex, nn

    from granii import pyg
    edge_index, _, n = graph(dev)
    order = torch.argsort(edge_index[1], stable=True)
    crow = torch.zeros(n + 1, dtype=torch.long, device=dev)
    crow[1:] = torch.cumsum(torch.bincount(edge_index[1], minlength=n), 0)
    adj_t = torch.sparse_csr_tensor(crow, edge_index[0][order],
                                    torch.ones(edge_index.shape[1], device=dev), size=(n, n))
    x = torch.randn(n, 12, device=dev)
    ran = 0
    for conv, g in ((nn.SAGEConv(12, 5).to(dev), adj_t),
                    (nn.GCNConv(12, 5).to(dev), EdgeIndex(edge_index, sparse_size=(n, n)))):
        want = conv(x, g)
        prepared = pyg.prepare(conv, x, g)
        for plan, impls in pyg.plan_choices(prepared):
            torch.testing.assert_close(pyg.run(prepared, plan, impls), want, rtol=1e-4,
                                       atol=1e-5)
            ran += 1
    return ran


class HostReads(torch.overrides.TorchFunctionMode):
    """Records the operations that read a device tensor's values on the host, called from
    granii's code: on a GPU each waits for every queued kernel (a synchronization), so the host
    cannot run ahead and a call costs its launches plus its kernels instead of the larger of the
    two. ``seen``: ``"operation @ file:line"`` -> count."""
    READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy",
             "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
             "equal", "allclose"}
    GRANII = os.sep + "granii" + os.sep

    def __init__(self):
        super().__init__()
        self.seen = {}

    def _reads(self, name, args, kwargs):
        if name in self.READS or name == "where" and len(args) == 1:
            return True
        if name == "repeat_interleave":                 # its output's size, without output_size
            return "output_size" not in kwargs
        if name in ("__getitem__", "__setitem__", "index_put", "index_put_") and len(args) > 1:
            index = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self._reads(name, args, kwargs):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if self.GRANII in f.filename or "torch_geometric" in f.filename]
            if frames and self.GRANII in frames[-1].filename:   # not PyG's own forward's
                at = f"{name} @ {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
                self.seen[at] = self.seen.get(at, 0) + 1
        return func(*args, **kwargs)


def check_settled_calls_read_nothing(dev):
    """Settled calls of granii's plans read no device value on the host, in training and in
    evaluation: GCN with edge weights (PyG's self loops take the weights of the loops there),
    SAGE, GAT on a graph whose hub's row is split into pieces, GIN, GINE with edge features and
    GATv2 with edge features (its self loops take the mean of their in-edges' features).
    The decisions are the ranking's (``tune=False``), so plans run, not PyG's forward."""
    from torch_geometric import nn

    from granii import granii
    from granii.kernels.triton.gat_kernels import SEG
    from granii.runtime.dispatch import layer_states
    edge_index, w, n = graph(dev)
    hub = torch.arange(SEG + 40, device=dev) % n                 # node 0's row: two pieces
    loops = torch.arange(3, device=dev)
    edge_index = torch.cat([edge_index, torch.stack([hub, torch.zeros_like(hub)]),
                            torch.stack([loops, loops])], 1)
    e = edge_index.shape[1]
    w = torch.rand(e, device=dev) + 0.5
    attr = torch.randn(e, 12, device=dev)
    specs = {"GCNConv": (lambda: nn.GCNConv(12, 6), (w,)),
             "SAGEConv": (lambda: nn.SAGEConv(12, 6), ()),
             "GATConv": (lambda: nn.GATConv(12, 3, heads=2), ()),
             "GINConv": (lambda: nn.GINConv(torch.nn.Linear(12, 6), train_eps=True), ()),
             "GINEConv": (lambda: nn.GINEConv(torch.nn.Linear(12, 12)), (attr,)),
             "GATv2Conv-edges": (lambda: nn.GATv2Conv(12, 3, heads=2, edge_dim=12), (attr,))}
    found = {}
    for name, (make, extra) in specs.items():
        torch.manual_seed(4)
        conv = make().to(dev)
        x = torch.randn(n, 12, device=dev, requires_grad=True)
        for training in (True, False):
            conv.train(training)
            granii(conv, x, edge_index, tune=False, extra_args=extra)
            with torch.set_grad_enabled(training):
                for call in range(3):
                    reads = HostReads()
                    with reads:
                        out = conv(x, edge_index, *extra)
                        if training:
                            out.square().sum().backward()
                    st = layer_states(conv)[0]
                    assert st.ran.kind == "plan", f"{name}: {st.ran}"
                    if call and reads.seen:
                        found[f"{name} {'training' if training else 'evaluation'}"] = reads.seen
    assert not found, f"device values read on the host: {found}"


CHECKS = {f"model_{name}": (lambda dev, name=name: check_model(name, dev))
          for name in ("gcn", "gcn_weighted", "sage", "gat", "gin")}
CHECKS.update({f"layer_{name}": (lambda dev, name=name: check_layer(name, dev))
               for name in ("SGConv", "GraphConv", "TAGConv", "APPNP")})
CHECKS["every_choice"] = check_every_choice
CHECKS["graph_inputs"] = check_graph_inputs
CHECKS["explain_and_fallback"] = check_explain_and_fallback
CHECKS["settled_calls_read_nothing"] = check_settled_calls_read_nothing


def _host_copies_only():
    """On the CPU, make ``Tensor.numpy`` (and numpy's conversions) refuse a tensor that was not
    copied to the host by ``.cpu()``, as it refuses a CUDA tensor: a conversion the GPU path
    would fail on fails here too."""
    real_numpy, real_cpu = torch.Tensor.numpy, torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        out = real_cpu(self, *args, **kwargs)
        if out is self and self.layout == torch.strided:
            out = self.detach().view_as(self) if not self.requires_grad else self.view_as(self)
        out.__dict__["_on_host"] = True
        return out

    def numpy(self, *args, **kwargs):
        if not self.__dict__.get("_on_host"):
            raise TypeError("can't convert a device tensor to numpy (the GPU path on the CPU: "
                            "copy it with .cpu() first)")
        return real_numpy(self, *args, **kwargs)
    torch.Tensor.cpu, torch.Tensor.numpy = cpu, numpy


class HostTensors(torch.overrides.TorchFunctionMode):
    """On the CPU, the other half of what CUDA refuses: an operation mixing a tensor made on the
    host (by a factory call naming no device, or by ``.cpu()``) with one on the device (the
    inputs, the parameters, and everything made from them or with an explicit ``device=``), and
    granii's C++ kernels (CPU only) called on device tensors. Indexing with host indices and
    ``copy_`` across devices are allowed, as CUDA allows them; tensors with no dimensions are
    allowed anywhere."""
    FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "randn", "rand",
                 "randint", "eye", "linspace", "as_tensor", "from_numpy", "randperm"}
    MIXING_ALLOWED = {"__getitem__", "__setitem__", "copy_", "to", "cpu", "numpy", "tolist",
                      "item", "__get__", "__set__", "__repr__", "__format__", "equal"}

    def __init__(self):
        super().__init__()
        self.host = {}

    def _is_host(self, t):
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import weakref

        from torch.utils._pytree import tree_flatten
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        sized = [t for t in tensors if t.dim() > 0 and t.layout == torch.strided]
        host = [self._is_host(t) for t in sized]
        op = str(getattr(func, "_qualified_op_name", getattr(func, "name", "")))
        if op.startswith("granii::") and not all(host):
            raise RuntimeError(f"{op}: granii's C++ kernel on device tensors")
        if any(host) and not all(host) and name not in self.MIXING_ALLOWED:
            raise RuntimeError(f"{name}: a host tensor mixed with device tensors (on a GPU: "
                               "'Expected all tensors to be on the same device')")
        out = func(*args, **kwargs)
        if name in ("to", "cuda") and (len(args) > 1 and isinstance(args[1], (torch.device, str))
                                       or "device" in kwargs):
            self.host.pop(id(out), None)        # moved to the device (the same object here)
            return out
        if name == "cpu" or name in self.FACTORIES and "device" not in kwargs or \
                name not in ("to",) and sized and all(host):
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.host[id(o)] = weakref.ref(o)
        return out


def worker(dev):
    """Run every check on ``dev`` (``cpu``: the GPU path on CPU tensors, under the interpreter);
    print ``{"results": {check: None or the error}}``."""
    import warnings
    warnings.simplefilter("ignore")
    if dev == "cpu":
        from granii import device
        device.GPU_PATH_ON_CPU[0] = True
        _host_copies_only()
        from granii.kernels.triton import impls
        impls.register()
    results = {}
    for name, fn in CHECKS.items():
        try:
            if dev == "cpu":
                with HostTensors():
                    out = fn(dev)
            else:
                out = fn(dev)
            results[name] = None
            print(f"{name}: ok {out if out else ''}", file=sys.stderr)
        except Exception:
            results[name] = traceback.format_exc(limit=-10)
            print(f"{name}: FAILED\n{results[name]}", file=sys.stderr)
    return {"results": results}


def _skip_reason():
    try:
        from granii.kernels.triton import available
    except ImportError as e:
        return f"Triton cannot be imported: {e}"
    if not available():
        return "Triton older than 3.0 (its interpreter is not usable)"
    try:
        import torch_geometric  # noqa: F401
    except ImportError:
        return "PyTorch Geometric is not installed"
    return None


SKIP = _skip_reason()


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT,
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])["results"]


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_gpu_path(results, check):
    assert results[check] is None, results[check]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
    else:
        sys.exit("usage: test_gpu_path.py --worker cpu|cuda")
