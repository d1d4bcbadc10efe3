"""granii's caching allocator for large tensors (``granii/kernels/pool.py``, ``csrc/pool.cpp``):
it serves large requests made while an optimized layer runs, and only those; a tensor still held
is never handed out again; DGL's own arrays made in the scope and freed outside it (or the other
way round) are freed by the right allocator; the limit bounds the cache and 0 turns pooling off;
other threads and forked processes are unaffected; results and gradients stay DGL's."""
import copy
import subprocess
import sys
import threading
from pathlib import Path

import dgl
import pytest
import torch
from dgl.nn import GraphConv, SAGEConv

from granii import granii
from granii.kernels import native, pool

ROOT = Path(__file__).resolve().parent.parent
needs_native = pytest.mark.skipif(not native.AVAILABLE, reason="native kernels not built")
BIG = 4 << 20            # the pool's smallest block (csrc/pool.cpp, kMinBlock)


def _graph(n=20_000, e=100_000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, n, (e,), generator=gen)
    v = torch.randint(0, n, (e,), generator=gen)
    return dgl.add_self_loop(dgl.graph((u, v), num_nodes=n))


def _model(cls, *args, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(*args, **kw)


@pytest.fixture
def limit_restored():
    before = pool.stats()["limit"]
    yield
    pool.set_limit(before)


@needs_native
def test_large_results_reuse_blocks_and_match_dgl():
    g = _graph()
    ref = _model(GraphConv, 64, 128)
    layer = granii(copy.deepcopy(ref), g, torch.randn(g.num_nodes(), 64))
    assert pool.stats()["installed"]
    before = pool.stats()
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(g.num_nodes(), 64, generator=gen)    # 5 MB in, 10 MB out
        with torch.no_grad():
            torch.testing.assert_close(layer(g, x), ref(g, x), rtol=1e-4, atol=1e-5)
    after = pool.stats()
    assert after["hits"] > before["hits"], "repeated calls did not reuse any block"
    assert after["limit"] > 0


@needs_native
def test_a_result_still_held_is_never_handed_out_again():
    g = _graph()
    ref = _model(SAGEConv, 64, 128, "mean")
    layer = granii(copy.deepcopy(ref), g, torch.randn(g.num_nodes(), 64))
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(g.num_nodes(), 64, generator=gen) for _ in range(5)]
    with torch.no_grad():
        kept = [layer(g, x) for x in xs]
        for x, y in zip(xs, kept):
            torch.testing.assert_close(y, ref(g, x), rtol=1e-4, atol=1e-5)
    pointers = {y.data_ptr() for y in kept}
    assert len(pointers) == len(kept)


@needs_native
def test_training_outputs_and_gradients_match_over_calls():
    g = _graph()
    ref = _model(GraphConv, 64, 96, activation=torch.relu)
    layer = granii(copy.deepcopy(ref), g, torch.randn(g.num_nodes(), 64))
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(g.num_nodes(), 64, generator=gen)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(g, xa), layer(g, xb)
        torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-5)
        w = torch.randn(ya.shape, generator=gen)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-4)
        for (name, pa), pb in zip(ref.named_parameters(), layer.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-3, atol=1e-3, msg=name)
        ref.zero_grad()
        layer.zero_grad()


@needs_native
def test_outside_the_scope_and_on_other_threads_nothing_is_pooled():
    pool.install()
    before = pool.stats()
    a = torch.empty(BIG * 2, dtype=torch.uint8)
    del a
    seen = []

    def other():
        b = torch.empty(BIG * 2, dtype=torch.uint8)
        seen.append(b.numel())

    pool.enter()
    try:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    finally:
        pool.leave()
    after = pool.stats()
    assert seen == [BIG * 2]
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


@needs_native
def test_dgl_arrays_made_in_the_scope_and_freed_outside_and_back():
    pool.install()
    inside_before = pool.stats()
    pool.enter()
    try:
        g = _graph(n=300_000, e=1_500_000, seed=4)     # DGL's own arrays of 12 MB
        g.create_formats_()
    finally:
        pool.leave()
    made = pool.stats()
    assert made["misses"] + made["hits"] > inside_before["misses"] + inside_before["hits"], \
        "DGL's arrays did not come from the pool"
    assert made["live"] > inside_before["live"]
    del g                                               # freed outside the scope
    assert pool.stats()["live"] == inside_before["live"]
    h = _graph(n=300_000, e=1_500_000, seed=5)          # made outside, freed inside
    h.create_formats_()
    pool.enter()
    try:
        del h
        z = torch.ones(BIG * 3, dtype=torch.uint8)
        assert int(z.sum()) == BIG * 3
    finally:
        pool.leave()
    assert pool.stats()["live"] <= inside_before["live"] + BIG * 3 + (2 << 20)


