"""Correctness of an optimized model against DGL's, before it is timed.

Training mode: both models run one forward and backward from the same random state (same seed,
so the same dropout masks when granii draws as DGL draws); the outputs and the gradient of every
parameter are compared. Eval mode: outputs on the same features. A tensor passes when
``|got - want| <= TOL * max|want|`` everywhere (float32 sums re-associated by another plan differ
by far less; a wrong mask, activation or operand differs by the order of the values themselves).
A model that fails in training is compared again with its ReLUs between layers made smooth
(``smooth_relu``): a plan's rounding that moves a ReLU's input across zero is not an error.

Kinks that cannot be smoothed from outside (GAT's leaky ReLU on the attention scores, inside
granii's fused kernels) are judged against the exact function instead (``against_float64``): DGL's
model run in float64 from the same seed. The optimized float32 model passes when, on every
tensor, it is within ``TOL`` of that reference or no farther from it than twice DGL's own float32
run is. On a sampled GitHub block DGL's float32 GAT itself differs from its float64 run by 2.2e-3
of a gradient's largest entry (a score near zero takes the other slope of the leaky ReLU), so a
plain comparison of two float32 runs cannot tell a kink from an error there; a wrong operand or
mask still differs from the float64 run by the order of the values.
"""
import contextlib

import torch
import torch.nn.functional as F

TOL = 1e-3


def rel_err(got, want):
    """``max|got - want| / max|want|`` (inf when the shapes differ or one is missing)."""
    if got is None or want is None or got.shape != want.shape:
        return float("inf")
    scale = max(float(want.detach().abs().max()), 1e-12) if want.numel() else 1.0
    if not want.numel():
        return 0.0
    return float((got.detach() - want.detach()).abs().max()) / scale


def _loss(out, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=gen)
    return (out * w).sum()


def _tensors(model, run, training, seed):
    """``{"output": out, "gradient of <param>": grad}`` of one seeded run (gradients of the loss
    ``_loss`` in training), detached, in float64; the model's gradients are cleared after."""
    model.train(training)
    with torch.set_grad_enabled(training):
        torch.manual_seed(seed)
        out = run(model)
    got = {"output": out.detach().double()}
    if training:
        _loss(out, seed).backward()
        got.update({f"gradient of {n}": p.grad.detach().double()
                    for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    return got


def _as_float64(model):
    """``model`` in float64, its floating-point positional inputs cast on the way in."""
    model.double()
    model.register_forward_pre_hook(lambda _, args: tuple(
        a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    return model


def against_float64(fresh, prepare, run, training=True, seed=0):
    """``(passed, worst, where)``: the optimized float32 model (``prepare(fresh())``) against
    DGL's model in float64 (``fresh()`` cast), allowed on each tensor ``max(TOL, 2 x`` DGL's own
    float32 error against that reference ``)``; ``worst`` is the largest ratio of error to
    allowance (passed when at most 1). A float64 run that differs from DGL's float32 one by more
    than ``10 x TOL`` is not the same function (a mask drawn differently) and fails the check."""
    exact = _tensors(_as_float64(fresh()), run, training, seed)
    dgl32 = _tensors(fresh(), run, training, seed)
    opt = fresh()
    prepare(opt)
    got = _tensors(opt, run, training, seed)
    worst, where = 0.0, "output"
    for name, want in exact.items():
        own = rel_err(dgl32.get(name), want)
        if not own <= 10 * TOL:
            return (False, float("inf"),
                    f"DGL's float32 and float64 runs differ on {name} ({own:.1e})")
        ratio = rel_err(got.get(name), want) / max(TOL, 2 * own)
        if ratio > worst or ratio != ratio:
            worst, where = ratio, name
    return worst == worst and worst <= 1.0, worst, where


def compare(ref, opt, run, training, seed=0):
    """``(worst relative error, what it was on)`` of ``opt`` against ``ref``: ``run(model)``
    returns the output; in training the gradients of the parameters are compared too
    (``_tensors``). Leaves both models' gradients cleared."""
    want = _tensors(ref, run, training, seed)
    got = _tensors(opt, run, training, seed)
    worst, where = 0.0, "output"
    for name, w in want.items():
        e = rel_err(got.get(name), w)
        if e > worst or e != e:
            worst, where = e, name
    if where != "output":
        where += f" (output {rel_err(got['output'], want['output']):.1e})"
    return worst, where


def passed(err):
    return err == err and err <= TOL


@contextlib.contextmanager
def smooth_relu():
    """``F.relu`` and ``torch.relu`` are GELU while this is open (the check of a model that
    failed in training is made again with it). In float32 a plan's re-association moves a value by
    about 1e-7 of the largest; a value that crosses zero before a ReLU flips that unit's
    derivative between 0 and 1, and on layers of millions of units a few do: a parameter's
    gradient then differs by a visible fraction although the plan computes DGL's function. Under a
    smooth activation the same plan agrees to rounding, while a wrong mask, operand or formula
    inside a layer still differs by the order of the values."""
    saved = F.relu, torch.relu
    F.relu = lambda x, inplace=False: F.gelu(x)
    torch.relu = F.gelu
    try:
        yield
    finally:
        F.relu, torch.relu = saved


def settle(err, where, fresh, prepare, run):
    """``(passed, where)`` of a training comparison whose worst error was ``err``: when it failed,
    the comparison again under ``smooth_relu`` on two new copies (``fresh()``), the optimized one
    made by ``prepare(model)``, and if that fails too, ``against_float64``; ``where`` gets each
    further result appended."""
    if passed(err):
        return True, where
    ref, opt = fresh(), fresh()
    with smooth_relu():
        prepare(opt)
        err2, _ = compare(ref, opt, run, True)
    where += f"; with ReLU made smooth {err2:.1e}"
    if passed(err2):
        return True, where
    ok, ratio, on = against_float64(fresh, prepare, run)
    return ok, where + f"; against float64 {ratio:.2f} of its allowance on {on}"


__all__ = ["against_float64", "compare", "rel_err", "passed", "settle", "smooth_relu", "TOL"]
