"""Real-client models: granii(model, g, x) gives DGL's outputs, gradients and buffers.

Each model is deep-copied before granii() as the reference. Training is compared over several
consecutive calls under the same seed (dropout draws the same masks on both sides), with an SGD
step between calls so parameters change in place as they do in training; eval mode is compared
with and without gradients. Then the things users do with a model: deepcopy, torch.save,
inference_mode, wrapping twice, restore, graphs and features edited in place.
"""
import copy
import io

import dgl
import numpy as np
import pytest
import torch
from dgl.nn import GraphConv
from torch import nn

from granii import granii
from graphs import block, directed, edge_weights, undirected, zero_in_degree
import models
from models import CASES, CASES_BY_NAME, of_optimized_kind

RTOL = 1e-4
CALLS = 3
GRAPHS = {"directed": directed, "undirected": undirected, "zero_in_degree": zero_in_degree}


# -- comparing ---------------------------------------------------------------------------------------
def assert_close(got, want, what):
    """Equal up to float re-association: the error is measured against the largest magnitude."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, DGL {tuple(want.shape)}"
    nan = torch.isnan(got) != torch.isnan(want)
    assert not nan.any(), f"{what}: NaN where DGL has none (or the reverse)"
    got, want = got.detach().nan_to_num(0.0), want.detach().nan_to_num(0.0)
    if not want.numel():
        return
    err = (got.double() - want.double()).abs().max().item()
    tol = 1e-6 + RTOL * want.abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (DGL's largest value " \
                       f"{want.abs().max().item():.3g})"


def projection(out):
    """A fixed random direction for the backward, so every output entry matters."""
    gen = torch.Generator().manual_seed(out.numel())
    return torch.randn(out.shape, generator=gen)


def assert_same_grads(model, ref, what):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: '{name}' has a gradient, DGL gives it none"
            continue
        assert p.grad is not None, f"{what}: '{name}' has no gradient, DGL gives it one"
        assert_close(p.grad, q.grad, f"{what}: gradient of '{name}'")


def assert_same_buffers(model, ref, what):
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        if b.is_floating_point():
            assert_close(b, c, f"{what}: buffer '{name}'")
        else:
            assert torch.equal(b, c), f"{what}: buffer '{name}' is {b}, DGL {c}"


def train_side_by_side(run, model, ref, w=None, calls=CALLS, seed=0, what=""):
    """``calls`` training steps of model and ref under the same seeds: outputs, gradients of every
    parameter (and of the edge weights ``w``), buffers; an SGD step after each call."""
    model.train()
    ref.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-3)
    for i in range(calls):
        outs, w_grads = [], []
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad(set_to_none=True)
            wi = None if w is None else w.clone().requires_grad_()
            torch.manual_seed(seed + i)
            out = run(m, wi)
            (out * projection(out)).sum().backward()
            outs.append(out)
            w_grads.append(None if wi is None else wi.grad)
        step = f"{what} training call {i + 1}"
        assert_close(outs[1], outs[0], f"{step}: output")
        assert_same_grads(model, ref, step)
        if w is not None:
            assert (w_grads[0] is None) == (w_grads[1] is None), f"{step}: edge-weight gradient"
            if w_grads[0] is not None:
                assert_close(w_grads[1], w_grads[0], f"{step}: gradient of the edge weights")
        opt.step()
        opt_ref.step()
        assert_same_buffers(model, ref, step)


def eval_side_by_side(run, model, ref, w=None, what=""):
    model.eval()
    ref.eval()
    for i in range(2):            # the second call may reuse work of the first
        with torch.no_grad():
            assert_close(run(model, w), run(ref, w), f"{what} eval call {i + 1} (no_grad)")
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    outs = []
    for m in (ref, model):
        out = run(m, w)
        (out * projection(out)).sum().backward()
        outs.append(out)
    assert_close(outs[1], outs[0], f"{what} eval with gradients: output")
    assert_same_grads(model, ref, f"{what} eval with gradients")
    assert_same_buffers(model, ref, f"{what} eval")


# -- building ---------------------------------------------------------------------------------------
def features(g, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(g.num_src_nodes(), k, generator=gen)


def setup(case, graph_kind, seed=0):
    """(runner, model wrapped by granii, reference, graph, features, edge weights)."""
    g = GRAPHS[graph_kind]()
    x = features(g, case.in_feats)
    w = edge_weights(g) if case.edge_weight else None
    torch.manual_seed(seed)
    model = case.build(g, case.in_feats, graph_kind == "zero_in_degree")
    ref = copy.deepcopy(model)
    granii(model, g, x)
    return (lambda m, wi: case.run(m, g, x, wi)), model, ref, g, x, w


CASE_GRAPHS = [pytest.param(c, k, id=f"{c.name}-{k}") for c in CASES for k in c.graphs]


@pytest.mark.parametrize("case,graph_kind", CASE_GRAPHS)
def test_training_matches_dgl(case, graph_kind):
    run, model, ref, g, x, w = setup(case, graph_kind)
    train_side_by_side(run, model, ref, w, what=f"{case.name} on {graph_kind}:")


@pytest.mark.parametrize("case,graph_kind", CASE_GRAPHS)
def test_eval_matches_dgl(case, graph_kind):
    run, model, ref, g, x, w = setup(case, graph_kind)
    eval_side_by_side(run, model, ref, w, what=f"{case.name} on {graph_kind}:")
