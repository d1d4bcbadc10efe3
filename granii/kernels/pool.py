"""A caching allocator for the large CPU tensors made while granii runs a layer (``csrc/pool.cpp``).

glibc gives a request above its mmap threshold (32 MiB at most) a fresh mapping whose pages fault
on first touch: measured here, a fresh 77 MB tensor is written at about 5 GB/s and a reused one at
30-45 GB/s, so at ``N x 512`` floats on a 40,000-node graph the allocation costs as much as the
GEMM that fills it. While a layer optimized by granii runs (its plan, or its original forward when
granii runs that), requests of 4 MiB and more on that thread are served from blocks freed earlier;
everything else goes to torch's allocator unchanged. A block returns to the cache when its tensor
dies, whoever holds it then. In training the scope opens again in the backward pass, from the
gradient of an optimized layer's output to the end of that backward (``in_backward``).

The cache keeps at most ``limit`` bytes of free blocks: a quarter of physical memory, or the
environment variable ``GRANII_POOL_LIMIT`` (bytes; ``0`` turns pooling off), or
``set_limit(bytes)``. ``release()`` frees the cache; ``stats()`` says what it holds. Without the
native extension, or when another CPU allocator than torch's own is installed, nothing is pooled.
"""
import os

import torch

from granii.kernels import native

_MOD = native._MODULE if native.AVAILABLE and hasattr(native._MODULE, "pool_enter") else None
_INSTALLED = False


def install():
    """Make the pool torch's CPU allocator (once; outside granii's scope it passes every request
    on). ``True`` when pooling is in place."""
    global _INSTALLED
    if _MOD is not None and not _INSTALLED:
        check_env()
        _INSTALLED = bool(_MOD.pool_install())
    return _INSTALLED


def check_env():
    """``ValueError`` when ``GRANII_POOL_LIMIT`` is set to anything but a whole number of bytes
    (the native side would read ``abc`` as 0 and ``1e9`` as 1)."""
    raw = os.environ.get("GRANII_POOL_LIMIT", "").strip()
    if raw and not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"granii: GRANII_POOL_LIMIT must be a whole number of bytes (0 turns "
                         f"pooling off), not {raw!r}: fix or unset it")


def _noop():
    return None


enter = _MOD.pool_enter if _MOD is not None else _noop
leave = _MOD.pool_leave if _MOD is not None else _noop


BIG = 4 << 20           # bytes: the pool's smallest block (csrc/pool.cpp, kMinBlock)
_OPEN = [0]             # scopes opened by backward hooks and not closed yet


def in_backward(out, args):
    """Pool the backward of a layer call with result ``out`` and arguments ``args``: a hook on
    ``out``'s gradient enters the scope and queues its leaving for the end of that backward pass.
    Only when a backward can follow and some tensor involved is large; scopes a failed backward
    left open are closed by ``close_stale`` at the next forward."""
    if _MOD is None or not _INSTALLED or not isinstance(out, torch.Tensor) or \
            not out.requires_grad:
        return
    if out.nbytes < BIG and not any(isinstance(a, torch.Tensor) and a.requires_grad and
                                    a.nbytes >= BIG for a in args):
        return
    out.register_hook(_open_backward)


def _open_backward(grad):
    enter()
    _OPEN[0] += 1
    torch.autograd.Variable._execution_engine.queue_callback(_close_backward)


def _close_backward():
    if _OPEN[0] > 0:
        _OPEN[0] -= 1
        leave()


def close_stale():
    """Outside a backward pass, close the backward scopes still open (a backward that raised)."""
    if _OPEN[0] and torch._C._current_graph_task_id() < 0:
        while _OPEN[0] > 0:
            _close_backward()


def run(inputs, fn, *args):
    """``fn(*args)`` inside the scope, and the backward of its result (``in_backward``, with the
    layer's arguments ``inputs``)."""
    close_stale()
    enter()
    try:
        out = fn(*args)
    finally:
        leave()
    in_backward(out, inputs)
    return out


def stats():
    """``{"installed", "cached", "live", "limit", "hits", "misses"}`` (bytes and block counts)."""
    if _MOD is None:
        return {"installed": False, "cached": 0, "live": 0, "limit": 0, "hits": 0, "misses": 0}
    cached, live, limit, hits, misses = _MOD.pool_stats()
    return {"installed": _INSTALLED, "cached": cached, "live": live, "limit": limit,
            "hits": hits, "misses": misses}


def release():
    """Free every cached block; returns the bytes freed."""
    return _MOD.pool_release() if _MOD is not None else 0


def set_limit(nbytes):
    """Keep at most ``nbytes`` of free blocks (``0``: pool nothing from now on)."""
    if nbytes < 0:
        raise ValueError(f"granii: a pool limit is a number of bytes >= 0, not {nbytes}")
    if _MOD is not None:
        _MOD.pool_set_limit(int(nbytes))
