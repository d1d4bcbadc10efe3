"""The native typed product ``granii::segment_mm`` and its weight gradient (``csrc/segment_mm.cpp``):
against a float64 product per segment, with empty segments, one segment holding every row, widths
that are not a multiple of a vector, float32 and float64, one and two threads; the weight
gradient the same whatever the thread count; ``gradcheck`` through ``typed.segment_gemm``; and the
routing between the native and the per-relation kernels."""
import pytest
import torch

from granii.kernels import native, typed

pytestmark = pytest.mark.skipif(not typed.NATIVE, reason="native kernels not built")


def segments(lengths, k_in, k_out, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seglen = torch.tensor(lengths, dtype=torch.long)
    rows = int(seglen.sum())
    x = torch.randn(rows, k_in, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(len(lengths), k_in, k_out, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(rows, k_out, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, g, seglen


def reference(x, w, g, seglen):
    """``(y, dw)`` in float64, one product per segment."""
    sizes = seglen.tolist()
    xs, gs = x.double().split(sizes), g.double().split(sizes)
    y = torch.cat([a @ w[r].double() for r, a in enumerate(xs)])
    dw = torch.stack([a.t() @ b for a, b in zip(xs, gs)])
    return y, dw


def close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    if b.numel() == 0:
        return a.numel() == 0
    scale = max(b.abs().max().item(), 1.0)
    return (a.double() - b).abs().max().item() <= tol * scale


CASES = {
    "many segments, some empty": [5, 0, 37, 1, 0, 260, 3, 513],
    "one segment holds every row": [0, 0, 1500, 0],
    "single rows": [1] * 40,
    "no rows": [0, 0, 0],
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k_in,k_out", [(16, 16), (5, 3), (17, 40), (64, 100), (3, 129)])
@pytest.mark.parametrize("case", list(CASES))
def test_product_and_weight_gradient_match_float64(case, k_in, k_out, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, g, seglen = segments(CASES[case], k_in, k_out, dtype)
        y_ref, dw_ref = reference(x, w, g, seglen)
        y = torch.ops.granii.segment_mm(x, w, seglen)
        dw = torch.ops.granii.segment_mm_wgrad(x, g, seglen)
    finally:
        torch.set_num_threads(before)
    assert y.shape == y_ref.shape and y.dtype == dtype
    assert dw.shape == dw_ref.shape and dw.dtype == dtype
    assert close(y, y_ref, dtype)
    assert close(dw, dw_ref, dtype)
    for r, n in enumerate(CASES[case]):
        if n == 0:
            assert torch.all(dw[r] == 0)


def test_weight_gradient_is_the_same_whatever_the_thread_count():
    # a long segment is cut into pieces whose partial sums are added in piece order
    x, _, g, seglen = segments([40000, 3, 9000], 8, 8, torch.float32)
    before, out = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out.append(torch.ops.granii.segment_mm_wgrad(x, g, seglen))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[0], out[1])


def test_wrong_shapes_are_refused_with_the_reason():
    x, w, g, seglen = segments([3, 4], 4, 5, torch.float32)
    with pytest.raises(RuntimeError, match="seglen sums to 6 but x has 7 rows"):
        torch.ops.granii.segment_mm(x, w, torch.tensor([3, 3]))
    with pytest.raises(RuntimeError, match="3 weights for 2 segments"):
        torch.ops.granii.segment_mm(x, torch.cat([w, w[:1]]), seglen)
    with pytest.raises(RuntimeError, match="negative segment length"):
        torch.ops.granii.segment_mm_wgrad(x, g, torch.tensor([8, -1]))


@pytest.mark.parametrize("k_in,k_out", [(3, 4), (20, 18)])
def test_gradcheck_through_the_typed_product(k_in, k_out):
    x, w, _, seglen = segments([2, 0, 5, 1], k_in, k_out, torch.float64, seed=3)
    x.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: typed.segment_gemm(a, b, seglen), (x, w))


def test_routing_native_where_faster(monkeypatch):
    """Narrow weights or many short segments take the native weight gradient; a few long
    segments of a wide weight keep one GEMM per relation (faster there)."""
    calls = []
    real = torch.ops.granii.segment_mm_wgrad

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(typed, "_native_wgrad", spy)
    narrow = segments([300, 200], 16, 16, torch.float32)
    wide_long = segments([5000, 4000], 128, 128, torch.float32)
    wide_short = segments([30] * 20, 128, 128, torch.float32)
    for x, _, g, seglen in (narrow, wide_long, wide_short):
        dw = typed.segment_weight_grad(x, g, seglen)
        assert close(dw, reference(x, x.new_zeros(len(seglen), x.shape[1], 1), g, seglen)[1],
                     torch.float32)
    assert calls == [narrow[0].shape, wide_short[0].shape]

