"""The store of pure work across processes (``granii.diskcache``): enumerated plans keyed by the
IR's stable text, compiled code keyed by its source. What a stored value replaces must be what
computing it gives; keys must tell apart what differs; a damaged or absent store is a miss.
(That a fresh process reads the store instead of computing: ``test_first_call.py``.)"""
import marshal
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

from granii import diskcache, ir
from granii.frontend import lower_layer
from granii.frontend.udf import WithArgs
from granii.plan import compile_plan, default_impls, plan_code
from granii.runtime import variants


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty store of this test's own, and no enumeration kept in this process."""
    monkeypatch.setenv("GRANII_CACHE", str(tmp_path))
    monkeypatch.delenv("GRANII_DISK_CACHE", raising=False)
    monkeypatch.setattr(variants, "_ENUMERATED", {})
    monkeypatch.setattr(diskcache, "_CODE", {})
    return tmp_path


def _dgl_layers():
    from dgl.nn import GATConv, GINConv, GraphConv, SAGEConv, TAGConv
    return {
        "gcn": GraphConv(8, 4, allow_zero_in_degree=True),
        "gcn-right": GraphConv(8, 4, norm="right", allow_zero_in_degree=True),
        "gcn-relu": GraphConv(8, 4, activation=F.relu, allow_zero_in_degree=True),
        "gcn-wide": GraphConv(8, 6, allow_zero_in_degree=True),
        "gat": GATConv(8, 4, 1, allow_zero_in_degree=True),
        "gat-2": GATConv(8, 4, 2, allow_zero_in_degree=True),
        "gat-slope": GATConv(8, 4, 1, negative_slope=0.3, allow_zero_in_degree=True),
        "sage": SAGEConv(8, 4, "mean"),
        "sage-gcn": SAGEConv(8, 4, "gcn"),
        "gin": GINConv(torch.nn.Linear(8, 4), "sum"),
        "tag": TAGConv(8, 4, k=2),
    }


def _lowered(layer):
    """``lower_layer`` on a small graph (SAGE's forward branches on the graph's edges)."""
    import dgl
    g = dgl.graph(([0, 1, 2, 3], [1, 2, 3, 0]))
    return lower_layer(layer, frozenset(), False,
                       {"graph": g, "feat": torch.randn(4, 8), "self": layer})


def test_stable_text_names_equal_irs_alike_and_different_ones_apart():
    layers = _dgl_layers()
    irs = {name: _lowered(layer) for name, layer in layers.items()}
    again = {name: _lowered(layer) for name, layer in _dgl_layers().items()}
    texts = {name: ir.stable_text((lir.root, lir.heads)) for name, lir in irs.items()}
    for name, lir in again.items():         # another instance of each: the same text
        assert ir.stable_text((lir.root, lir.heads)) == texts[name], name
    for a in irs:
        for b in irs:
            same_ir = (irs[a].root, irs[a].heads) == (irs[b].root, irs[b].heads)
            assert (texts[a] == texts[b]) == same_ir, (a, b)
    assert len(set(texts.values())) > 8     # the configurations above lower differently


def test_stable_text_names_functions_by_where_they_are_found():
    assert ir.stable_text(F.relu) == "fn:torch.nn.functional:relu"
    assert ir.stable_text(torch.relu) == "fn:torch:relu"
    assert ir.stable_text(torch.relu) != ir.stable_text(torch.tanh)
    slope = ir.stable_text(WithArgs(F.leaky_relu, (), {"negative_slope": 0.2}))
    assert slope != ir.stable_text(WithArgs(F.leaky_relu, (), {"negative_slope": 0.3}))
    assert "0.2" in slope
    for unstable in (lambda x: x, torch.nn.ReLU(), object()):
        with pytest.raises(ir.Unstable):
            ir.stable_text(ir.Apply("f", ir.Leaf("H", "N", "k", "dense", "data", ("arg", "h")),
                                    ("function", unstable)))

    def local(x):
        return x
    with pytest.raises(ir.Unstable):
        ir.stable_text(local)


