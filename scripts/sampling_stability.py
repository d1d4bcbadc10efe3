"""Is the decision made on the first sampled block good for the later ones? (paper, section VI-E)

    python -m scripts.sampling_stability [--batches 12] [--quick] [--out results/sampling]

For each graph, model, neighbour-sampler configuration and embedding sizes, a 2-layer model's
layers see the blocks of ``batches`` batches of ``dgl.dataloading.DataLoader``. On every block
of every layer the script:

* decides afresh (what ``granii(..., per_batch=True)`` does) and compares with the decision of
  the first batch (what the default, reuse, keeps): same plan and implementations or not;
* times every promoted plan (with the implementations selection picks for it) side by side on
  that block, so both decisions get a regret: ``time(decision) / time(fastest plan)``;
* times the decision itself on a fresh copy of the block (featurize, rank, compile) against the
  reuse (a dictionary lookup): the per-batch overhead reuse saves.

Writes ``stability.csv`` (one row per block and layer) and ``report.md`` to ``--out``.
Inference only (the blocks' plans and their rankings are the same objects in training).
"""
import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dgl  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from bench.measure import state_for  # noqa: E402
from bench.models import build  # noqa: E402
from granii import datasets  # noqa: E402
from granii.runtime.bind import prepare# noqa: E402
from granii.runtime.variants import leaf_vals_order
from granii.graph import GraphInfo  # noqa: E402
from granii.learned import default_cost_model  # noqa: E402
from granii.plan import compile_plan  # noqa: E402
from granii.select import rank  # noqa: E402
from granii.profiling.timing import fix_threads, side_by_side  # noqa: E402

GRAPHS = ["pubmed", "github-social", "astro-ph"]
QUICK_GRAPHS = ["pubmed", "astro-ph"]
MODELS = ["sage", "gcn", "gat"]
FANOUTS = [[5, 5], [10, 10], [25, 10]]
SIZES = [(32, 256, 32), (256, 32, 256)]         # k_in -> hidden -> k_out
BATCH_SIZE = 512


def decide(state, layer, block, h, cost_model):
    """``(best Choice, call)`` of a fresh decision for ``layer`` on ``block`` (inference)."""
    call = prepare(state, layer, (block, h), {})
    if isinstance(call, str):
        raise RuntimeError(call)
    best = rank(call.compiled.plans, call.gi, call.symbols, cost_model, False, False, 1)[0]
    return best, call


def plan_fn(choice, call, layer):
    fn, _ = compile_plan(choice.plan, choice.impls)
    args = [call.leaf_vals[v] for v in leaf_vals_order(choice.plan)]
    return lambda: fn(call.gi, layer, *args)


def decision_seconds(state, layer, block, h, cost_model):
    """Featurize + rank + compile on a block granii has not seen (a new GraphInfo)."""
    from granii import graph as graph_mod
    graph_mod._INFOS.pop(block, None)
    t0 = time.perf_counter()
    best, call = decide(state, layer, block, h, cost_model)
    compile_plan(best.plan, best.impls)
    return time.perf_counter() - t0


def one_config(g, graph_name, model, fanouts, sizes, batches, cost_model, seed=0):
    torch.manual_seed(seed)
    dims = list(zip(sizes[:-1], sizes[1:]))
    layers = [build(model, a, b, seed=seed) for a, b in dims]
    states = [state_for(layer) for layer in layers]
    sampler = dgl.dataloading.NeighborSampler(fanouts)
    seeds = torch.randperm(g.num_nodes())[: batches * BATCH_SIZE]
    loader = dgl.dataloading.DataLoader(g, seeds, sampler, batch_size=BATCH_SIZE, shuffle=False)
    first = [None] * len(layers)
    rows = []
    with torch.no_grad():
        for bi, (inp, _, blocks) in enumerate(loader):
            for li, (layer, state, block) in enumerate(zip(layers, states, blocks)):
                h = torch.randn(block.num_src_nodes(), dims[li][0])
                best, call = decide(state, layer, block, h, cost_model)
                if first[li] is None:
                    first[li] = best
                ranking = rank(call.compiled.plans, call.gi, call.symbols, cost_model, False,
                               False, 1)
                fns = {c.plan.index: plan_fn(c, call, layer) for c in ranking}
                fns["reused"] = plan_fn(first[li], call, layer)
                times = {k: v[0] for k, v in side_by_side(fns, warmup=1, repeat=7,
                                                          budget=0.3).items()}
                fastest = min(v for k, v in times.items() if k != "reused")
                rows.append(dict(
                    graph=graph_name, model=model, fanouts="/".join(map(str, fanouts)),
                    k_in=dims[li][0], k_out=dims[li][1], batch=bi, layer=li,
                    num_src=block.num_src_nodes(), num_dst=block.num_dst_nodes(),
                    num_edges=block.num_edges(),
                    first_plan=first[li].plan.composition(), first_impls=" ".join(first[li].impls),
                    batch_plan=best.plan.composition(), batch_impls=" ".join(best.impls),
                    agree=(best.plan.index, best.impls) == (first[li].plan.index,
                                                            first[li].impls),
                    same_plan=best.plan.index == first[li].plan.index,
                    reused_ms=times["reused"] * 1e3, per_batch_ms=times[best.plan.index] * 1e3,
                    fastest_ms=fastest * 1e3,
                    decide_ms=decision_seconds(state, layer, block, h, cost_model) * 1e3))
    return rows