@needs_native
def test_limit_bounds_the_cache_and_zero_turns_pooling_off(limit_restored):
    pool.install()
    pool.set_limit(0)
    assert pool.stats()["cached"] == 0
    before = pool.stats()
    pool.enter()
    try:
        for _ in range(3):
            t = torch.empty(BIG * 2, dtype=torch.uint8)
            del t
    finally:
        pool.leave()
    after = pool.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    pool.set_limit(BIG * 4)
    pool.enter()
    try:
        held = [torch.empty(BIG * 2, dtype=torch.uint8) for _ in range(4)]
        del held
    finally:
        pool.leave()
    assert 0 < pool.stats()["cached"] <= BIG * 4
    freed = pool.release()
    assert freed > 0 and pool.stats()["cached"] == 0
    with pytest.raises(ValueError, match="bytes >= 0"):
        pool.set_limit(-1)


@needs_native
def test_environment_limit_and_forked_children():
    code = (
        "import os, torch, dgl\n"
        "from dgl.nn import GraphConv\n"
        "from granii import granii\n"
        "from granii.kernels import pool\n"
        "g = dgl.add_self_loop(dgl.rand_graph(20000, 100000))\n"
        "m = granii(GraphConv(64, 128), g, torch.randn(20000, 64))\n"
        "print('limit', pool.stats()['limit'])\n"
        "with torch.no_grad():\n"
        "    m(g, torch.randn(20000, 64))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    torch.set_num_threads(1)\n"       # as DataLoader's workers (OpenMP does not survive fork)
        "    with torch.no_grad():\n"
        "        y = m(g, torch.randn(20000, 64))\n"
        "    os._exit(0 if y.shape == (20000, 128) else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n")
    env = dict(**__import__("os").environ, GRANII_POOL_LIMIT=str(64 << 20))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"limit {64 << 20}" in out.stdout
    assert "child 0" in out.stdout


@pytest.mark.parametrize("value, ok", [("abc", False), ("-5", False), ("1e9", False),
                                       ("", True), ("0", True), (" 67108864 ", True)])
def test_pool_limit_from_the_environment_is_a_whole_number_of_bytes(monkeypatch, value, ok):
    monkeypatch.setenv("GRANII_POOL_LIMIT", value)
    if ok:
        pool.check_env()
    else:
        with pytest.raises(ValueError, match="GRANII_POOL_LIMIT must be a whole number"):
            pool.check_env()


def test_without_the_extension_the_pool_does_nothing(monkeypatch):
    monkeypatch.setattr(pool, "_MOD", None)
    monkeypatch.setattr(pool, "_INSTALLED", False)
    assert pool.install() is False
    assert pool.stats() == {"installed": False, "cached": 0, "live": 0, "limit": 0, "hits": 0,
                            "misses": 0}
    assert pool.release() == 0


def _pooled_requests():
    s = pool.stats()
    return s["hits"] + s["misses"]


@needs_native
def test_the_backward_of_a_large_layer_is_pooled_and_the_scope_closes():
    g = _graph()
    layer = granii(_model(GraphConv, 64, 128), g, torch.randn(g.num_nodes(), 64))
    x = torch.randn(g.num_nodes(), 64, requires_grad=True)
    y = layer(g, x)
    before = _pooled_requests()
    (y * y).sum().backward()
    assert _pooled_requests() > before, "the layer's backward made no pooled request"
    assert pool._OPEN[0] == 0
    after = _pooled_requests()
    z = torch.empty(BIG * 2, dtype=torch.uint8)    # after the backward: outside the scope again
    del z
    assert _pooled_requests() == after


@needs_native
def test_a_backward_that_raises_leaves_no_scope_open():
    g = _graph()
    layer = granii(_model(GraphConv, 64, 128), g, torch.randn(g.num_nodes(), 64))
    x = torch.randn(g.num_nodes(), 64, requires_grad=True)

    def fail(grad):
        raise RuntimeError("a hook of the user's")

    x.register_hook(fail)
    with pytest.raises(RuntimeError, match="a hook of the user's"):
        layer(g, x).sum().backward()
    with torch.no_grad():
        layer(g, torch.randn(g.num_nodes(), 64))     # the next forward closes what was left open
    assert pool._OPEN[0] == 0
    before = _pooled_requests()
    z = torch.empty(BIG * 2, dtype=torch.uint8)
    del z
    assert _pooled_requests() == before
