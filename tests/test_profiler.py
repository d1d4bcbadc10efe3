"""The profiling harness and training, end to end on a tiny configuration (no timing asserted)."""
import json

import pytest
import torch

from granii.fingerprint import machine_fingerprint
from granii.graph import GraphInfo
from granii.kernels import native
from granii.learned import TRAIN_GRADS, LearnedCost, load
from granii.profiling import generators as gen
from granii.profiling import points as pts
from granii.profiling import harness
from granii.profiling.generators import approx_size
from granii.profiling.harness import POINTS, done_keys, kernels_build, read_jsonl
from granii.profiling.train import add, train

GRAPHS = ["uniform:n=200,m=800,seed=0,undirected=0", "grid2d:rows=10,cols=12"]
SPMM_IMPLS = [i for p, i in pts.registered(["spmm"])][0]
N_SPMM = len(SPMM_IMPLS)


def tiny(**kw):
    cfg = dict(graphs=GRAPHS, ks=[16, 32], heads=[1], prims=["spmm", "gemm"], blocks_every=0,
               gemm_m=[64, 128], gemm_kn=[16, 32], warmup=1, repeat=2, repeat_fast=2,
               budget=0.05, max_wait=0.0, wait_budget=0.0, phases=("forward",), retries=0)
    cfg.update(kw)
    return pts.Config("tiny", **cfg)


def _quiet(*a, **k):
    pass


def profile(config, run_dir, **kw):
    """The harness at one thread: these tests check records, not times, and one thread keeps
    them fast when other processes hold the cores."""
    return harness.profile(config, run_dir, threads=1, **kw)


def _points(run_dir):
    return read_jsonl(run_dir / POINTS)


def test_end_to_end_produces_a_loadable_model(tmp_path):
    run = tmp_path / "run"
    summary = profile(tiny(), run, progress=False, log=_quiet)
    recs = _points(run)
    # 2 graphs x 2 sizes x every spmm impl + 2 x 2 x 2 gemm points
    assert len(recs) == 2 * 2 * N_SPMM + 8
    assert {r["status"] for r in recs} == {"ok"}
    assert all(r["median"] > 0 and len(r["samples"]) >= 2 and "iqr" in r for r in recs)
    assert summary["counts"]["spmm"]["ok"] == 4
    fp = machine_fingerprint()
    out = tmp_path / "models" / "this"
    manifest = train(run, out, fp, log=_quiet)
    assert set(manifest["models"]) == {f"spmm/{i}" for i in SPMM_IMPLS} | {"gemm/torch"}
    assert manifest["training_points"] == len(recs)
    entry = manifest["models"]["spmm/dgl"]
    assert entry["validation"] is not None and entry["train"]["mape"] >= 0
    model = load(out, fp)
    assert isinstance(model, LearnedCost)
    g = gen.build(GRAPHS[0])
    gi = GraphInfo(g)
    assert model.predict("spmm", "dgl", gi, {"n": gi.num_dst, "k": 24}) > 0


def test_models_of_some_primitives_are_added_to_a_folder(tmp_path):
    """``granii-init --only``: a run of some primitives replaces their models only."""
    fp = machine_fingerprint()
    full, part = tmp_path / "full", tmp_path / "part"
    profile(tiny(), full, progress=False, log=_quiet)
    before = train(full, tmp_path / "models", fp, log=_quiet)
    profile(tiny(prims=["gemm", "head_dot"], gemm_kn=[16, 32, 64], heads=[1, 4], gat_f=[8]),
            part, progress=False, log=_quiet)
    added = train(part, tmp_path / "added", fp, log=_quiet)
    after = add(tmp_path / "added", tmp_path / "models", {"mode": "tiny"})
    kept = {k for k in before["models"] if not k.startswith("gemm/")}
    assert kept and kept <= set(after["models"])
    assert all(after["models"][k] == before["models"][k] for k in kept)
    for k in added["models"]:                   # gemm replaced, head_dot new
        assert after["models"][k] == added["models"][k]
    assert {"gemm/torch", "head_dot/torch", "head_dot/native"} <= set(added["models"])
    assert after["training_points"] == sum(m["points"] for m in after["models"].values())
    assert after["run"]["added"][-1]["primitives"] == ["gemm", "head_dot"]
    model = load(tmp_path / "models", fp)       # checksums and features of every file hold
    assert model.predict("head_dot", "native", None, {"m": 500, "k": 32, "n": 4}) > 0
    again = add(tmp_path / "added", tmp_path / "models")
    assert len(again["run"]["added"]) == 1      # a repeated addition replaces the earlier one