def geomean(values):
    import math
    values = [max(float(v), 1e-12) for v in values]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def write_report(df, out, command):
    later = df[df.batch > 0]
    lines = ["# Sampling: is the first block's decision good for later batches?", "",
             f"Command: `{command}`. Inference, 2 threads, batch size {BATCH_SIZE}, "
             f"{df.batch.max() + 1} batches per configuration; every promoted plan timed side by "
             "side on every block (median of up to 7 rounds). `reuse` keeps the decision made on "
             "the first batch (granii's default on blocks); `per batch` decides again on each "
             "block (`granii(..., per_batch=True)`). Regret: time of the decision's plan / time "
             "of the fastest plan on that block.", "",
             "| graph | model | fanouts | k_in->k_out | blocks | same decision | same plan | "
             "regret reuse (geomean / worst) | regret per batch (geomean / worst) | "
             "decide per block ms (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = ["graph", "model", "fanouts", "k_in", "k_out"]
    for key, sub in later.groupby(keys, sort=False):
        r_reuse = sub.reused_ms / sub.fastest_ms
        r_batch = sub.per_batch_ms / sub.fastest_ms
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]}->{key[4]} | {len(sub)} | "
            f"{sub.agree.mean():.0%} | {sub.same_plan.mean():.0%} | "
            f"{geomean(r_reuse):.3f} / {r_reuse.max():.2f} | "
            f"{geomean(r_batch):.3f} / {r_batch.max():.2f} | {sub.decide_ms.median():.2f} |")
    r_reuse = later.reused_ms / later.fastest_ms
    r_batch = later.per_batch_ms / later.fastest_ms
    lines += ["", "## Overall (blocks after the first batch)", "",
              f"* decision the same as the first batch's: **{later.agree.mean():.1%}** of "
              f"{len(later)} blocks (same plan, implementations aside: {later.same_plan.mean():.1%})",
              f"* regret of reuse: geomean {geomean(r_reuse):.3f}, worst {r_reuse.max():.2f}; "
              f"of deciding per batch: geomean {geomean(r_batch):.3f}, worst {r_batch.max():.2f}",
              f"* time of reused plan / per-batch plan: geomean "
              f"{geomean(later.reused_ms / later.per_batch_ms):.3f}",
              f"* a per-batch decision costs {later.decide_ms.median():.2f} ms per block and layer "
              f"(median; featurize, rank, compile), {geomean(later.decide_ms / later.fastest_ms):.2f}"
              "x the block's fastest plan (geomean); reuse costs a dictionary lookup", ""]
    (out / "report.md").write_text("\n".join(lines))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="two graphs, one fanout, fewer batches")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "sampling")
    args = ap.parse_args(argv)
    fix_threads(2)
    warnings.filterwarnings("ignore", message=".*CPU affinity")
    warnings.filterwarnings("ignore", message=".*is in beta")
    cost_model = default_cost_model()
    graphs = QUICK_GRAPHS if args.quick else GRAPHS
    fanouts = FANOUTS[1:2] if args.quick else FANOUTS
    batches = min(args.batches, 4) if args.quick else args.batches
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    configs = [(gn, m, f, s) for gn in graphs for m in MODELS for f in fanouts for s in SIZES]
    t0 = time.perf_counter()
    for i, (gname, model, fo, sizes) in enumerate(configs):
        g = datasets.load_graph(gname)
        if model in ("gcn", "gat"):
            g = dgl.add_self_loop(dgl.remove_self_loop(g))
        rows += one_config(g, gname, model, fo, sizes, batches, cost_model)
        done = time.perf_counter() - t0
        print(f"[{i + 1}/{len(configs)}] {gname} {model} {fo} {sizes}: "
              f"{done:.0f} s, about {done / (i + 1) * (len(configs) - i - 1):.0f} s left",
              flush=True)
        pd.DataFrame(rows).to_csv(args.out / "stability.csv", index=False)
    df = pd.DataFrame(rows)
    command = (f"python -m scripts.sampling_stability --batches {args.batches}"
               + (" --quick" if args.quick else ""))
    print(write_report(df, args.out, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
