"""Smoke run of the benchmark suite on tiny inputs: the rows, the resume logic and the report.

No timing is asserted (the machine is shared); only that every part runs and writes what the
report reads.
"""
import csv
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:       # ``bench/`` lives beside the installed packages
    sys.path.insert(0, str(ROOT))

from bench import e2e, graphs, measure, models, overhead, report, runs  # noqa: E402
from granii.profiling import generators as gen  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    base = gen.rmat(7, 4, seed=0)
    return base, graphs.with_self_loops(base)


@pytest.fixture(scope="module")
def cost_model():
    from granii.costmodel import AnalyticalCost
    return AnalyticalCost()


def _run(model, g, training, cost_model):
    torch.set_num_threads(2)
    return measure.measure(model, "tiny", "rmat", g, 8, 16, training, cost_model,
                           warmup=1, repeat=3, budget=0.01)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_measure_rows(tiny, cost_model, training):
    rows = _run("gcn", tiny[1], training, cost_model)
    by = {r["candidate"]: r for r in rows}
    assert {"dgl", "granii"} <= set(by)
    assert by["granii"]["status"] == "ok"
    assert by["granii"]["check"] == "pass"
    assert by["granii"]["plan_key"]
    plans = [r for r in rows if r["kind"] == "plan"]
    assert plans, "every promoted plan is timed"
    assert sum(int(r["chosen"]) for r in plans) == 1, "the chosen plan is among them"
    for r in rows:
        if r["kind"] in ("dgl", "granii"):
            assert r["total100_ms"] > r["steady_ms"] > 0
    if models.pygnn is not None:
        assert by["pyg"]["steady_ms"] > 0


def test_fallback_is_recorded(tiny, cost_model, monkeypatch):
    """A layer granii does not optimize gives a 'not optimized' row, not an exception."""
    def refuse(model, *a, **k):
        raise TypeError("frontend cannot lower this layer")
    monkeypatch.setattr(measure, "optimize", refuse)
    rows = _run("gin", tiny[0], False, cost_model)
    gr = next(r for r in rows if r["candidate"] == "granii")
    assert gr["status"].startswith("not optimized")
    assert any(r["candidate"] == "dgl" and r["steady_ms"] > 0 for r in rows)


