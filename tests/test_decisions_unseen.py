"""The study of granii's decisions on unseen graphs (``bench/decisions_unseen.py``): its graph
families, its check that they are unseen, and its scoring."""
import math

import numpy as np
import pytest
import torch

from bench import decisions_unseen as du


def _edges(g):
    u, v = g.edges()
    return sorted(zip(u.tolist(), v.tolist()))


@pytest.mark.parametrize("name", [s.name for s in du.unseen_graphs()])
def test_graphs_are_seeded_and_simple(name):
    spec = next(s for s in du.unseen_graphs() if s.name == name)
    a, b = spec.factory(), spec.factory()
    assert _edges(a) == _edges(b)
    u, v = a.edges()
    assert not bool((u == v).any())                                  # no self-loops
    key = u * a.num_nodes() + v
    assert len(torch.unique(key)) == len(key)                        # no duplicate edges
    assert 2000 <= a.num_nodes() <= 60000


def test_family_shapes():
    g = du.knn(500, 7, seed=3)
    assert set(g.in_degrees().tolist()) == {7}                       # exactly k in-edges
    assert g.out_degrees().max() > 7
    p = du.price(3000, 3, seed=1)
    assert p.out_degrees().max() <= 3
    deg = p.in_degrees().float()
    assert deg.max() > 20 * deg.mean()                               # heavy-tailed in-degree
    k = du.kron3(5, 4, seed=0)
    assert k.num_nodes() == 3 ** 5
    w = du.ws(1000, 6, 0.0)
    assert set(w.in_degrees().tolist()) == {6}                        # the ring, unrewired
    sw = du.swgrid(20, 30, q=2, seed=0)
    assert sw.num_nodes() == 600 and sw.in_degrees().min() >= 2
    assert not bool(torch.equal(du.knn(500, 7, seed=3).edges()[0],
                                du.knn(500, 7, seed=4).edges()[0]))   # the seed matters


def test_dcsbm_keeps_most_edges_inside_blocks():
    rng = np.random.default_rng(0)
    g = du.dcsbm(4000, 10, 10, mix=0.9, seed=rng.integers(100))
    u, v = (t.numpy() for t in g.edges())
    # blocks are contiguous id ranges: an edge inside a block joins near ids far more often
    # than uniform pairs (|u - v| < n / 10 for about a fifth of uniform pairs)
    assert np.mean(np.abs(u - v) < 400) > 0.5


def test_unseen_check_flags_a_known_graph():
    """The check is not vacuous: a graph with the signature of a known one is flagged, and the
    study's families are none of the corpus's."""
    specs = du.unseen_graphs(quick=True)
    graphs = [s.factory() for s in specs]
    known = {"other": (1, 2, (0, 1)), "twin": du._signature(graphs[1])}
    lines, clashes = du.unseen_report(specs, graphs, known)
    assert clashes == [(specs[1].name, "twin")]
    assert "shared: none" in lines[0]
    lines, clashes = du.unseen_report(specs, graphs, {"other": (1, 2, (0, 1))})
    assert clashes == []


def _row(graph, t, tuned, model_pick, sizes=(32, 256)):
    return dict(graph=graph, family="f", nodes=1, edges=1, model="gcn", k_in=sizes[0],
                k_out=sizes[1], mode="inference", fastest=min(t, key=t.get), tuned=tuned,
                model_pick=model_pick, fastest_in_trial=True, trial_ratio=1.0, noise=1.0,
                settle_calls=1, others_cores=0.0, granii_ms=1e3 * t[tuned], _t=t,
                trial=" || ".join(k for k in t if k != du.DGL))


def _details(rows):
    return [dict(graph=r["graph"], model=r["model"], k_in=r["k_in"], k_out=r["k_out"],
                 mode=r["mode"], candidate=k, steady_ms=v, predicted_ms=1.0)
            for r in rows for k, v in r.pop("_t").items()]


