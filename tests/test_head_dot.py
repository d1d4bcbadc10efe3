"""GAT's per-head attention terms by the native kernel (``head_dot/native``,
``granii/kernels/head_dot.py``, ``csrc/head_dot.cpp``): outputs and both gradients against a float64
reference and torch's implementation (float32 and float64, widths that are not a multiple of the
vector lanes, one and two threads, rows split between threads, no rows), ``gradcheck``, the
gradient reaching the attention parameter through the block-diagonal matrix, and the argument
checks."""
import pytest
import torch

from granii.kernels import get, implementations
from granii.kernels import head_dot

pytestmark = pytest.mark.skipif(not head_dot.AVAILABLE, reason="native kernels not built")


def block_diag(a):
    """``blockdiag(a_1 .. a_H)`` ``(H F x H)`` of ``a`` ``(H, F)``, differentiable in ``a``."""
    return torch.block_diag(*(a[h].unsqueeze(1) for h in range(a.shape[0])))


def reference(x, a, g):
    """float64 ``Y``, ``dX``, ``da`` by the formulas of the module docstring."""
    x, a, g = x.double(), a.double(), g.double()
    n, (heads, f) = x.shape[0], a.shape
    xh = x.reshape(n, heads, f)
    y = (xh * a).sum(-1)
    dx = (g.unsqueeze(-1) * a).reshape(n, heads * f)
    da = (g.unsqueeze(-1) * xh).sum(0)
    return y, dx, da


def test_registered_beside_torch():
    assert {"native", "torch"} <= set(implementations("head_dot"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,heads,f", [(5000, 8, 32), (700, 4, 13), (3, 2, 5), (0, 4, 8),
                                       (2000, 3, 1)])
def test_matches_reference_and_torch(dtype, threads, n, heads, f):
    gen = torch.Generator().manual_seed(n + heads + f)
    x = torch.randn(n, heads * f, generator=gen, dtype=dtype).requires_grad_()
    a = torch.randn(heads, f, generator=gen, dtype=dtype).requires_grad_()
    g = torch.randn(n, heads, generator=gen, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {}
        for impl in ("native", "torch"):
            y = get("head_dot", impl)(x, block_diag(a))
            results[impl] = (y, *torch.autograd.grad(y, [x, a], g))
    finally:
        torch.set_num_threads(before)
    # da sums n products: float32 rounding grows with n
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=1e-9, rtol=1e-9)
    for got, want, t in zip(results["native"], reference(x, a, g), results["torch"]):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **tol)
        torch.testing.assert_close(got, t, **tol)


def test_thread_counts_agree_on_a_split_pass():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20000, 64, generator=gen).requires_grad_()
    a = torch.randn(8, 8, generator=gen).requires_grad_()
    g = torch.randn(20000, 8, generator=gen)
    before = torch.get_num_threads()
    out = {}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            y = head_dot.head_dot_native(x, block_diag(a))
            out[t] = (y, *torch.autograd.grad(y, [x, a], g))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out[1][0], out[2][0], atol=0, rtol=0)     # rows are not split
    torch.testing.assert_close(out[1][1], out[2][1], atol=0, rtol=0)
    torch.testing.assert_close(out[1][2], out[2][2], atol=1e-3, rtol=1e-4)


def test_gradcheck():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a: head_dot.head_dot_native(x, block_diag(a)),
                                    (x, a))
    d = block_diag(a.detach()).requires_grad_()     # as the plans pass it: a leaf of its own
    assert torch.autograd.gradcheck(head_dot.head_dot_native, (x, d))


def test_only_the_needed_gradient_is_computed():
    x = torch.randn(50, 12)
    a = torch.randn(3, 4, requires_grad=True)
    y = head_dot.head_dot_native(x, block_diag(a))
    (da,) = torch.autograd.grad(y.sum(), [a])
    torch.testing.assert_close(da, x.reshape(50, 3, 4).sum(0))
    dx, none = torch.ops.granii.head_dot_backward(torch.ones(50, 3), x, a.detach(), True, False)
    assert none is None
    torch.testing.assert_close(dx, a.detach().reshape(1, 12).expand(50, 12))


def test_three_dim_and_non_contiguous_input():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(30, 4, 6, generator=gen)
    xt = torch.randn(24, 30, generator=gen).t()              # (30, 24), not contiguous
    a = torch.randn(4, 6, generator=gen)
    for inp in (x, xt):
        torch.testing.assert_close(head_dot.head_dot_native(inp, block_diag(a)),
                                   reference(inp.reshape(30, 24), a, torch.zeros(30, 4))[0].float(),
                                   atol=1e-5, rtol=1e-5)


def test_operator_checks():
    x, a = torch.randn(10, 12), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.granii.head_dot(x, torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.granii.head_dot(x, a.double())
    with pytest.raises(RuntimeError, match="g must be"):
        torch.ops.granii.head_dot_backward(torch.randn(10, 2), x, a, True, True)


def test_under_inference_mode():
    a = torch.randn(4, 6, requires_grad=True)        # a parameter, as in a layer
    with torch.inference_mode():
        x = torch.randn(30, 24)
        y = head_dot.head_dot_native(x, block_diag(a))
    assert y.is_inference()
    torch.testing.assert_close(y, reference(x, a.detach(), torch.zeros(30, 4))[0].float(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["native", "torch"])
def test_head_diag_carries_its_blocks_to_head_dot(impl):
    """``plan.head_diag`` builds ``blockdiag(a_1 .. a_H)`` of a GAT attention parameter as one
    broadcast product and keeps the blocks, which ``head_dot`` reads directly: the matrix equals
    torch's block diagonal, and the scores and the parameter's gradient are those of reading
    ``a`` off a plain block-diagonal matrix (no blocks attached)."""
    from types import SimpleNamespace
    from granii.plan import head_diag
    torch.manual_seed(0)
    attn = torch.randn(1, 4, 6, requires_grad=True)
    d = head_diag(SimpleNamespace(attn_l=attn), "attn_l")
    plain = block_diag(attn.reshape(4, 6))
    assert not hasattr(plain, "heads")
    torch.testing.assert_close(d, plain)
    x, g = torch.randn(50, 24), torch.randn(50, 4)
    fn = get("head_dot", impl)
    y, y_plain = fn(x, d), fn(x, plain)
    torch.testing.assert_close(y, y_plain)
    (da,) = torch.autograd.grad(y, attn, g)
    (da_plain,) = torch.autograd.grad(y_plain, attn, g)
    torch.testing.assert_close(da, da_plain)
    torch.testing.assert_close(da.reshape(4, 6), reference(x, attn.detach().reshape(4, 6), g)[2].float())
