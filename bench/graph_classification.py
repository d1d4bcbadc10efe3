"""Graph classification as DGL's GIN example trains it: a new batch of small graphs every step.

    python -m bench.graph_classification [--out results/newgraph] [--epochs 6]
                                         [--datasets mutag,proteins] [--drift]

DGL's example (``examples/pytorch/gin/train.py`` in dmlc/dgl): ``GINDataset(name,
self_loop=True)``, 90/10 split, ``GraphDataLoader`` batches of 128 graphs (a new ``dgl.batch``
each step), the model below (hidden 16, Adam at lr 0.01, cross entropy), and after each epoch
``evaluate`` on the training and the validation loader (``model.eval()``, gradients left on,
as the example writes it).

No data set ships, so the graphs are generated with the statistics of the TU data sets the
example reads (``DATASETS``: graph count, node count mean/std/min/max, edges per node, node
label count, classes): node counts drawn from a log-normal of that mean and spread, clipped to
the range; each graph a random spanning tree plus random extra edges up to the edge count,
undirected (both directions) with a self-loop per node; features one-hot node labels.

Per data set, one fresh process runs the DGL model and a copy optimized by ``granii(...)`` on
the first batch (``granii`` itself counted in granii's time), epoch by epoch in turns: one
copy's training steps and evaluation passes, then the same epoch of the other (the same
batches for both, built before the timer; two objects, so nothing is shared), the first of
the two turning each epoch, so that each step follows a step of its own model as in a user's
loop (step by step in turns, every step found the other model's code and data in the caches,
which cost granii's calls more than DGL's: two runs of the same code, 350 epochs, read MUTAG's
training 1.08x step by step and 1.14x epoch by epoch). Every training
step (forward, loss, backward, optimizer step) and every evaluation batch is timed, first
calls included. Both copies start from the same weights and see the same batches and random
numbers, so their losses agree up to float re-association, which training then amplifies step by
step (reported: the largest relative difference of a step's loss in the first epoch, each model's
mean loss in the last epoch, and each model's accuracy in the last evaluation pass).

    speedup (train) = DGL's training steps / (granii(...) + granii's training steps)
    speedup (eval)  = DGL's evaluation calls / granii's evaluation calls

Writes ``graph_classification.csv`` and ``graph_classification.md`` under ``--out``.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# TU data sets as DGL's GINDataset serves them: graphs, nodes (mean, std, min, max), undirected
# edges per node (mean edges / mean nodes), node labels (the feature width), classes
DATASETS = {
    "mutag": dict(graphs=188, nodes=(17.93, 4.58, 10, 28), edges_per_node=19.79 / 17.93,
                  labels=7, classes=2),
    "proteins": dict(graphs=1113, nodes=(39.06, 45.76, 4, 620), edges_per_node=72.82 / 39.06,
                     labels=3, classes=2),
}
BATCH = 128


class MLP(nn.Module):
    """DGL's example: two linear layers without bias, BatchNorm and ReLU between."""

    def __init__(self, input_dim, hidden_dim, output_dim):
        super().__init__()
        self.linears = nn.ModuleList()
        self.linears.append(nn.Linear(input_dim, hidden_dim, bias=False))
        self.linears.append(nn.Linear(hidden_dim, output_dim, bias=False))
        self.batch_norm = nn.BatchNorm1d(hidden_dim)

    def forward(self, x):
        h = F.relu(self.batch_norm(self.linears[0](x)))
        return self.linears[1](h)