def test_resume_and_report(tiny, cost_model, tmp_path):
    path = tmp_path / "runs.csv"
    for model in ("gcn", "sage"):
        for training in (False, True):
            rows = _run(model, tiny[1] if model == "gcn" else tiny[0], training, cost_model)
            for r in rows:
                r["level"] = 0
            runs.append_rows(path, rows)
    done = runs.done_configs(path)
    assert ("gcn", "tiny", 8, 16, "training") in done and len(done) == 4
    with open(path) as f:
        assert set(runs.FIELDS) == set(next(csv.reader(f)))
    h = report.write(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Table III" in text and "Table VI" in text
    assert (tmp_path / "speedup_gcn.png").exists()
    assert h["configs_total"] == 4 and math.isfinite(h["speedup_all"])
    assert h["regret_worst"] >= 1.0


def test_e2e_and_overhead_smoke(tiny, cost_model):
    row = e2e.run("cora", "gcn", epochs=2, forward_repeat=3)
    assert row["optimized"] and abs(row["test_acc_dgl"] - row["test_acc_granii"]) < 0.01
    ov = overhead.measure_graph(tiny[1], cost_model, runs=1)
    assert ov["granii_first_ms"] > 0 and ov["select_ms"] > 0


def test_size_levels():
    small = graphs.size_levels(3000, 10_000)
    assert len(small) == 12 and small[0] == (0, (32, 128))
    big = graphs.size_levels(10**6, 10**8)
    assert [p for _, p in big] == [(32, 128), (128, 32)]


# -- the headline benchmark (bench/fullbatch, minibatch, single, summary) -------------------------
def _tiny_inputs(tiny):
    from bench import inputs
    g = tiny[1]
    n = g.num_nodes()
    gen = torch.Generator().manual_seed(0)
    return inputs.Inputs("tiny", g, torch.randn(n, 12, generator=gen),
                         torch.randint(0, 3, (n,), generator=gen), torch.rand(n, generator=gen) < 0.5,
                         3)


def test_headline_plumbing(tiny, cost_model, tmp_path):
    """Every part of the headline on a tiny graph with 2 timed calls: rows, checks, report."""
    from bench import examples, fullbatch, minibatch, restrict, single, summary
    torch.set_num_threads(2)
    inp = _tiny_inputs(tiny)
    cms = {"granii": cost_model, "restricted": restrict.WithoutNative(cost_model)}
    rows = []
    for name in ("gcn", "tagcn"):
        for task in ("train", "infer"):
            r = fullbatch.measure(examples.FULL[name], inp, task, cms, budget=0.0, max_rounds=2,
                                  warmup=0)
            assert r["status"] == "ok" and r["check"] == "pass", r
            assert r["rounds"] == 2 and r["dgl_total_ms"] > r["dgl_ms"] > 0
            assert math.isfinite(r["speedup"]) and math.isfinite(r["joint_gain"])
            rows.append(r)
    spec, _ = examples.SAMPLED["sage"]
    r = minibatch.measure(spec, [3, 3, 3], inp, cms, budget=0.0, max_rounds=2, max_seeds=64)
    assert r["status"] == "ok" and r["check"] == "pass", r
    assert r["iterations"] == 1 and r["dgl_sampling_ms"] >= 0
    rows.append(r)
    layer_rows = single.measure("sgc", "tiny", inp.g, 8, 4, cms, budget=0.0, max_rounds=2)
    assert [r["features"] for r in layer_rows] == ["new", "same"]
    assert layer_rows[1]["dgl_layer"] == "SGConv(cached=True)"
    assert all(r["status"] == "ok" and r["check"] == "pass" for r in layer_rows)
    import pandas as pd
    pd.DataFrame(rows).to_csv(tmp_path / "models.csv", index=False)
    bad = dict(layer_rows[0], check="FAIL", speedup=100.0, k_in=16)    # a failure counts nowhere
    pd.DataFrame(layer_rows + [bad]).to_csv(tmp_path / "layers.csv", index=False)
    h = summary.write(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Headline" in text and "Single layers" in text and "Joint selection" in text
    assert "1 configuration(s) failed" in text
    assert (tmp_path / "headline.png").exists()
    assert h["layers_new"] < 100 and set(h) >= {"models_train", "models_infer", "models_minibatch"}


def test_restricted_cost_model_never_picks_native(cost_model):
    from bench.restrict import WithoutNative
    r = WithoutNative(cost_model)
    assert r.predict("spmm", "native", None, {}) == math.inf
    assert r.predict_train("spmm", "native", None, {}) == math.inf
    assert not r.has_model("spmm_heads", "native", "train")
    assert "without native" in r.name


def test_benchmark_script_quick_plan():
    """The script's configuration list: the parts in order, single layers last."""
    import argparse
    from scripts import benchmark
    args = argparse.Namespace(quick=True, graphs="", parts=list(benchmark.PARTS),
                              models=["gcn", "gat", "sage", "gin", "sgc", "tagcn"])
    todo = benchmark.plan(args)
    parts = [p for p, _, _ in todo]
    assert parts.index("layers") > parts.index("minibatch") > parts.index("models")
    assert len([p for p in parts if p == "models"]) == 2 * 2 * 6


@pytest.mark.parametrize("sources", [False, True])
@pytest.mark.parametrize("name", ["sage", "gcn", "gat"])
def test_skeleton_is_the_layers_dense_part(name, sources):
    """On blocks whose destinations each have one in-edge, from themselves, every layer's
    aggregation is the identity (mean of one row, degree 1, a softmax over one edge), so the
    skeleton must give the model's own output and gradients, whether GAT projects the
    destination rows only or every source row (more sources than destinations here)."""
    import dgl
    from bench import examples, skeleton
    spec, fanouts = examples.SAMPLED[name]
    torch.manual_seed(0)
    model = spec.build(None, 12, 3, True).eval()
    sizes = [50, 45, 40, 35][:len(fanouts) + 1]
    blocks = []
    for n_src, n_dst in zip(sizes[:-1], sizes[1:]):
        ids = torch.arange(n_dst)
        blocks.append(dgl.create_block((ids, ids), num_src_nodes=n_src, num_dst_nodes=n_dst))
    x = torch.randn(sizes[0], 12)
    skel = skeleton.skeleton(model, sources=sources)
    assert sum(isinstance(m, skeleton.Skeleton) for m in skel.modules()) == len(fanouts)
    assert skeleton.has_gat(model) == (name == "gat")
    want, got = spec.run(model, blocks, x), spec.run(skel, blocks, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.sum().backward()
    got.sum().backward()
    for (pn, p), q in zip(model.named_parameters(), skel.parameters()):
        # attention vectors get no gradient in the skeleton; through a one-edge softmax, zero
        q_grad = torch.zeros_like(p) if q.grad is None and "attn" in pn else q.grad
        torch.testing.assert_close(q_grad, p.grad, rtol=1e-5, atol=1e-6, msg=pn)


def test_smooth_relu_only_while_open():
    """The re-check of a failed training comparison swaps ReLU for GELU, and only inside it."""
    import torch.nn.functional as F
    from bench import check
    x = torch.linspace(-2, 2, 9)
    with check.smooth_relu():
        torch.testing.assert_close(F.relu(x), F.gelu(x))
        torch.testing.assert_close(torch.relu(x), F.gelu(x))
    torch.testing.assert_close(F.relu(x), x.clamp(min=0))
    torch.testing.assert_close(torch.relu(x), x.clamp(min=0))


class _Kink(torch.nn.Module):
    """``1000 s + sum_i leaky_relu(w x_i - 1/8)`` with ``x = [1/4, 1, .., 1]``. As written
    (``(w x + 1e7) - 1e7``) float32 rounds ``w x_0`` to 0, so ``z_0`` falls on the other slope;
    re-associated (``reassociated``) it is exact. ``wrong`` scales the sum: a real error."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.s = torch.nn.Parameter(torch.tensor(1.0))
        self.reassociated = self.wrong = False

    def forward(self, x):
        big = torch.tensor(1e7, dtype=x.dtype)
        z = self.w * x + (big - big) if self.reassociated else (self.w * x + big) - big
        total = torch.nn.functional.leaky_relu(z - 0.125, 0.1).sum()
        return (1000 * self.s + total * (1.1 if self.wrong else 1.0)).reshape(1)


def test_float64_reference_tells_a_kink_from_an_error():
    """Two float32 runs on either side of a leaky ReLU's kink differ by more than ``TOL`` in a
    gradient; against the float64 run the re-associated one is exact and passes, a scaled one
    fails, and so does a float64 run that is not DGL's function."""
    from bench import check
    x = torch.ones(50)
    x[0] = 0.25
    run = lambda m: m(x)                                         # noqa: E731

    def made(**flags):
        return lambda m: m.__dict__.update(flags)

    ref, opt = _Kink(), _Kink()
    made(reassociated=True)(opt)
    err, where = check.compare(ref, opt, run, True)
    assert not check.passed(err) and where.startswith("gradient of w")
    ok, ratio, _ = check.against_float64(_Kink, made(reassociated=True), run)
    assert ok and ratio < 1e-3
    ok, ratio, on = check.against_float64(_Kink, made(reassociated=True, wrong=True), run)
    assert not ok and on == "gradient of w"
    ok, _, why = check.against_float64(lambda: _Kink().train(), made(reassociated=True),
                                       lambda m: m(x) * (2.0 if m.s.dtype == torch.float64 else 1))
    assert not ok and "differ" in why
    # settle reports each step and passes the kink
    ok, where = check.settle(err, where, _Kink, made(reassociated=True), run)
    assert ok and "against float64" in where


def test_rounds_cut_by_the_cap_let_the_optimized_copies_settle():
    """When the time cap ends the rounds while the tie-break still runs, the candidates in
    ``settle`` go on alone until settled; then all run ``after_alone`` more rounds side by side,
    the steady rounds of every candidate. Never settled: the others' steady time is the median of
    all their rounds."""
    from bench.rounds import interleaved, summarise
    calls = {"dgl": 0, "granii": 0}

    def dgl():                      # slower than the cap: one shared round
        calls["dgl"] += 1
        time.sleep(0.06)
        return 1.0

    def granii():
        calls["granii"] += 1
        return 5.0 if calls["granii"] <= 6 else 0.1     # six calls of tie-break, then the plan
    samples, steady = interleaved({"dgl": dgl, "granii": granii}, max_rounds=40, min_rounds=2,
                                  budget=0.0, settled=lambda: calls["granii"] >= 6,
                                  min_steady=3, cap=0.05, settle=["granii"], after_alone=5)
    assert len(samples["dgl"]) == 1 + 5        # the cap ended the shared rounds; 5 at the end
    assert steady == -5 and len(samples["granii"]) == 6 + 5    # settled after 6 calls alone
    med, total = summarise(0.0, samples["granii"], steady, 100)
    assert med == 0.1 and math.isclose(total, 6 * 5.0 + 93 * 0.1)
    assert summarise(0.0, samples["dgl"], steady, 100)[0] == 1.0
    capped, never = interleaved({"dgl": dgl, "granii": lambda: 5.0}, max_rounds=12, min_rounds=2,
                                budget=0.0, settled=lambda: False, cap=0.05, settle=["granii"])
    assert len(capped["granii"]) == 12 and len(capped["dgl"]) == 1     # max_rounds bounds it
    assert never is None


def test_single_layer_row_when_the_optimized_copies_settled_alone(tiny, cost_model, monkeypatch):
    """When the optimized copies ran rounds alone (``settle``), DGL's and the floor's steady
    times come from all their rounds, not from an empty slice past them."""
    from bench import rounds, single
    torch.set_num_threads(2)
    real = rounds.interleaved

    def settled_alone(cands, **kw):
        samples, _ = real(cands, **dict(kw, max_rounds=2, settled=None, settle=()))
        for name in kw["settle"]:          # three more rounds alone, the last two steady
            samples[name] += [cands[name]() for _ in range(3)]
        samples["family_floor"] = [0.004, 0.002]
        return samples, 3
    monkeypatch.setattr(single, "interleaved", settled_alone)
    new, _ = single.measure("gcn", "tiny", _tiny_inputs(tiny).g, 8, 4,
                            {"granii": cost_model}, budget=0.0, max_rounds=2)
    assert new["status"] == "ok" and new["check"] == "pass", new
    assert new["rounds"] == 2 and new["alone_rounds"] == 3 and new["steady_rounds"] == 2
    assert new["family_floor_ms"] == pytest.approx(3.0)
    assert math.isfinite(new["speedup"]) and math.isfinite(new["family_ceiling"])


def test_settling_follows_a_tie_break_on_sampled_blocks(cost_model):
    """``Settling`` sees a tie-break that takes turns on sampled blocks, whose own decision
    tables go with each block: not settled while the turns go on, settled once they end."""
    import copy

    import dgl
    from dgl.nn import SAGEConv

    from bench.decisions import Settling
    from granii import granii
    from granii.runtime.tiebreak import TRIAL_ROUNDS
    torch.set_num_threads(2)
    dgl.seed(0)
    g = dgl.add_self_loop(dgl.rand_graph(300, 2400))
    sampler = dgl.dataloading.NeighborSampler([4])
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(g.num_nodes(), 12)
    torch.manual_seed(0)
    ref = SAGEConv(12, 6, "mean")
    model = copy.deepcopy(ref)
    settled, seen = Settling(model), []
    for i in range(4 * (TRIAL_ROUNDS + 1) + 4):
        inp, _, (block,) = sampler.sample_blocks(g, torch.randperm(300, generator=gen)[:40])
        if i == 0:
            granii(model, block, x_all[inp], cost_model=cost_model)
        seen.append(settled())
        out = model(block, x_all[inp])
        torch.testing.assert_close(out, ref(block, x_all[inp]), atol=1e-5, rtol=1e-4)
        out.sum().backward()
    assert not any(seen[1:4])                    # the turns go on over the first blocks
    assert all(seen[-2:])                        # and end


def test_the_floor_counts_every_weight_block_and_aggregation_of_the_layer():
    """The least work every plan does: SAGEConv multiplies the rows by two weights, TAGConv(k=2)
    by three blocks after two aggregations, SGConv(k=2) aggregates twice; a floor that counted
    one product and one sum for them gave ceilings no plan could approach."""
    from bench.single import floor_work
    assert floor_work(models.build("gcn", 8, 4)) == (1, 1)
    assert floor_work(models.build("gin", 8, 4)) == (1, 1)
    assert floor_work(models.build("gat", 8, 4)) == (1, 1)
    assert floor_work(models.build("sage", 8, 4)) == (2, 1)
    assert floor_work(models.build("sgc", 8, 4)) == (1, 2)
    assert floor_work(models.build("tagcn", 8, 4)) == (3, 2)


# -- first calls, scenarios, bounds, ablation ------------------------------------------------------
def test_totals_use_the_fresh_process_first_call():
    """With first calls from a fresh process for DGL and granii, the totals (the headline) use
    them and the warm ones are kept apart; without granii's, both stay warm and the row says so."""
    from bench.fullbatch import _ratios, record
    samples = {"dgl": [0.010] * 9, "granii": [0.005] * 9}
    row = {}
    record(row, ["dgl", "granii"], {"dgl": 0.02, "granii": 0.03}, samples, 0, 100,
           fresh={"dgl": 0.2, "granii": 1.5})
    _ratios(row)
    assert row["first_call"] == "fresh process"
    assert row["granii_first_ms"] == pytest.approx(1500) and \
        row["granii_first_warm_ms"] == pytest.approx(30)
    assert row["granii_total_ms"] == pytest.approx(1500 + 99 * 5)
    assert row["granii_total_warm_ms"] == pytest.approx(30 + 99 * 5)
    assert row["speedup"] == pytest.approx((200 + 990) / (1500 + 495))
    assert row["speedup_warm"] == pytest.approx((20 + 990) / (30 + 495))
    half = {}
    record(half, ["dgl", "granii"], {"dgl": 0.02, "granii": 0.03}, samples, 0, 100,
           fresh={"dgl": 0.2, "granii": float("nan")})
    assert half["first_call"] == "warm process"
    assert half["dgl_total_ms"] == pytest.approx(half["dgl_total_warm_ms"])


def test_fresh_children_share_nothing():
    """Each first call runs in a child of a process that only imported: a cost model loaded by
    one child's granii(...) is not loaded in the next child, nor in the zygote."""
    from bench.fresh import Zygote
    with Zygote() as z:
        first = z.first_call(kind="layer", model="gcn", graph="cora", k_in=8, k_out=4,
                             features="new", candidate="granii")
        assert math.isfinite(first) and first > 0, z.errors
        assert z.first_call(kind="probe", candidate="-") == 0.0, z.errors
        assert math.isnan(z.first_call(kind="layer", model="nope", graph="cora", k_in=8,
                                       k_out=4, features="new", candidate="dgl"))
        assert z.errors and "nope" in str(z.errors[-1][1])
        # its memory is its own, as a process started on its own has it: no page it writes is
        # still shared copy-on-write with the zygote
        assert z.first_call(kind="shared", candidate="-") == 0.0, z.errors


def test_a_plain_forked_child_shares_pages_that_own_pages_copies():
    """``shared_kb`` sees the pages a forked child shares with its parent; ``own_pages``
    leaves none."""
    from bench.fresh import own_pages, shared_kb
    keep = [bytearray(1 << 16) for _ in range(64)]      # 4 MiB written by the parent
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            before = shared_kb()
            own_pages()
            os.write(w, f"{before} {shared_kb()}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    before, after = map(int, os.read(r, 100).split())
    os.close(r)
    assert before >= 4096 and after == 0
    assert len(keep) == 64


def _layer_frame(**cols):
    import pandas as pd
    base = dict(model="gcn", graph="g", k_in=8, k_out=4, features="new", status="ok",
                check="pass", speedup=2.0, speedup_steady=2.0)
    return pd.DataFrame([dict(base, **cols)])


def test_headline_counts_only_configurations_users_run():
    """SGC uncached on new features is reported apart: not in ``all``, in ``all_with_others``."""
    import pandas as pd
    from bench import summary
    df = pd.DataFrame([dict(model=m, graph=g, task="infer", status="ok", check="pass",
                            speedup=s) for m, g, s in [("gcn", "a", 2.0), ("gcn", "b", 2.0),
                                                       ("sgc", "a", 10.0), ("sgc", "b", 10.0)]])
    s = summary.models_summary(df)["infer"]
    assert s["all"] == pytest.approx(2.0)
    assert s["all_with_others"] == pytest.approx(math.sqrt(20.0))
    assert "not as users run it" in summary.headline_table(df)
    layers = pd.concat([_layer_frame(), _layer_frame(model="sgc", speedup=9.0)])
    table = summary.layers_table(layers)
    assert "**all, as users run them** | **2.00x**" in table


def test_a_time_below_the_true_bound_stops_the_report():
    from bench import summary
    ok = _layer_frame(bound_ms=0.5, dgl_min_ms=0.9, granii_min_ms=0.6)
    assert summary.check_bounds(ok) == 1
    with pytest.raises(AssertionError, match="harness bug"):
        summary.check_bounds(_layer_frame(bound_ms=0.5, dgl_min_ms=0.9, granii_min_ms=0.4))


def test_true_bound_counts_the_work_any_algorithm_must_do(tiny):
    """Bytes: used source rows x k_in, one index per edge, the weights, the result; multiply-adds:
    every weight block on every row. The bound takes the slower of the two at the given rates."""
    from bench import bounds
    g = tiny[1]
    n, e = g.num_nodes(), g.num_edges()
    used = int(torch.unique(g.edges()[0]).numel())
    nbytes, macs = bounds.layer_work(models.build("gcn", 8, 4), g, 8, 4)
    assert nbytes == 4 * (used * 8 + n * 4 + 8 * 4) + 4 * e and macs == n * 8 * 4
    assert bounds.layer_work(models.build("sage", 8, 4), g, 8, 4)[1] == 2 * n * 8 * 4
    assert bounds.layer_work(models.build("tagcn", 8, 4), g, 8, 4)[1] == 3 * n * 8 * 4
    rates = {"bandwidth": {1 << 16: 100e9, 1 << 20: 50e9, 1 << 28: 10e9}, "gemm_macs": 1e9}
    assert bounds.bandwidth_for(rates, 1 << 21) == 100e9      # the fastest of smaller buffers
    assert bounds.bandwidth_for(rates, 1 << 10) == 100e9
    assert bounds.bound_seconds(rates, 1 << 30, 10) == pytest.approx((1 << 30) / 100e9)
    assert bounds.bound_seconds(rates, 10, 10 ** 9) == pytest.approx(1.0)


def test_ablation_contexts_scope_the_pool():
    from bench import ablation
    from granii.kernels import pool
    limit = pool.stats()["limit"]
    with ablation.unpooled():
        assert pool.stats()["limit"] == 0
    assert pool.stats()["limit"] == limit
    row = ablation.ratios({"dgl_ms": 4.0, "dgl_pool_ms": 2.0, "granii_ms": 1.0,
                           "granii_nopool_ms": 1.6})
    assert row["pool_gain_dgl"] == 2.0 and row["plan_gain_pooled"] == 2.0
    assert row["plan_gain_unpooled"] == 2.5 and row["pool_gain_granii"] == 1.6


def test_benchmark_levels_and_default_environment():
    """``--levels`` keeps only those size levels; the script no longer sets OMP_WAIT_POLICY."""
    import argparse
    from scripts import benchmark
    args = argparse.Namespace(quick=False, graphs="cora", parts=["layers"], models=["gcn"],
                              levels=[0])
    keys = [k for _, k, _ in benchmark.plan(args)]
    assert sorted((ki, ko) for _, _, ki, ko in keys) == [(32, 128), (128, 32)]
    text = (ROOT / "scripts" / "benchmark.py").read_text()
    assert 'setdefault("OMP_WAIT_POLICY"' not in text