def test_resume_skips_finished_points(tmp_path):
    run = tmp_path / "run"
    profile(tiny(), run, progress=False, log=_quiet)
    first = _points(run)
    again = profile(tiny(), run, progress=False, log=_quiet)
    assert len(_points(run)) == len(first)
    assert sum(c.get("ok", 0) for c in again["counts"].values()) == 0
    assert sum(c.get("resumed", 0) for c in again["counts"].values()) == 2 * 2 + 8

    # an interruption: the last point's lines lost, and half a line written
    lines = (run / POINTS).read_text().splitlines(keepends=True)
    last_key = json.loads(lines[-1])["key"]
    kept = [ln for ln in lines if json.loads(ln)["key"] != last_key]
    (run / POINTS).write_text("".join(kept) + lines[-1][:20])
    assert last_key not in done_keys(run)
    resumed = profile(tiny(), run, progress=False, log=_quiet)
    assert sum(c.get("ok", 0) for c in resumed["counts"].values()) == 1
    assert last_key in done_keys(run)


def test_records_of_other_kernels_are_measured_again(tmp_path):
    """A resumed run whose records came from another build of the native kernels (or from before
    builds were recorded) says so and measures every point again."""
    run = tmp_path / "run"
    profile(tiny(ks=[16]), run, progress=False, log=_quiet)
    n = len(_points(run))
    assert json.loads((run / "kernels.json").read_text())["native_kernels"] == kernels_build()
    (run / "kernels.json").write_text(json.dumps({"native_kernels": "an-older-build"}))
    said = []
    again = profile(tiny(ks=[16]), run, progress=False, log=said.append)
    assert any("other native kernels" in line and "an-older-build" in line for line in said)
    assert sum(c.get("resumed", 0) for c in again["counts"].values()) == 0
    assert len(_points(run)) == n
    (run / "kernels.json").unlink()                  # a run from before the stamp existed
    again = profile(tiny(ks=[16]), run, progress=False, log=_quiet)
    assert sum(c.get("resumed", 0) for c in again["counts"].values()) == 0


def test_no_resume_starts_over(tmp_path):
    run = tmp_path / "run"
    profile(tiny(ks=[16]), run, progress=False, log=_quiet)
    n = len(_points(run))
    profile(tiny(ks=[16]), run, resume=False, progress=False, log=_quiet)
    assert len(_points(run)) == n


def test_points_too_big_for_memory_are_recorded_and_skipped(tmp_path):
    run = tmp_path / "run"
    summary = profile(tiny(mem_fraction=1e-12), run, progress=False, log=_quiet)
    recs = _points(run)
    assert recs and {r["status"] for r in recs} == {"skipped_memory"}
    assert all("GiB" in r["reason"] and "median" not in r for r in recs)
    assert summary["counts"]["gemm"]["skipped_memory"] == 8
    again = profile(tiny(mem_fraction=1e-12), run, progress=False, log=_quiet)
    assert sum(c.get("skipped_memory", 0) for c in again["counts"].values()) == 0


def test_slow_points_are_recorded_and_skipped(tmp_path):
    run = tmp_path / "run"
    profile(tiny(max_call=0.0, prims=["spmm"], graphs=GRAPHS[:1]), run, progress=False,
            log=_quiet)
    by_size = {r["sizes"]["k"]: r["status"] for r in _points(run)}
    assert by_size == {16: "skipped_slow", 32: "skipped_slow"}


def test_contended_points_are_retried_on_request(tmp_path):
    run = tmp_path / "run"
    profile(tiny(prims=["gemm"], gemm_m=[64], gemm_kn=[16]), run, progress=False, log=_quiet)
    rec = _points(run)[0]
    rec["contended"] = True
    (run / POINTS).write_text(json.dumps(rec) + "\n")
    assert rec["key"] in done_keys(run)
    assert rec["key"] not in done_keys(run, retry_contended=True)
    profile(tiny(prims=["gemm"], gemm_m=[64], gemm_kn=[16]), run, progress=False, log=_quiet,
            retry_contended=True)
    assert len(_points(run)) == 2


