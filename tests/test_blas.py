"""Small products on the calling thread (``granii.kernels.blas``)."""
import ctypes
import os

import pytest
import torch
from dgl.nn import GATConv, GraphConv

from granii import granii as optimize
from granii.kernels import blas, get
from tests.graphs import GRAPHS

needs_mkl = pytest.mark.skipif(blas._set_local_threads() is None,
                               reason="torch's BLAS is not MKL or does not export the setter")


def _mkl_threads():
    """MKL's thread count for this thread (``mkl_get_max_threads``)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    fn = ctypes.CDLL(path).MKL_Get_Max_Threads
    fn.restype = ctypes.c_int
    return fn()


@pytest.fixture
def sleeping_workers(monkeypatch):
    """The decision as under ``OMP_WAIT_POLICY=PASSIVE``, two torch threads."""
    monkeypatch.setattr(blas, "workers_sleep", lambda: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@needs_mkl
def test_one_thread_sets_mkl_for_the_block_only(sleeping_workers):
    assert _mkl_threads() == 2
    with blas.one_thread():
        assert _mkl_threads() == 1
    assert _mkl_threads() == 2
    with pytest.raises(RuntimeError), blas.one_thread():
        raise RuntimeError("inside")
    assert _mkl_threads() == 2
    torch.set_num_threads(1)              # the global count still rules after the block
    assert _mkl_threads() == 1


@needs_mkl
def test_serial_only_below_the_bound_with_sleeping_workers_and_threads(sleeping_workers,
                                                                       monkeypatch):
    small, w = torch.randn(64, 8), torch.randn(8, 8)
    assert blas.serial(small, w)
    big = torch.randn(blas.SERIAL_MACS // 64 + 1, 8)
    assert not blas.serial(big, w)
    assert not blas.serial(small.reshape(64, 2, 4), w)
    assert not blas.serial(small.to_sparse(), w)
    assert not blas.serial(small.half(), w.half())
    assert not blas.serial(small.double(), w)
    torch.set_num_threads(1)
    assert not blas.serial(small, w)
    torch.set_num_threads(2)
    monkeypatch.setattr(blas, "workers_sleep", lambda: False)
    assert not blas.serial(small, w)


def test_the_wait_policy_is_read_from_the_environment(monkeypatch):
    blas.workers_sleep.cache_clear()
    try:
        for value, sleeps in (("PASSIVE", True), (" passive ", True), ("ACTIVE", False), ("", False)):
            monkeypatch.setenv("OMP_WAIT_POLICY", value)
            blas.workers_sleep.cache_clear()
            assert blas.workers_sleep() is sleeps
    finally:
        monkeypatch.undo()
        blas.workers_sleep.cache_clear()


@needs_mkl
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_serial_product_and_its_gradients(sleeping_workers, dtype, grads):
    torch.manual_seed(0)
    x = torch.randn(50, 12, dtype=dtype, requires_grad=grads[0])
    w = torch.randn(12, 7, dtype=dtype, requires_grad=grads[1])
    y = blas.serial_mm(x, w)
    torch.testing.assert_close(y, x @ w)
    wanted = [t for t in (x, w) if t.requires_grad]
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, wanted, g), torch.autograd.grad(x @ w, wanted, g)):
        torch.testing.assert_close(a, b)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(blas.serial_mm, (x, w))
        assert torch.autograd.gradgradcheck(blas.serial_mm, (x, w))
    with torch.no_grad():
        assert not blas.serial_mm(x, w).requires_grad


@needs_mkl
@pytest.mark.parametrize("w_order", ["row", "column"])
def test_serial_gradients_come_in_the_layout_of_torchs_own(sleeping_workers, w_order):
    """The backward makes each gradient in the layout torch's own product backward gives it
    (a column-major weight's gradient column-major: for 2-8 columns MKL made ``X^T dY`` five
    times slower than ``(dY^T X)^T``)."""
    torch.manual_seed(1)
    x = torch.randn(300, 40, requires_grad=True)
    w = (torch.randn(40, 4) if w_order == "row" else torch.randn(4, 40).t()).requires_grad_()
    g = torch.randn(300, 4)
    got = torch.autograd.grad(blas.serial_mm(x, w), (x, w), g)
    want = torch.autograd.grad(x @ w, (x, w), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
        assert a.stride() == b.stride()
    assert got[1].stride() == ((1, 40) if w_order == "column" else (4, 1))


@needs_mkl
def test_gemm_takes_the_serial_path_only_without_an_addend(sleeping_workers, monkeypatch):
    calls = []
    serial_mm = blas.serial_mm
    monkeypatch.setattr(blas, "serial_mm", lambda *a: calls.append(1) or serial_mm(*a))
    x, w, c = torch.randn(30, 6), torch.randn(6, 4), torch.randn(4)
    gemm = get("gemm", "torch")
    torch.testing.assert_close(gemm(x, w), x @ w)
    assert len(calls) == 1
    torch.testing.assert_close(gemm(x, w, c), x @ w + c)
    assert len(calls) == 1


@needs_mkl
@pytest.mark.parametrize("make", [lambda: GraphConv(6, 5, allow_zero_in_degree=True),
                                  lambda: GATConv(6, 3, num_heads=2, allow_zero_in_degree=True)])
def test_layers_match_dgl_with_serial_products(sleeping_workers, monkeypatch, make):
    """Training calls on small graphs (their products serial): outputs and gradients as DGL's."""
    calls = []
    serial_mm = blas.serial_mm
    monkeypatch.setattr(blas, "serial_mm", lambda *a: calls.append(1) or serial_mm(*a))
    for g in (make_g() for make_g in GRAPHS.values()):
        torch.manual_seed(0)
        ref = make()
        opt = make()
        opt.load_state_dict(ref.state_dict())
        x = torch.randn(g.num_nodes(), 6)
        optimize(opt, g, x)
        for _ in range(2):
            x = torch.randn(g.num_nodes(), 6, requires_grad=True)
            out, want = opt(g, x), ref(g, x)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
            r = torch.randn_like(want)
            params = [x] + list(opt.parameters())
            got = torch.autograd.grad((out * r).sum(), params)
            exp = torch.autograd.grad((want * r).sum(), [x] + list(ref.parameters()))
            for a, b in zip(got, exp):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert calls


def test_fingerprint_records_the_wait_policy_and_the_native_build(monkeypatch):
    """Both change what the cost models measured: recorded beside the id's fields, compared when
    the models recorded them, and left out of the id (the models' folder name)."""
    from granii import fingerprint as fpm
    from granii.kernels import native
    monkeypatch.setenv("OMP_WAIT_POLICY", " Passive ")
    here = fpm.machine_fingerprint()
    assert here["wait_policy"] == "passive"
    assert here["native"] == (native.kernels_sha(native._MODULE) if native.AVAILABLE else "none")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    unset = fpm.machine_fingerprint()
    assert unset["wait_policy"] == "default"
    assert fpm.fingerprint_id(unset) == fpm.fingerprint_id(here)
    assert fpm.differences(unset, here) == ["wait_policy: 'passive' in the models, "
                                            "'default' here"]
    older = {k: v for k, v in here.items() if k not in fpm.RECORDED}     # made before
    assert fpm.differences(unset, older) == []