def test_fixed_rules_leave_the_scored_graph_out():
    """A fixed rule is fitted on the other graphs only: plan ``a`` is fastest on g1 and g2, ``b``
    on g3, so g3's fixed rule picks ``a`` (regret 2); g1's, fitted on g2 and g3, picks ``b``
    (regrets 1.5 and 1, against ``a``'s 1 and 2)."""
    rows = [_row("g1", {"a": 1.0, "b": 1.5, du.DGL: 3.0}, "a", "b"),
            _row("g2", {"a": 1.0, "b": 1.5, du.DGL: 3.0}, "b", "b"),
            _row("g3", {"a": 2.0, "b": 1.0, du.DGL: 3.0}, du.DGL, "a")]
    recs = {r["graph"]: r for r in du.score(rows, _details(rows))}
    assert recs["g3"]["fixed_per_layer_pick"] == "a"
    assert recs["g3"]["fixed per layer"] == pytest.approx(2.0)
    assert recs["g1"]["fixed_per_layer_pick"] == "b"            # fitted on g2 and g3
    assert recs["g1"]["fixed per layer"] == pytest.approx(1.5)
    assert recs["g2"]["granii + tie-break"] == pytest.approx(1.5)
    assert recs["g3"]["granii + tie-break"] == pytest.approx(3.0)   # kept DGL's layer
    assert recs["g3"]["granii, model only"] == pytest.approx(2.0)
    assert recs["g1"]["DGL layer"] == pytest.approx(3.0)
    lines = du.summary_lines(list(recs.values()))
    assert len(lines) == 4 and lines[2].startswith("| gcn | inference | 3 |")
    assert math.isclose(du.geomean([1.0, 4.0]), 2.0)


def test_kept_reads_the_plan_a_layer_runs():
    """``kept`` names the plan (and implementations) the dispatcher ran on its last call: the
    cost model's pick without the tie-break, and DGL's layer as ``None``."""
    from dgl.nn import GraphConv

    from granii import granii
    from granii.runtime.dispatch import layer_states
    g = du.knn(300, 4, seed=0)
    x = torch.randn(300, 8)
    layer = GraphConv(8, 16, norm="both").eval()
    with torch.no_grad():
        granii(layer, g, x, tune=False)
        layer(g, x)
    st = layer_states(layer)[0]
    index, impls, label = du.kept(layer)
    assert st.last[2].plan.index == du._plan_index(st, index)
    assert impls == tuple(st.last[2].impls)
    assert du._key([st.last[2].plan], index, impls).endswith(",".join(impls))


def test_copies_of_one_steady_work_count_as_one():
    """Two candidates that run the same work on every call (they differ in work kept between
    calls) get the mean of their times: the fastest is not the luckier copy."""
    rows = [_row("g1", {"a": 1.0, "a2": 1.4, "b": 1.3, du.DGL: 3.0}, "a2", "b")]
    details = _details(rows)
    for d in details:
        d["steady"] = {"a": "w", "a2": "w"}.get(d["candidate"], d["candidate"])
    rec = du.score(rows, details)[0]
    assert rec["granii + tie-break"] == pytest.approx(1.2 / 1.2)
    assert rec["granii, model only"] == pytest.approx(1.3 / 1.2)


def test_copies_of_one_steady_work_pool_their_rounds():
    """With rounds recorded, copies of one steady work get the median of all their rounds: one
    copy the machine slowed in every round moves it by a round, not by a third of its delay."""
    rows = [_row("g1", {"a": 1.0, "a2": 1.1, "a3": 4.0, "b": 1.3, du.DGL: 3.0}, "a3", "b")]
    details = _details(rows)
    rounds = {"a": (1.0, 0.9, 1.2), "a2": (1.1, 1.05, 1.3), "a3": (4.0, 3.9, 4.2),
              "b": (1.3, 1.2, 1.4), du.DGL: (3.0, 3.1, 2.9)}
    for d in details:
        d["steady"] = {"a": "w", "a2": "w", "a3": "w"}.get(d["candidate"], d["candidate"])
        d["samples_ms"] = ";".join(str(v) for v in rounds[d["candidate"]])
    rec = du.score(rows, details)[0]
    assert rec["fastest"] in ("a", "a2", "a3")
    assert rec["granii + tie-break"] == pytest.approx(1.0)          # the copies are one
    assert rec["granii, model only"] == pytest.approx(1.3 / 1.2)    # b against their 1.2