def test_points_whose_rounds_disagree_are_retried_and_not_trained_on(tmp_path):
    """A median far above the fastest round is waiting for the cores, not the kernel."""
    from granii.profiling.train import usable
    run = tmp_path / "run"
    profile(tiny(prims=["gemm"], gemm_m=[64], gemm_kn=[16]), run, progress=False, log=_quiet)
    rec = _points(run)[0]
    assert not harness.unsettled(rec)
    rec.update(median=0.012, min=0.0003, samples=[0.0003, 0.012, 0.012], contended=False)
    assert harness.unsettled(rec)
    (run / POINTS).write_text(json.dumps(rec) + "\n")
    assert rec["key"] in done_keys(run)
    assert rec["key"] not in done_keys(run, retry_contended=True)
    steady = dict(rec, key="other", median=0.012, min=0.011)
    rows, _ = usable([rec] * 8 + [steady] * 8, rec["prim"], rec["impl"])
    assert rows == [steady] * 8


def test_block_jobs_rebuild_from_their_names():
    cfg = tiny(graphs=["grid2d:rows=10,cols=12"], blocks_every=1)
    jobs = pts.graph_jobs(cfg)
    assert len(jobs) == 2 and jobs[1][1] == jobs[0][0]
    name = jobs[1][0]
    base = gen.build(jobs[0][0])
    params = gen.parse_name(name)[1]
    params.pop("base")
    a, b = gen.sample_subgraph(base, **params), gen.build(name)
    assert a.is_block and (a.num_src_nodes(), a.num_dst_nodes(), a.num_edges()) == \
        (b.num_src_nodes(), b.num_dst_nodes(), b.num_edges())


def test_configs_cover_the_registry():
    quick, full = pts.quick_config(), pts.full_config()
    assert len(quick.graphs) < len(full.graphs)
    prims = {p for p, _ in pts.registered(full.prims)}
    assert {"gemm", "row_scale", "spmm", "spmm_weighted", "sddmm_scale"} <= prims
    assert max(full.ks) == 1024 and min(full.ks) == 16 and full.phases == ("forward", "train")
    for name, _ in pts.graph_jobs(quick):
        nodes, edges = approx_size(name)
        assert nodes > 0 and edges > 0


ALL_GRAPH_PRIMS = ["spmm", "spmm_weighted", "sddmm_scale", "sddmm_add", "edge_softmax",
                   "spmm_heads", "spmm_mean", "spmm_max", "spmm_norm", "gat_aggregate"]


