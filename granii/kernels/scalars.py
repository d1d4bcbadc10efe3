"""The run-time scalars of generated plan code: GIN's ``1 + eps`` (``scalar``) and whether a
scaling by one may be skipped (``is_one``), with what is kept of them between calls."""
import weakref

import torch

from ..device import is_gpu

_SCALARS = {}     # (id of the attribute's tensor, offset, factor) -> (ref, version, scalar)
_ONES = {}        # id of a kept scalar -> (ref, whether it is exactly 1)
_SCALARS_KEPT = 64


def scalar(module, attr, offset, factor):
    """``offset + factor * module.<attr>`` as a one-element tensor (GIN's ``1 + eps``).

    Of a tensor that needs no gradient (GIN's ``eps`` buffer when it is not learned) the result
    is kept while the tensor is the same object at the same version: two tensor operations and
    a comparison (``is_one``) fewer on every call, which is a fair share of a small graph's
    layer call."""
    v = getattr(module, attr)
    if type(v) is not torch.Tensor or v.requires_grad or v.is_inference():
        return (offset + factor * v).reshape(1)
    key = (id(v), offset, factor)
    hit = _SCALARS.get(key)
    if hit is not None and hit[0]() is v and hit[1] == v._version:
        return hit[2]
    out = (offset + factor * v).reshape(1)
    if len(_SCALARS) >= _SCALARS_KEPT:
        _SCALARS.clear()
        _ONES.clear()
    _SCALARS[key] = (weakref.ref(v), v._version, out)
    _ONES[id(out)] = (weakref.ref(out), not out.requires_grad and bool(out == 1))
    return out


def is_one(s):
    """``s`` (a one-element tensor) is exactly 1 and needs no gradient: scaling by it is a no-op.
    For a scalar ``scalar`` kept (a buffer's), the answer kept with it. On the GPU path a scalar
    not kept (a learned ``eps`` under ``no_grad``) counts as not one: reading its value would
    wait for every queued kernel, to save one small one."""
    hit = _ONES.get(id(s))
    if hit is not None and hit[0]() is s:
        return hit[1]
    return not s.requires_grad and not is_gpu(s.device) and bool(s == 1)