def test_steady_work_of_fixed_features():
    """On fixed features GraphConv's aggregation is kept between calls when it is done first:
    then every such plan runs one GEMM per call, whatever kernel aggregated."""
    from dgl.nn import GraphConv

    from granii.runtime.bind import prepare
    from granii.runtime.state import new_state
    g = du.knn(300, 4, seed=0)
    x = torch.randn(300, 8)
    layer = GraphConv(8, 16, norm="both").eval()
    with torch.no_grad():
        call = prepare(new_state(layer), layer, (g, x), {})
    works = {}
    for plan in call.compiled.plans:
        impls = tuple("torch" if s.sig is not None else "inline" for s in plan.steps)
        works.setdefault(du.steady_work(plan, impls), []).append(plan.composition())
    first = [w for w, comps in works.items() if all(c.endswith("gemm") for c in comps)]
    assert first and "'gemm'" in first[0] and "spmm" not in first[0]
    assert len(works) >= 2                      # multiplying first aggregates on every call
    # the native GEMM is torch's on these dense features: the same work under either name
    for plan in call.compiled.plans:
        torch_impls = tuple("torch" if s.sig is not None else "inline" for s in plan.steps)
        native = tuple("native" if s.prim == "gemm" else i for s, i in zip(plan.steps,
                                                                            torch_impls))
        assert du.steady_work(plan, native) == du.steady_work(plan, torch_impls)


def test_emulated_tie_break_judges_its_own_candidates():
    """The replay picks among a setting's candidates and DGL's layer only: with plan ``a``
    outside the narrow set the narrow setting keeps ``b``; DGL's layer stays unless a plan is
    5% faster."""
    import json
    t = {"a": 1.0, "b": 1.5, du.DGL: 1.52}
    rows = [_row("g1", dict(t), "b", "b")]
    rows[0]["trial_sets"] = json.dumps({"1.3/2": ["b"], "1.5/3": ["a", "b"]})
    details = _details(rows)
    for d in details:
        d["samples_ms"] = ";".join(str(t[d["candidate"]] * f) for f in (1.0, 1.1, 3.0))
    du.score(rows, details)
    got = du.emulate(rows, details, sets=(("1.3/2", "min", 3), ("1.5/3", "median", 3)))
    assert got[("1.3/2", "min", 3)] == [("gcn", "inference", pytest.approx(1.52))]  # b not 5%
    assert got[("1.5/3", "median", 3)] == [("gcn", "inference", pytest.approx(1.0))]
    assert du.emulate_lines(got)[2].startswith("| 1.3/2 | min of 3 | 1.520 / 1.52")


def test_emulated_tie_break_keeps_the_model_pick_unless_beaten_below_its_fastest_round():
    """As ``Trial.winner``: the set's first plan (the model's pick) gives way to a faster median
    only when that median is below the first's fastest round."""
    import json
    rounds = {"p": (1.0, 3.0, 3.1), "o": (2.0, 2.0, 2.1), du.DGL: (9, 9, 9)}
    t = {k: sorted(v)[1] for k, v in rounds.items()}
    rows = [_row("g1", dict(t), "p", "p")]
    rows[0]["trial_sets"] = json.dumps({"1.3/2": ["p", "o"]})
    details = _details(rows)
    for d in details:
        d["samples_ms"] = ";".join(str(v) for v in rounds[d["candidate"]])
    du.score(rows, details)
    got = du.emulate(rows, details, sets=(("1.3/2", "median", 3),))
    assert got[("1.3/2", "median", 3)] == [("gcn", "inference", pytest.approx(3.0 / 2.0))]
    rounds["p"] = (2.5, 3.0, 3.1)                    # now o's median beats p's fastest
    for d in details:
        d["samples_ms"] = ";".join(str(v) for v in rounds[d["candidate"]])
    got = du.emulate(rows, details, sets=(("1.3/2", "median", 3),))
    assert got[("1.3/2", "median", 3)] == [("gcn", "inference", pytest.approx(1.0))]


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """``calibration.measure`` returning the queued reference times (no timing), the cache under
    ``tmp_path``, no pauses."""
    from granii import calibration
    queue = []

    def measure(repeat=7):
        return dict(queue.pop(0))
    monkeypatch.setattr(calibration, "measure", measure)
    monkeypatch.setattr(calibration, "QUIET_PAUSE", 0.0)
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path))
    return queue


