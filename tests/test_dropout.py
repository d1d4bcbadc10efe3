"""granii's dropout draw (``csrc/bernoulli.cpp``, ``granii/kernels/dropout.py``): the numbers
torch's generator gives, the generator left as torch leaves it, used only inside a wrapped model."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from granii import granii, restore
from granii.kernels import dropout as D
from granii.kernels import native

pytestmark = pytest.mark.skipif(not (native.AVAILABLE and hasattr(torch.ops.granii, "bernoulli_")),
                                reason="needs granii's native kernels")


def _words(seed, count):
    """The first ``count`` tempered outputs of mt19937 seeded with ``seed`` (numpy's legacy
    generator seeds it as torch does: init_genrand)."""
    return np.random.RandomState(seed).randint(0, 2**32, size=count, dtype=np.uint64)


def _expected(words, p):
    """Bernoulli(p) from consecutive word pairs: u = ((hi & (2^21 - 1)) 2^32 + lo) 2^-53 < p."""
    hi, lo = words[0::2], words[1::2]
    m = ((hi & np.uint64(0x1FFFFF)) << np.uint64(32)) | lo
    return torch.from_numpy((m.astype(np.float64) / 2.0**53 < p).astype(np.float32))


@pytest.mark.parametrize("seed", [0, 5, 2**31 + 11])
def test_bernoulli_is_mt19937_word_pairs_across_block_boundaries(seed):
    # sizes that end a pair, a 624-word block, or start one in the middle; drawn one after
    # another from one generator, they read one stream of words
    sizes = [1, 311, 312, 313, 1, 624, 625, 5000, 3]
    words = _words(seed, 2 * sum(sizes))
    gen = torch.Generator().manual_seed(seed)
    at = 0
    for n in sizes:
        got = torch.ops.granii.bernoulli_(torch.empty(n), 0.5, gen)
        assert torch.equal(got, _expected(words[2 * at:2 * (at + n)], 0.5)), n
        at += n
    for p in (0.1, 0.7, 0.123456789):
        gen = torch.Generator().manual_seed(seed)
        got = torch.ops.granii.bernoulli_(torch.empty(999, dtype=torch.float64), p, gen)
        assert torch.equal(got.float(), _expected(_words(seed, 1998), p))


def test_bernoulli_refuses_what_it_cannot_fill():
    with pytest.raises(RuntimeError, match="contiguous float32 or float64"):
        torch.ops.granii.bernoulli_(torch.empty(10, 4).t(), 0.5)
    with pytest.raises(RuntimeError, match=r"p must be in \[0, 1\]"):
        torch.ops.granii.bernoulli_(torch.empty(10), 1.5)


@pytest.mark.skipif(not D.draws_as_torch(), reason="this torch draws bernoulli_ with MKL's "
                    "generator (torch 2.1 on Intel), so granii keeps torch's own")
@pytest.mark.parametrize("offset", [0, 7, 623])
def test_bernoulli_gives_torchs_numbers_and_state(offset):
    for n, p in [(1, 0.5), (313, 0.4), (624, 0.9), (100_003, 0.6)]:
        torch.manual_seed(3)
        torch.rand(offset)
        theirs = torch.empty(n).bernoulli_(p)
        state, after = torch.get_rng_state(), torch.rand(5)
        torch.manual_seed(3)
        torch.rand(offset)
        ours = torch.ops.granii.bernoulli_(torch.empty(n), p)
        assert torch.equal(ours, theirs)
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(torch.rand(5), after)


def _model():
    pyg_nn = pytest.importorskip("torch_geometric.nn")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = pyg_nn.GCNConv(16, 32), pyg_nn.GCNConv(32, 4)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x, edge_index):
            x = F.dropout(x, p=0.5, training=self.training)
            x = self.drop(F.relu(self.conv1(x, edge_index)))
            return self.conv2(x, edge_index)

    torch.manual_seed(0)
    return Net()


def _step(model, x, ei):
    torch.manual_seed(11)
    out = model(x, ei)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_wrapped_model_draws_torchs_masks_and_leaves_dropout_as_found():
    gen = torch.Generator().manual_seed(1)
    n = 600                                          # 600 x 16 and 600 x 32: above MIN_NUMEL
    ei = torch.randint(0, n, (2, 3000), generator=gen)
    x = torch.randn(n, 16, generator=gen)
    ref, model = _model(), _model()
    granii(model, x, ei)
    before = D.used[0]
    for _ in range(3):
        out_ref, grads_ref = _step(ref, x, ei)
        out, grads = _step(model, x, ei)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert F.dropout is D.TORCH_DROPOUT          # torch's own again outside the forward
    # what ran: granii's draw (3 calls x 2 dropouts) where this torch draws as it does
    assert D.used[0] - before == (6 if D.enabled() else 0)
    # the scope closes after a forward that raised
    with pytest.raises(Exception):
        model(x[:, :3], ei)
    assert F.dropout is D.TORCH_DROPOUT
    restore(model)
    before = D.used[0]
    _step(model, x, ei)
    assert D.used[0] == before


@pytest.mark.skipif(not D.enabled(), reason="granii's draw is not used with this torch")
@pytest.mark.parametrize("case", ["small", "non-contiguous", "half", "eval", "p=0", "p=1",
                                  "inplace"])
def test_dropout_leaves_to_torch_what_it_does_not_draw(case):
    x = torch.randn(100, 80)
    p, training, inplace = 0.4, True, False
    if case == "small":
        x = torch.randn(10, 8)
    elif case == "non-contiguous":
        x = x.t()
    elif case == "half":
        x = x.half()
    elif case == "eval":
        training = False
    elif case in ("p=0", "p=1"):
        p = float(case[-1])
    elif case == "inplace":
        inplace = True
    torch.manual_seed(4)
    theirs = D.TORCH_DROPOUT(x.clone(), p, training, inplace)
    torch.manual_seed(4)
    before = D.used[0]
    ours = D.dropout(x.clone(), p, training, inplace)
    assert torch.equal(ours, theirs)
    assert D.used[0] - before == (1 if case == "inplace" else 0)


def test_fast_dropout_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("GRANII_FAST_DROPOUT", "0")
    assert not D.enabled()
    model = _model()
    granii(model, torch.randn(600, 16), torch.randint(0, 600, (2, 3000)))
    before = D.used[0]
    _step(model, torch.randn(600, 16), torch.randint(0, 600, (2, 3000)))
    assert D.used[0] == before


def test_the_draw_check_runs_at_the_first_draw_not_at_wrapping(monkeypatch):
    # the check costs a millisecond of every first call: a model that never drops out in
    # training never runs it, one that does runs it once, at its first draw
    checks = []
    monkeypatch.setattr(D, "_CHECKED", [])
    real = D.draws_as_torch
    monkeypatch.setattr(D, "draws_as_torch", lambda: checks.append(1) or real())
    x, ei = torch.randn(600, 16), torch.randint(0, 600, (2, 3000))
    model = _model().eval()
    with torch.no_grad():
        granii(model, x, ei)
        model(x, ei)
    assert checks == []
    model.train()
    before = D.used[0]
    _step(model, x, ei)
    _step(model, x, ei)
    assert checks == [1]
    assert D.used[0] - before == (4 if D._CHECKED[0] else 0)