class GIN(nn.Module):
    """DGL's example: four GINConv layers (fixed eps, sum) each followed by BatchNorm and ReLU;
    a linear prediction of the sum-pooled features of every layer, the input included, with
    dropout 0.5, summed."""

    def __init__(self, input_dim, hidden_dim, output_dim):
        super().__init__()
        from dgl.nn.pytorch.conv import GINConv
        from dgl.nn.pytorch.glob import SumPooling
        self.ginlayers = nn.ModuleList()
        self.batch_norms = nn.ModuleList()
        num_layers = 5
        for layer in range(num_layers - 1):
            mlp = MLP(input_dim if layer == 0 else hidden_dim, hidden_dim, hidden_dim)
            self.ginlayers.append(GINConv(mlp, learn_eps=False))
            self.batch_norms.append(nn.BatchNorm1d(hidden_dim))
        self.linear_prediction = nn.ModuleList()
        for layer in range(num_layers):
            self.linear_prediction.append(
                nn.Linear(input_dim if layer == 0 else hidden_dim, output_dim))
        self.drop = nn.Dropout(0.5)
        self.pool = SumPooling()

    def forward(self, g, h):
        hidden_rep = [h]
        for i, layer in enumerate(self.ginlayers):
            h = layer(g, h)
            h = self.batch_norms[i](h)
            h = F.relu(h)
            hidden_rep.append(h)
        score_over_layer = 0
        for i, h in enumerate(hidden_rep):
            pooled_h = self.pool(g, h)
            score_over_layer += self.drop(self.linear_prediction[i](pooled_h))
        return score_over_layer


def small_graph(rng, stats):
    """``(src, dst, labels)`` of one generated graph with ``stats``' distribution: a random
    spanning tree plus random extra edges, both directions, a self-loop per node."""
    mean, std, lo, hi = stats["nodes"]
    sigma = math.sqrt(math.log(1 + (std / mean) ** 2))
    n = int(np.clip(round(rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma)), lo, hi))
    m = max(n - 1, int(round(n * stats["edges_per_node"] * rng.uniform(0.8, 1.2))))
    parents = [int(rng.integers(0, i)) for i in range(1, n)]
    u = list(range(1, n))
    v = parents
    extra = m - (n - 1)
    if extra > 0 and n > 2:
        a = rng.integers(0, n, extra)
        b = rng.integers(0, n, extra)
        keep = a != b
        u += a[keep].tolist()
        v += b[keep].tolist()
    src = np.array(u + v + list(range(n)), dtype=np.int64)
    dst = np.array(v + u + list(range(n)), dtype=np.int64)
    return src, dst, rng.integers(0, stats["labels"], n)


def dataset(name, seed=0):
    """``[(DGL graph with ndata['attr'], label)]`` of a generated data set like ``name``."""
    import dgl
    stats = DATASETS[name]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(stats["graphs"]):
        src, dst, labels = small_graph(rng, stats)
        g = dgl.graph((torch.from_numpy(src), torch.from_numpy(dst)), num_nodes=len(labels))
        g.ndata["attr"] = F.one_hot(torch.from_numpy(labels), stats["labels"]).float()
        out.append((g, int(rng.integers(0, stats["classes"]))))
    return out


def batches(data, idx, rng):
    """The loader's batches of one pass (shuffled as ``SubsetRandomSampler``): lists of
    (graph, label)."""
    order = rng.permutation(idx)
    return [[data[i] for i in order[j:j + BATCH]] for j in range(0, len(order), BATCH)]


def collate(items):
    """``(batched graph, features, labels)`` as ``GraphDataLoader`` and the example make them:
    a new ``dgl.batch`` each time, the features popped from it."""
    import dgl
    g = dgl.batch([gr for gr, _ in items])
    feat = g.ndata.pop("attr")
    return g, feat, torch.tensor([lab for _, lab in items])


def _pair(name, seed):
    """``(data, rng, train_idx, val_idx, model, optimizer maker, loss)``: the data set, its 90/10
    split (``rng`` then draws the batches) and DGL's model, seeded, as both runs start them."""
    data = dataset(name, seed)
    rng = np.random.default_rng(seed + 1)
    perm = rng.permutation(len(data))
    n_val = len(data) // 10
    stats = DATASETS[name]
    torch.manual_seed(seed)
    model = GIN(stats["labels"], 16, stats["classes"])
    return data, rng, perm[n_val:], perm[:n_val], model


