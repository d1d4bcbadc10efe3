"""torch's dropout on the CPU, the same random numbers drawn 20x faster (``csrc/bernoulli.cpp``).

On the CPU ``F.dropout(x, p, training=True)`` is::

    noise = empty_like(x).bernoulli_(1 - p);  noise.div_(1 - p);  return x * noise

and current torch builds draw ``bernoulli_`` one element at a time (~14 ns each: about half of a
2-layer GCN training step on a 38k-node graph goes to the model's two dropouts). ``dropout``
below runs the same three steps with ``torch.ops.granii.bernoulli_`` as the draw, which consumes
the default generator's mt19937 exactly as torch's kernel does: the same mask, the same
generator state after, the same autograd graph (``x * noise``). Whether the running torch draws
that way is checked once per process on a private generator (``draws_as_torch``); torch builds
that draw with MKL's generator (torch 2.1 on Intel processors) fail it and keep their own,
already fast, kernel. The check runs at the first draw granii would make, not before.

The faster draw is used only inside granii's scope: ``install(model)`` adds forward hooks to
the model given to ``granii(...)`` that point ``torch.nn.functional.dropout`` (which PyG's
layers, ``nn.Dropout`` and granii's plans call) at ``dropout`` while the model runs, and back at
torch's own after. Anything else (another dtype or device, a non-contiguous tensor, tracing or
compiling, tensor subclasses, small tensors) goes to torch's own function. ``GRANII_FAST_DROPOUT=0``
turns it off (an ablation: the speed it adds is not plan choice).
"""
import os
import sys
import threading
import weakref

import torch

from granii.kernels import native

TORCH_DROPOUT = torch.nn.functional.dropout
MIN_NUMEL = 4096            # below this torch's own call costs less than the Python around ours

_HOOKS = weakref.WeakKeyDictionary()     # model -> its two hook handles
_DEPTH = [0]                             # nested scopes (a wrapped model inside another)
_LOCK = threading.Lock()
_CHECKED = []                            # [bool] once draws_as_torch has run
used = [0]                               # draws made by granii's kernel (tests read it)


def is_dropout(fn):
    """Whether ``fn`` is ``F.dropout``: torch's own or granii's, whichever is in place now."""
    return fn is TORCH_DROPOUT or fn is dropout


def allowed():
    """Whether granii's draw may be tried in this process: the native kernel is built and
    ``GRANII_FAST_DROPOUT`` is not ``0``."""
    if not native.AVAILABLE or not hasattr(torch.ops.granii, "bernoulli_"):
        return False
    return os.environ.get("GRANII_FAST_DROPOUT", "1").strip() != "0"


def enabled():
    """Whether granii's draw replaces torch's in this process: it is ``allowed`` and the running
    torch draws as it does (checked once, at the first dropout granii would draw for: a model
    without dropout in training never pays the check's millisecond)."""
    return allowed() and _draws_as_torch_once()


def _draws_as_torch_once():
    if not _CHECKED:
        _CHECKED.append(draws_as_torch())
    return _CHECKED[0]


def draws_as_torch(n=40_000, p=0.3):
    """Whether ``torch.ops.granii.bernoulli_`` gives what ``Tensor.bernoulli_`` gives and leaves
    the generator as it does, on ``n`` elements from a private generator (the default one is
    not touched)."""
    a, b = torch.Generator().manual_seed(2024), torch.Generator().manual_seed(2024)
    torch.rand(13, generator=a)
    torch.rand(13, generator=b)
    theirs = torch.empty(n).bernoulli_(p, generator=a)
    ours = torch.ops.granii.bernoulli_(torch.empty(n), p, b)
    return torch.equal(theirs, ours) and torch.equal(a.get_state(), b.get_state())


def _ours(x, p, training):
    if not training or not 0.0 < p < 1.0 or type(x) is not torch.Tensor:
        return False
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return False
    if x.numel() < MIN_NUMEL or not x.is_contiguous() or x.has_names():
        return False
    return not (torch.jit.is_tracing() or _compiling() or _functorch_wrapped(x))


def dropout(input, p=0.5, training=True, inplace=False):
    """``torch.nn.functional.dropout``, with granii's draw where it applies (module docstring)."""
    # installed only where ``allowed``: what is left to know is how this torch draws
    if not _ours(input, p, training) or not _draws_as_torch_once():
        return TORCH_DROPOUT(input, p, training, inplace)
    noise = torch.empty_like(input)
    torch.ops.granii.bernoulli_(noise, 1 - p)
    noise.div_(1 - p)
    used[0] += 1
    return input.mul_(noise) if inplace else input * noise


def install(model):
    """Hooks on ``model`` that put ``dropout`` in place while it runs (once per model)."""
    if model in _HOOKS or not allowed():
        return
    _HOOKS[model] = (model.register_forward_pre_hook(_enter),
                     # also after a forward that raised, so the scope always closes
                     model.register_forward_hook(_leave, always_call=True))


def uninstall(model):
    """Remove ``install``'s hooks from ``model``."""
    for handle in _HOOKS.pop(model, ()):
        handle.remove()


def _enter(module, args):
    with _LOCK:
        _DEPTH[0] += 1
        torch.nn.functional.dropout = dropout


def _leave(module, args, out):
    with _LOCK:
        _DEPTH[0] = max(_DEPTH[0] - 1, 0)
        if _DEPTH[0] == 0:
            torch.nn.functional.dropout = TORCH_DROPOUT


def _compiling():
    fn = getattr(torch.compiler, "is_compiling", None)        # torch >= 2.3
    if fn is None and "torch._dynamo" in sys.modules:
        fn = sys.modules["torch._dynamo"].is_compiling
    return bool(fn and fn())


def _functorch_wrapped(x):
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check and check(x))