@pytest.mark.parametrize("prim", ALL_GRAPH_PRIMS)
def test_inputs_run_every_implementation(prim):
    g = gen.build(GRAPHS[0])
    gi = GraphInfo(g)
    sizes = pts.graph_sizes(prim, tiny(ks=[8], heads=[2], gat_f=[4]))[0]
    impls = [i for p, i in pts.registered([prim])][0]
    outs = {i: fn() for i, fn in pts.runners(prim, gi, sizes, impls).items()}
    first = next(iter(outs.values()))
    for out in outs.values():
        assert out.shape == first.shape
        torch.testing.assert_close(out, first, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prim", [p for p in ALL_GRAPH_PRIMS if TRAIN_GRADS[p]] + ["gemm"])
def test_training_calls_return_the_gradients_the_step_needs(prim):
    """A training-phase call is the forward and the backward of the operands TRAIN_GRADS names;
    every implementation gives the same gradients (those whose backward fails are reported by
    the harness as errors and left out, see test_a_failing_implementation_...)."""
    g = gen.build(GRAPHS[0])
    gi = None if prim == "gemm" else GraphInfo(g)
    sizes = ({"m": 50, "k": 8, "n": 4} if prim == "gemm" else
             pts.graph_sizes(prim, tiny(ks=[8], heads=[2], gat_f=[4]))[0])
    impls = [i for p, i in pts.registered([prim])][0]
    fns = pts.runners(prim, gi, sizes, impls, phase="train")
    grads = {}
    for i, fn in fns.items():
        try:
            grads[i] = fn()
        except RuntimeError:
            continue
    assert grads, "no implementation computes the backward"
    first = next(iter(grads.values()))
    assert len(first) == len(TRAIN_GRADS[prim])
    for gs in grads.values():
        for a, b in zip(gs, first):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_per_head_points_compute_the_per_head_products():
    """``head_gemm``'s profiled call is ``Y[:, h] = Z[:, h] W_h`` (with the gradients of ``Z`` and
    ``W`` in training) and ``spmm_heads``' the sum per head of the shared features; their grids
    have several heads only, and the quick run leaves them out."""
    config = tiny(ks=[8], heads=[1, 2], gat_f=[4], gemm_m=[30], gemm_kn=[8])
    sizes = pts.dense_points("head_gemm", config)
    assert sizes == [{"m": 30, "k": 8, "heads": 2, "n": 8}]
    z, w = pts.dense_inputs("head_gemm", sizes[0])
    want = torch.einsum("mhk,khf->mhf", z, w.reshape(8, 2, 4)).reshape(30, 8)
    torch.testing.assert_close(pts.runners("head_gemm", None, sizes[0], ["torch"])["torch"](), want)
    dz, dw = pts.runners("head_gemm", None, sizes[0], ["torch"], phase="train")["torch"]()
    zz, ww = z.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    ref = torch.autograd.grad(torch.einsum("mhk,khf->mhf", zz, ww.reshape(8, 2, 4)).reshape(30, 8),
                              (zz, ww), dy)
    torch.testing.assert_close((dz, dw), ref)
    g = gen.build(GRAPHS[0])
    gi = GraphInfo(g)
    assert pts.graph_sizes("spmm_heads", config) == [{"heads": 2, "k": 8}]
    w_e, x = pts.graph_inputs("spmm_heads", gi, {"heads": 2, "k": 8})
    src, dst = gi.edges()
    want = torch.zeros(gi.num_dst, 2, 8).index_add_(0, dst.long(),
                                                   w_e[:, :, None] * x[src.long(), None])
    for fn in pts.runners("spmm_heads", gi, {"heads": 2, "k": 8}, ["native", "dgl"]).values():
        torch.testing.assert_close(fn(), want, rtol=1e-4, atol=1e-4)
    assert not set(pts.PER_HEAD) & set(pts.quick_config().prims)


def test_training_phase_is_profiled_and_trained(tmp_path):
    run = tmp_path / "run"
    summary = profile(tiny(phases=("forward", "train"), prims=["spmm", "gemm", "sddmm_scale"]),
                      run, progress=False, log=_quiet)
    recs = _points(run)
    train_recs = [r for r in recs if r["phase"] == "train"]
    assert train_recs and all(r["key"].endswith("|train") for r in train_recs)
    # sddmm_scale has no operand needing a gradient: no training points
    assert {r["prim"] for r in train_recs} == {"spmm", "gemm"}
    assert summary["counts"]["spmm/train"]["ok"] == 4
    manifest = train(run, tmp_path / "models", machine_fingerprint(), log=_quiet)
    assert {"spmm/dgl/train", "gemm/torch/train", "spmm/dgl"} <= set(manifest["models"])
    assert "sddmm_scale/dgl/train" not in manifest["models"]
    model = load(tmp_path / "models", machine_fingerprint())
    assert model.has_model("spmm", "dgl", "train") and model.has_model("gemm", "torch", "train")
    g = gen.build(GRAPHS[0])
    gi = GraphInfo(g)
    assert model.predict_train("spmm", "dgl", gi, {"n": gi.num_dst, "k": 16}) > 0
    assert model.predict_train("sddmm_scale", "dgl", gi, {}) is None


def test_a_failing_implementation_is_recorded_and_the_others_measured(tmp_path, monkeypatch):
    from granii.kernels import registry

    def broken(gi, x):
        raise RuntimeError("this kernel is broken")
    monkeypatch.setitem(registry.REGISTRY["spmm"], "broken", broken)
    run = tmp_path / "run"
    profile(tiny(prims=["spmm"], graphs=GRAPHS[:1], ks=[16]), run, progress=False, log=_quiet)
    by_impl = {r["impl"]: r for r in _points(run)}
    assert by_impl["broken"]["status"] == "error" and "broken" in by_impl["broken"]["reason"]
    assert by_impl["dgl"]["status"] == "ok" and by_impl["dgl"]["median"] > 0


def test_time_limit_stops_early_and_a_resumed_run_continues(tmp_path):
    run = tmp_path / "run"
    summary = profile(tiny(), run, progress=False, log=_quiet, time_limit=0.0)
    assert summary["stopped_early"] and not _points(run)
    summary = profile(tiny(), run, progress=False, log=_quiet)
    assert not summary["stopped_early"] and len(_points(run)) == 2 * 2 * N_SPMM + 8


def test_quick_config_profiles_every_registered_pair():
    quick = pts.quick_config()
    prims = dict(pts.registered(quick.prims))
    assert {"spmm_norm", "gat_aggregate"} <= set(prims)
    from granii import kernels
    from granii.costmodel import PRICED_AS
    for prim, impls in prims.items():       # every pair, except those priced as another
        assert impls == [i for i in kernels.implementations(prim) if (prim, i) not in PRICED_AS]
        assert impls
    assert quick.phases == ("forward", "train") and quick.max_wait == 0
    sizes = pts.graph_sizes("gat_aggregate", quick)
    assert all(s["k"] % s["heads"] == 0 for s in sizes)


def test_shipped_models_price_every_profiled_pair():
    """Each shipped folder made by the current profiler (its fingerprint names the vector
    extension) has a model for every (primitive, implementation) a full profile measures: a
    kernel added later and profiled on one machine only leaves the other machines' plans using
    it priced by transfer. ``granii-init --only <primitive>`` fills the gap."""
    from pathlib import Path
    shipped = Path(__file__).resolve().parent.parent / "costmodels"
    pairs = {f"{p}/{i}" for p, impls in pts.registered(pts.full_config().prims) for i in impls}
    folders = [json.loads(m.read_text()) for m in sorted(shipped.glob("*/manifest.json"))]
    current = [m for m in folders if "isa" in m["fingerprint"]]
    assert len(current) >= 2
    for manifest in current:
        missing = sorted(pairs - set(manifest["models"]))
        assert not missing, f"costmodels/{manifest['fingerprint_id']} lacks {missing}"


def test_only_names_profiled_primitives_and_needs_a_model_folder(tmp_path):
    from granii.profiling.init_machine import main
    with pytest.raises(SystemExit, match="no profiled primitive nonesuch"):
        main(["--only", "nonesuch", "--out", str(tmp_path), "--runs", str(tmp_path)])
    with pytest.raises(SystemExit, match="without --only first"):
        main(["--only", "head_dot", "--out", str(tmp_path), "--runs", str(tmp_path)])
    assert not any(tmp_path.iterdir())          # nothing profiled, nothing written


def test_the_contention_probe_runs_in_torchs_thread_pool(monkeypatch):
    """The probe's product is granii's kernel (or torch's CSR product), never DGL's, whose
    OpenMP runtime slowed the narrow GEMMs measured after each probe; it computes ``A X``."""
    import dgl

    def refused(*args, **kwargs):
        raise AssertionError("the probe ran a DGL kernel")
    monkeypatch.setattr(dgl.ops, "copy_u_sum", refused)
    probe = harness.Probe()
    g = gen.uniform(2000, 16000, seed=1)
    x = torch.randn(2000, 32, generator=torch.Generator().manual_seed(0))
    u, v = g.edges()
    want = torch.zeros(2000, 32).index_add_(0, v, x[u])
    torch.testing.assert_close(probe.fn().reshape(2000, 32), want, atol=1e-4, rtol=1e-4)
    assert probe.seconds() > 0


@pytest.mark.skipif(not native.AVAILABLE, reason="native kernels not built")
@pytest.mark.parametrize("phase", ["forward", "train"])
def test_profiled_timings_run_no_operator_of_an_untimed_file(phase):
    """The models record the hash of the kernel files their timings ran (``kernels/sources.py``):
    every profiled call, after the warm-up call the harness makes, runs operators of timed files
    only, so ``UNTIMED`` may change without voiding them."""
    import re
    from granii.kernels import sources
    owner = {name: p.name for p in native.CSRC.glob("*.cpp")
             for name in re.findall(r'm\.def\(\s*"(\w+)\(', p.read_text())}
    assert owner["coo_to_csr"] == "csr.cpp" and owner["sddmm_add_coo"] == "gat.cpp"
    config = tiny(ks=[8], heads=[2], gat_f=[4], row_n=[50], row_k=[8],
                  prims=pts.GRAPH_PRIMS + pts.DENSE_PRIMS)
    g = gen.build(GRAPHS[0])
    ran = set()
    for prim, impls in pts.registered(config.prims):
        if not pts.has_phase(prim, phase):
            continue
        dense = prim in pts.DENSE_PRIMS
        gi = None if dense else GraphInfo(g)
        sizes = (pts.dense_points(prim, config) if dense else pts.graph_sizes(prim, config))[0]
        for impl, fn in pts.runners(prim, gi, sizes, impls, phase=phase).items():
            try:
                fn()                              # the harness's warm-up: indices built
            except RuntimeError:
                continue                          # no backward: not profiled in training
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                fn()
            ops = {e.name.split("::", 1)[1] for e in p.events() if e.name.startswith("granii::")}
            ran |= ops
            untimed = {op: owner[op] for op in ops if owner.get(op) in sources.UNTIMED}
            assert not untimed, f"{prim}/{impl} ({phase}) runs {untimed}"
    assert "spmm_csr" in ran