@contextlib.contextmanager
def _rng_of(gen):
    """torch's global generator in the state of ``gen`` (each copy draws its own dropout masks,
    the same sequence for both), then back; ``gen`` keeps where the draws left it."""
    state = torch.get_rng_state()
    torch.set_rng_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(torch.get_rng_state())
        torch.set_rng_state(state)


class _NoGraph(nn.Module):
    """A GINConv or SumPooling of the skeleton: the layer's shapes without its graph work
    (``(1 + eps) h`` for the aggregation, the first rows of ``h`` for the pooling)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, g, h):
        if hasattr(self.layer, "apply_func"):
            return self.layer.apply_func((1 + self.layer.eps) * h)
        return h[:g.batch_size]


def skeleton(model):
    """DGL's model with its graph work taken out (``_NoGraph``): every other operation of a step
    (the MLPs, BatchNorm, ReLU, dropout, the predictions, the loss, the backward of those and the
    optimizer) stays. Any implementation of the GINConv layers and the pooling runs this work
    too, so ``DGL step / skeleton step`` bounds what replacing them can gain."""
    sk = copy.deepcopy(model)
    sk.ginlayers = nn.ModuleList(_NoGraph(layer) for layer in sk.ginlayers)
    sk.pool = _NoGraph(sk.pool)
    return sk


STEADY_BLOCK = 10        # steady steps a model runs before the next takes its turn


def steady_steps(data, train_idx, rng, models, steps):
    """Median ms of a training step of each model once the decisions have settled: ``steps``
    steps of each on the same new batches (each model its own batch object), in blocks of
    ``STEADY_BLOCK`` steps per model, the order of the models turning each round. Each step
    then follows a step of its own model, as in a user's training loop: a step that follows
    another model's finds its own code and data out of the caches (alternating the models
    step by step gave DGL's model, run twice in a row at each turn of the order, a warm start
    granii's never had: two runs of the same code read MUTAG's steady steps 1.02x that way
    and 1.18x in blocks)."""
    loss_fcn = nn.CrossEntropyLoss()
    opts = {k: torch.optim.Adam(m.parameters(), lr=0.01) for k, m in models.items()}
    times = {k: [] for k in models}
    names = list(models)
    done = 0
    while done < steps:
        items = [it for _ in range(STEADY_BLOCK) for it in batches(data, train_idx, rng)]
        items = items[:min(STEADY_BLOCK, steps - done)]
        for k in names:
            for it in items:
                g, feat, lab = collate(it)
                models[k].train()
                s = time.perf_counter()
                loss = loss_fcn(models[k](g, feat), lab)
                opts[k].zero_grad()
                loss.backward()
                opts[k].step()
                times[k].append(time.perf_counter() - s)
        done += len(items)
        names = names[1:] + names[:1]
    return {k: round(float(np.median(v)) * 1e3, 3) for k, v in times.items()}


def run_one(name, epochs, seed=0, steady_count=200):
    """Train and evaluate both copies, a whole epoch of one (its training steps, then its
    evaluation passes) before the same epoch of the other, which of them goes first turning
    each epoch: a dict of the figures."""
    from granii import granii
    from granii.runtime.dispatch import layer_states
    torch.set_num_threads(2)
    data, rng, train_idx, val_idx, model = _pair(name, seed)
    models = {"dgl": model, "granii": copy.deepcopy(model)}
    opts = {k: torch.optim.Adam(m.parameters(), lr=0.01) for k, m in models.items()}
    loss_fcn = nn.CrossEntropyLoss()
    t = {"dgl": {"train": 0.0, "eval": 0.0}, "granii": {"train": 0.0, "eval": 0.0}}
    g0, f0, _ = collate(batches(data, train_idx, np.random.default_rng(0))[0])
    start = time.perf_counter()
    granii(models["granii"], g0, f0)
    t["granii"]["train"] += time.perf_counter() - start
    rngs = {k: torch.Generator().manual_seed(seed) for k in models}
    loss_err, steps, eval_batches = 0.0, 0, 0
    for epoch in range(epochs):
        correct, seen = {"dgl": 0, "granii": 0}, 0
        last_loss = {"dgl": 0.0, "granii": 0.0}
        train_batches = batches(data, train_idx, rng)
        eval_sets = [batches(data, idx, rng) for idx in (train_idx, val_idx)]
        losses = {}
        for which in (("dgl", "granii") if epoch % 2 == 0 else ("granii", "dgl")):
            model, opt = models[which], opts[which]
            losses[which] = []
            for items in train_batches:
                g, feat, lab = collate(items)       # a new batch object for each copy
                model.train()
                with _rng_of(rngs[which]):                     # the same dropout masks
                    s = time.perf_counter()
                    logits = model(g, feat)
                    loss = loss_fcn(logits, lab)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    t[which]["train"] += time.perf_counter() - s
                losses[which].append(loss.item())
            last_loss[which] = sum(losses[which])
            for eval_batches_of_set in eval_sets:
                for items in eval_batches_of_set:
                    g, feat, lab = collate(items)
                    model.eval()
                    s = time.perf_counter()
                    logits = model(g, feat)
                    _, predicted = torch.max(logits, 1)
                    correct[which] += int((predicted == lab).sum().item())
                    t[which]["eval"] += time.perf_counter() - s
        steps += len(train_batches)
        eval_batches += sum(len(b) for b in eval_sets)
        seen = sum(len(items) for b in eval_sets for items in b)
        if epoch == 0:
            loss_err = max(abs(a - b) / max(abs(a), 1e-6)
                           for a, b in zip(losses["dgl"], losses["granii"]))
    per_epoch = steps / max(epochs, 1)
    states = layer_states(models["granii"])
    steady = steady_steps(data, train_idx, rng, dict(models, skeleton=skeleton(models["dgl"])),
                          steady_count)
    return {
        "dataset": name, "graphs": len(data), "epochs": epochs, "train_steps": steps,
        "eval_batches": eval_batches,
        "batch_nodes": g0.num_nodes(), "batch_edges": g0.num_edges(),
        "dgl_train_s": round(t["dgl"]["train"], 3), "granii_train_s": round(t["granii"]["train"], 3),
        "speedup_train": round(t["dgl"]["train"] / t["granii"]["train"], 3),
        "dgl_eval_s": round(t["dgl"]["eval"], 3), "granii_eval_s": round(t["granii"]["eval"], 3),
        "speedup_eval": round(t["dgl"]["eval"] / t["granii"]["eval"], 3),
        "rankings": sum(s.ranked for s in states),
        "class_reused": sum(s.class_reused for s in states),
        "steady_dgl_ms": steady["dgl"], "steady_granii_ms": steady["granii"],
        "steady_skeleton_ms": steady["skeleton"],
        "steady_speedup": round(steady["dgl"] / steady["granii"], 3),
        "ceiling": round(steady["dgl"] / steady["skeleton"], 3),
        "first_epoch_loss_rel_diff": f"{loss_err:.1e}",
        "last_epoch_loss_dgl": round(last_loss["dgl"] / per_epoch, 4),
        "last_epoch_loss_granii": round(last_loss["granii"] / per_epoch, 4),
        "accuracy_dgl": round(correct["dgl"] / max(seen, 1), 4),
        "accuracy_granii": round(correct["granii"] / max(seen, 1), 4),
        "load1": round(os.getloadavg()[0], 2),
    }


def drift_one(name, epochs, seed=0, scale=1e-7):
    """Two copies of DGL's model trained as ``run_one`` trains its pair, the second with its
    initial weights moved by ``scale`` of their mean magnitude (about a float re-association's
    error): how far two runs of one training drift apart, the yardstick for the last-epoch loss
    and accuracy ``run_one`` reports."""
    data, rng, train_idx, val_idx, model = _pair(name, seed)
    models = {"a": model, "b": copy.deepcopy(model)}
    with torch.no_grad():
        for p in models["b"].parameters():
            p.add_(scale * p.abs().mean() * torch.randn_like(p))
    opts = {k: torch.optim.Adam(m.parameters(), lr=0.01) for k, m in models.items()}
    loss_fcn = nn.CrossEntropyLoss()
    rngs = {k: torch.Generator().manual_seed(seed) for k in models}
    for epoch in range(epochs):
        loss, steps, correct, seen = {"a": 0.0, "b": 0.0}, 0, {"a": 0, "b": 0}, 0
        for items in batches(data, train_idx, rng):
            for k, model in models.items():
                g, feat, lab = collate(items)
                model.train()
                with _rng_of(rngs[k]):
                    out = loss_fcn(model(g, feat), lab)
                    opts[k].zero_grad()
                    out.backward()
                    opts[k].step()
                loss[k] += out.item()
            steps += 1
        for idx in (train_idx, val_idx):
            for items in batches(data, idx, rng):
                for k, model in models.items():
                    g, feat, lab = collate(items)
                    model.eval()
                    correct[k] += int((model(g, feat).argmax(1) == lab).sum())
                seen += len(items)
    return {"dataset": name, "epochs": epochs, "weights_moved_by": scale,
            "last_epoch_loss_a": round(loss["a"] / steps, 4),
            "last_epoch_loss_b": round(loss["b"] / steps, 4),
            "accuracy_a": round(correct["a"] / seen, 4), "accuracy_b": round(correct["b"] / seen, 4)}


def _report_drift(rows, cmd, out):
    from bench.csvfile import write_csv
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "graph_classification_drift.csv", rows)
    md = ["# How far two runs of DGL's GIN example drift apart\n",
          f"`{cmd}`: DGL's model trained twice as `graph_classification.md` trains its pair "
          "(same batches, same dropout masks), the second copy's initial weights moved by "
          f"{rows[0]['weights_moved_by'] if rows else 1e-7:g} of their mean magnitude, about a "
          "float re-association's error. The gap between the two is what granii's last-epoch "
          "loss and accuracy beside DGL's are to be read against.\n",
          "| data set | epochs | last epoch loss (DGL / DGL moved) | accuracy (DGL / DGL moved) |",
          "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['dataset']} | {r['epochs']} | {r['last_epoch_loss_a']} / "
                  f"{r['last_epoch_loss_b']} | {r['accuracy_a']} / {r['accuracy_b']} |")
    (out / "graph_classification_drift.md").write_text("\n".join(md) + "\n")


def _report(rows, cmd, out):
    from bench.csvfile import write_csv
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "graph_classification.csv", rows)
    md = ["# Graph classification as DGL's GIN example trains it\n",
          f"`{cmd}` (2 threads, CPU; each data set in a fresh process; the load average at the "
          "foot). Generated data sets with the statistics of "
          "MUTAG and PROTEINS, batches of 128 graphs (a new `dgl.batch` each step), DGL's "
          "example model (4 GINConv layers, MLP with BatchNorm, hidden 16, sum pooling, "
          "dropout 0.5), Adam; after each epoch an evaluation pass over the training and the "
          "validation set (`model.eval()`, gradients on, as the example writes it). Times "
          "are the model's steps (forward, loss, backward, optimizer step; evaluation: "
          "forward and argmax), batching excluded; granii's training time includes "
          "`granii(...)` on the first batch. `rankings`: how many times a layer ranked its "
          "plans, over the whole run. Both copies start from the same weights and see the same "
          "batches and dropout masks; float re-association differences then grow step by step "
          "as in any two runs of one training, so the losses are compared in the first epoch "
          "(largest relative difference of a step's loss) and the models by their last epoch's "
          "mean loss and their accuracy in the last evaluation pass.\n",
          "| data set | graphs | batch nodes / edges | epochs | steps | DGL train s | granii "
          "train s | speedup train | DGL eval s | granii eval s | speedup eval | rankings | "
          "class reused | first epoch loss rel. diff | last epoch loss DGL / granii | accuracy DGL "
          "/ granii |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['dataset']} | {r['graphs']} | {r['batch_nodes']} / {r['batch_edges']} "
                  f"| {r['epochs']} | {r['train_steps']} | {r['dgl_train_s']} | "
                  f"{r['granii_train_s']} | **{r['speedup_train']:.2f}x** | {r['dgl_eval_s']} | "
                  f"{r['granii_eval_s']} | **{r['speedup_eval']:.2f}x** | {r['rankings']} | "
                  f"{r['class_reused']} | {r['first_epoch_loss_rel_diff']} | "
                  f"{r['last_epoch_loss_dgl']} / {r['last_epoch_loss_granii']} | "
                  f"{r['accuracy_dgl']} / {r['accuracy_granii']} |")
    md += ["\nSteady state, after the run above: 200 more training steps of each model in turns "
           "(median ms per step), beside DGL's model with its graph work taken out (`skeleton`: "
           "the GINConv aggregations and the pooling replaced by shape-keeping stand-ins, every "
           "other operation of the step kept). Any implementation of those layers runs the "
           "skeleton's work as well, so `DGL / skeleton` is a ceiling on the training speedup a "
           "layer optimizer can reach on this model, and `(DGL - granii) / (DGL - skeleton)` the "
           "share of the layers' time granii removed.\n",
           "| data set | DGL step ms | granii step ms | skeleton step ms | speedup (steady) | "
           "ceiling | share of the layers' time removed |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        removed = (r["steady_dgl_ms"] - r["steady_granii_ms"]) / max(
            r["steady_dgl_ms"] - r["steady_skeleton_ms"], 1e-9)
        md.append(f"| {r['dataset']} | {r['steady_dgl_ms']} | {r['steady_granii_ms']} | "
                  f"{r['steady_skeleton_ms']} | **{r['steady_speedup']:.2f}x** | "
                  f"{r['ceiling']:.2f}x | {removed:.0%} |")
    if rows:
        md.append(f"\nLoad average during the run: {min(r['load1'] for r in rows)}-"
                  f"{max(r['load1'] for r in rows)}.")
    (out / "graph_classification.md").write_text("\n".join(md) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "newgraph"))
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--datasets", default="mutag,proteins")
    ap.add_argument("--drift", action="store_true",
                    help="train DGL's model twice, one copy's weights moved by 1e-7: the drift "
                         "between two runs (graph_classification_drift.md)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drift:
        rows = [drift_one(name, args.epochs) for name in args.datasets.split(",")]
        cmd = "python -m bench.graph_classification " + " ".join(argv or sys.argv[1:])
        _report_drift(rows, cmd.strip(), Path(args.out))
        return
    if args.child:
        print("ROW " + json.dumps(run_one(args.child, args.epochs)))
        return
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="2")
    for name in args.datasets.split(","):
        res = subprocess.run([sys.executable, "-m", "bench.graph_classification", "--child", name,
                              "--epochs", str(args.epochs)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")), None)
        if line is None:
            print(f"{name}: failed\n{res.stderr[-3000:]}", flush=True)
            continue
        row = json.loads(line[4:])
        rows.append(row)
        print(f"{name}: train {row['speedup_train']:.2f}x eval {row['speedup_eval']:.2f}x "
              f"steady {row['steady_speedup']:.2f}x ceiling {row['ceiling']:.2f}x "
              f"rankings {row['rankings']} loss diff {row['first_epoch_loss_rel_diff']}",
              flush=True)
    cmd = "python -m bench.graph_classification " + " ".join(argv or sys.argv[1:])
    _report(rows, cmd.strip(), Path(args.out))


if __name__ == "__main__":
    main()