QUIET = {"stream": 2e-3, "gemm": 5e-3, "sparse": 4e-3, "small": 1e-4}
BUSY = {"stream": 30e-3, "gemm": 25e-3, "sparse": 59e-3, "small": 24e-3}   # this machine, loaded


def test_a_calibration_measured_under_load_is_not_used(measured, monkeypatch):
    """Every try contended (the small reference call far beyond its time alone): no times, so
    transferred models price calls unscaled; processes take that verdict for ``BUSY_AGAIN``
    seconds without measuring, then measure again and keep a quiet calibration."""
    from granii import calibration
    fp = {"cpu_model": "x", "isa": "y", "threads": 2}
    measured += [BUSY] * calibration.QUIET_TRIES
    cal = calibration.this_machine(fp)
    assert cal["times"] == {} and cal["contended"] == BUSY and not measured
    tr = calibration.Transfer({k: v / 3 for k, v in QUIET.items()}, cal["times"])
    assert tr.scale("spmm", 1e-3) == 1e-3 and tr.scale("gemm", 1e-5) == 1e-5
    assert calibration.this_machine(fp)["times"] == {}             # no measurement made
    monkeypatch.setattr(calibration, "BUSY_AGAIN", 0.0)            # later: measured again
    measured += [BUSY, QUIET]
    cal = calibration.this_machine(fp)
    assert cal["times"] == QUIET and not measured
    assert calibration.this_machine(fp)["times"] == QUIET          # read back from the cache


def test_a_cached_calibration_measured_under_load_is_measured_again(measured):
    """A calibration cached before the check, with a contended small call, is not read back."""
    import json

    from granii import calibration
    from granii.fingerprint import fingerprint_id
    fp = {"cpu_model": "x", "isa": "y", "threads": 2}
    path = calibration.cache_dir() / f"calibration-{fingerprint_id(fp)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": calibration.FORMAT, "times": BUSY}))
    measured.append(QUIET)
    assert calibration.this_machine(fp)["times"] == QUIET and not measured
    assert json.loads(path.read_text())["times"] == QUIET


def test_a_calibration_while_others_use_the_cores_is_not_kept(measured, monkeypatch):
    """A short small call can fall between other processes' turns while the long calls do not:
    other processes' CPU use during the measurement (``/proc/stat``) counts too; and a cached
    calibration written before that check is measured again."""
    import json

    from granii import calibration
    from granii.fingerprint import fingerprint_id
    fp = {"cpu_model": "x", "isa": "y", "threads": 2}
    load = iter([3.0, 3.0, 0.1])            # cores used by others during each measurement

    def with_others():
        return calibration.measure(), next(load)
    monkeypatch.setattr(calibration, "_measure_with_others", with_others)
    monkeypatch.setattr(calibration, "_spare_cores", lambda: 0.5)
    measured += [QUIET, QUIET]
    cal = calibration.this_machine(fp)
    assert cal["times"] == {} and cal["contended"] == QUIET
    path = calibration.cache_dir() / f"calibration-{fingerprint_id(fp)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {"format": calibration.FORMAT, "times": {**QUIET, "gemm": 6 * QUIET["gemm"]}}
    path.write_text(json.dumps(old))                  # no others_cores: before the check
    measured.append(QUIET)
    cal = calibration.this_machine(fp)
    assert cal["times"] == QUIET and cal["others_cores"] == 0.1
    assert calibration.this_machine(fp)["times"] == QUIET


def test_others_cores_are_read_from_the_machine():
    """``_measure_with_others`` reports a number of cores (0 when the measurement is too short
    to tell)."""
    from granii import calibration
    busy, own = calibration._busy_seconds()
    assert own > 0 and (busy is None or busy >= 0)
    assert calibration._spare_cores() >= 0.5