def test_stored_plans_are_the_plans_enumeration_gives(store, monkeypatch):
    layers = _dgl_layers()
    computed = {}
    for name, layer in layers.items():
        lir = _lowered(layer)
        computed[name] = variants._stored_enumeration(lir, name)
        assert not isinstance(computed[name], Exception), name
    assert len(list((store / "plans").iterdir())) == len(
        {ir.stable_text((_lowered(l).root, _lowered(l).heads)) for l in layers.values()})

    def boom(*a, **k):
        raise AssertionError("enumerated again")
    monkeypatch.setattr(variants, "_enumerate", boom)
    for name, layer in layers.items():
        read = variants._stored_enumeration(_lowered(layer), name)
        assert read == computed[name], name
        for got, want in zip(read[1], computed[name][1]):
            impls = default_impls(got)
            assert plan_code(got, impls) == plan_code(want, impls)
            compile_plan(got, impls)


def test_a_damaged_store_is_computed_again_and_rewritten(store):
    from dgl.nn import GraphConv
    lir = lower_layer(GraphConv(8, 4))
    want = variants._stored_enumeration(lir, "gcn")
    (path,) = (store / "plans").iterdir()
    path.write_bytes(b"not a pickle")
    assert variants._stored_enumeration(lir, "gcn") == want
    assert pickle.loads(path.read_bytes()) == want


def test_what_is_not_stored(store, monkeypatch):
    import dataclasses
    from dgl.nn import GraphConv, TAGConv
    lir = lower_layer(GraphConv(8, 4))
    clipped = dataclasses.replace(lir, root=ir.Apply("clip", lir.root,
                                                     ("function", lambda x: x.clamp(min=0))))
    assert not isinstance(variants._stored_enumeration(clipped, "gcn"), Exception)
    assert not (store / "plans").exists()             # a lambda: no stable text
    monkeypatch.setenv("GRANII_DECISION_BUDGET", "1e-9")
    done = variants._stored_enumeration(lower_layer(TAGConv(6, 3, k=3)), "tag")
    assert "decision budget" in done[4]
    assert not (store / "plans").exists()             # a search its budget cut short
    monkeypatch.delenv("GRANII_DECISION_BUDGET")
    with monkeypatch.context() as m:
        def broken(plan):
            raise RuntimeError("no fusion")
        m.setattr(variants, "fused_variants", broken)
        with pytest.warns(UserWarning, match="fusing the plans of gcn failed"):
            done = variants._stored_enumeration(_lowered(GraphConv(8, 4)), "gcn")
        assert "fusing the plans failed" in done[4] and done[1]
    assert not (store / "plans").exists()             # plans a failed fusion left short
    with monkeypatch.context() as m:
        m.setattr(diskcache, "stamp", lambda *modules: None)
        variants._stored_enumeration(lower_layer(GraphConv(8, 4)), "gcn")
    assert not (store / "plans").exists()             # code without source files to stamp
    monkeypatch.setenv("GRANII_DISK_CACHE", "0")
    variants._stored_enumeration(lower_layer(GraphConv(8, 4)), "gcn")
    assert not (store / "plans").exists()             # turned off


def test_compiled_code_is_what_compile_gives_and_is_read_back(store, monkeypatch):
    src = "def f(x):\n    return x * 2 + 1\n"
    code = diskcache.compiled(src, "<test>")
    want = compile(src, "<test>", "exec")
    assert marshal.dumps(code) == marshal.dumps(want)
    monkeypatch.setattr(diskcache, "_CODE", {})

    def boom(*a):
        raise AssertionError("compiled again")
    monkeypatch.setattr(diskcache, "compile", boom, raising=False)
    ns = {}
    exec(diskcache.compiled(src, "<test>"), ns)
    assert ns["f"](3) == 7
    with pytest.raises(AssertionError, match="compiled again"):   # another name: another key
        diskcache.compiled(src, "<other>")
    monkeypatch.undo()
    monkeypatch.setenv("GRANII_CACHE", str(store))
    for path in (store / "code").iterdir():
        path.write_bytes(b"\x00 damaged")
    monkeypatch.setattr(diskcache, "_CODE", {})
    ns = {}
    exec(diskcache.compiled(src, "<test>"), ns)
    assert ns["f"](3) == 7


