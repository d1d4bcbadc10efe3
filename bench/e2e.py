"""End to end (the paper's Table IV): 2-layer GCN and GAT on Cora and CiteSeer, DGL vs granii.

Models as in DGL's examples, without dropout (so both runs draw no random numbers during training):
GCN ``GraphConv(F, 16, relu) -> GraphConv(16, C)``; GAT ``GATConv(F, 8, 8 heads, elu)`` -> flatten
-> ``GATConv(64, C, 1 head)``. Graph: the Planetoid graph with one self-loop per node; features,
labels and the standard split from ``granii.datasets.load_planetoid``.

Both models start from the same weights (``copy.deepcopy``); the granii copy goes through
``granii(model, g, x)`` first (its time is reported as ``granii_call_ms``). Training: Adam
(lr 0.01, weight decay 5e-4), cross-entropy on the training nodes, ``epochs`` full-batch epochs;
the two models alternate epoch by epoch so machine noise hits both alike; ``train_ms`` is the
median epoch. ``forward_ms``: median inference forward after training, side by side. Test accuracy
of both after training, the largest difference of their logits and the share of test nodes both
predict alike (float rounding differs between plans, so after many epochs a node or two near a
decision boundary may flip).
"""
import copy
import statistics
import time

import dgl
import torch
from dgl.nn import GATConv, GraphConv

from granii import granii as optimize
from granii.api import layer_states, restore
from granii.datasets import load_planetoid
from granii.profiling.timing import side_by_side


class GCN(torch.nn.Module):
    def __init__(self, k_in, classes, hidden=16):
        super().__init__()
        self.conv1 = GraphConv(k_in, hidden, activation=torch.relu)
        self.conv2 = GraphConv(hidden, classes)

    def forward(self, g, x):
        return self.conv2(g, self.conv1(g, x))


class GAT(torch.nn.Module):
    def __init__(self, k_in, classes, hidden=8, heads=8):
        super().__init__()
        self.conv1 = GATConv(k_in, hidden, heads, activation=torch.nn.functional.elu)
        self.conv2 = GATConv(hidden * heads, classes, 1)

    def forward(self, g, x):
        h = self.conv1(g, x).flatten(1)
        return self.conv2(g, h).mean(1)


E2E_MODELS = {"gcn": GCN, "gat": GAT}


def _step(model, opt, g, x, y, mask):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(g, x)[mask], y[mask])
    loss.backward()
    opt.step()


def run(dataset, model_name, epochs=200, seed=0, forward_repeat=31):
    """One row: times, accuracies and the optimization status of each layer."""
    g, x, y, train, _, test = load_planetoid(dataset)
    g = dgl.add_self_loop(dgl.remove_self_loop(g))
    classes = int(y.max()) + 1
    torch.manual_seed(seed)
    ref = E2E_MODELS[model_name](x.shape[1], classes)
    opt_model = copy.deepcopy(ref)
    error = None
    t0 = time.perf_counter()
    try:
        optimize(opt_model, g, x)
    except Exception as e:            # noqa: BLE001 - recorded; the model runs DGL's forward
        restore(opt_model)
        error = f"error {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    call_ms = (time.perf_counter() - t0) * 1e3
    states = layer_states(opt_model)
    opt_r = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=5e-4)
    opt_o = torch.optim.Adam(opt_model.parameters(), lr=0.01, weight_decay=5e-4)
    times = {"dgl": [], "granii": []}
    for _ in range(epochs):
        for name, m, o in (("dgl", ref, opt_r), ("granii", opt_model, opt_o)):
            t = time.perf_counter()
            _step(m, o, g, x, y, train)
            times[name].append(time.perf_counter() - t)
    fallback = [f"{s.name}: {s.fallback}" for s in states if s.fallback]
    if error:
        fallback.append(error)
    with torch.no_grad():
        fwd = side_by_side({"dgl": lambda: ref(g, x), "granii": lambda: opt_model(g, x)},
                           warmup=3, repeat=forward_repeat)
        out_r, out_o = ref(g, x), opt_model(g, x)
    acc = {k: float((o[test].argmax(1) == y[test]).float().mean())
           for k, o in (("dgl", out_r), ("granii", out_o))}
    chosen = "; ".join(f"{s.name}: {s.last[2].plan.composition()}" for s in states if s.last)
    return dict(
        dataset=dataset, model=model_name, nodes=g.num_nodes(), edges=g.num_edges(),
        features=x.shape[1], classes=classes, epochs=epochs,
        granii_call_ms=call_ms,
        train_ms_dgl=statistics.median(times["dgl"]) * 1e3,
        train_ms_granii=statistics.median(times["granii"]) * 1e3,
        first_epoch_ms_dgl=times["dgl"][0] * 1e3, first_epoch_ms_granii=times["granii"][0] * 1e3,
        forward_ms_dgl=fwd["dgl"][0] * 1e3, forward_ms_granii=fwd["granii"][0] * 1e3,
        test_acc_dgl=acc["dgl"], test_acc_granii=acc["granii"],
        max_logit_diff=float((out_r - out_o).abs().max()),
        test_pred_agree=float((out_r[test].argmax(1) == out_o[test].argmax(1)).float().mean()),
        optimized=not fallback and bool(states), status="; ".join(fallback) or "ok",
        chosen=chosen,
    )


__all__ = ["run", "GCN", "GAT", "E2E_MODELS"]