def test_the_stamp_follows_the_sources(tmp_path, monkeypatch):
    mod = tmp_path / "stamped_module.py"
    mod.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import stamped_module  # noqa: F401
    monkeypatch.setattr(diskcache, "_STAMPS", {})
    before = diskcache.stamp("stamped_module")
    mod.write_text("X = 22\n")
    os.utime(mod, ns=(1, 1))
    monkeypatch.setattr(diskcache, "_STAMPS", {})
    assert diskcache.stamp("stamped_module") != before
    assert diskcache.stamp("sys") is None             # a module without a source file


def test_enumeration_modules_hold_every_granii_module_they_import():
    """A change to the code the enumeration runs must change the key: every granii module that
    those of ``ENUMERATION_MODULES`` import, and those import in turn, is listed, apart from
    the kernels (plan.py's import: they compile and run plans, they do not enumerate them)."""
    listed = set(variants.ENUMERATION_MODULES)
    seen, todo = set(), list(listed)
    while todo:
        name = todo.pop()
        if name not in seen and not name.startswith("granii.kernels"):
            seen.add(name)
            todo += _granii_imports(name)
    assert seen <= listed, f"add to ENUMERATION_MODULES: {sorted(seen - listed)}"


def _granii_imports(name):
    """The granii modules that module ``name`` imports by name (``from . import ir``, ``from
    .values import Edges``, ``from granii.x import y``)."""
    import ast
    import importlib.util
    origin = importlib.util.find_spec(name).origin
    package = name if origin.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(open(origin).read())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.rsplit(".", node.level - 1)[0]
            target = f"{base}.{node.module}" if node.module else base
        elif (node.module or "").startswith("granii"):
            target = node.module
        else:
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            found.append(sub if importlib.util.find_spec(target).submodule_search_locations
                         and importlib.util.find_spec(sub) is not None else target)
    return found


def test_parsed_json_is_what_json_gives_and_follows_the_file(store, monkeypatch):
    import json
    path = store / "manifest.json"
    value = {"models": {"gemm/torch": {"features": ["m", "k"], "sha256": "ab"}}, "n": 1.5}
    path.write_text(json.dumps(value))
    assert diskcache.parsed_json(path) == value
    with monkeypatch.context() as m:
        m.setattr(diskcache.json, "loads", lambda text: pytest.fail("parsed again"))
        assert diskcache.parsed_json(path) == value                 # read from the store
    value["n"] = 2.5
    path.write_text(json.dumps(value) + " ")                        # another size: parsed
    assert diskcache.parsed_json(path) == value
    for stored in (store / "json").iterdir():
        stored.write_bytes(b"\x00")
    assert diskcache.parsed_json(path) == value                     # a damaged store: parsed
    path.write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        diskcache.parsed_json(path)


def test_a_store_that_cannot_be_written_or_found_computes(tmp_path, monkeypatch):
    monkeypatch.setattr(diskcache, "_CODE", {})
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("GRANII_CACHE", str(blocked))              # not a folder
    ns = {}
    exec(diskcache.compiled("y = 3\n", "<test>"), ns)
    assert ns["y"] == 3
    monkeypatch.delenv("GRANII_CACHE")

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(diskcache.Path, "home", staticmethod(no_home))
    monkeypatch.setattr(diskcache, "_CODE", {})
    exec(diskcache.compiled("y = 4\n", "<test>"), ns)
    assert ns["y"] == 4
