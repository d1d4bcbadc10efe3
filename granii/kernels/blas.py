"""Small dense products on the calling thread while torch's OpenMP workers sleep.

torch multiplies float matrices on the CPU with MKL, which splits every product between torch's
threads. Under ``OMP_WAIT_POLICY=PASSIVE`` the workers sleep as soon as a parallel region ends,
and waking them costs more than a small product takes (measured on this 2-core machine, between
other work as in a layer's call: ``(2708 x 32) (32 x 32)`` 121 us on two threads, 58 us on one;
at 11 M multiply-adds both 200-210 us; at 44 M two threads win, 511 against 803 us). The native
kernels stay on one thread below the same kind of bound (``csrc/native.h``, ``serial_work``).

So a product of fewer than ``SERIAL_MACS`` multiply-adds runs with MKL's thread count set to one
for the calling thread only (``mkl_set_num_threads_local``, exported by torch's own library;
switching torch's thread count instead cost 70 us a call), forward and, through ``_SerialMM``,
both products of its backward::

    Y = X W          dX = dY W^T      dW = X^T dY

each ``m k n`` multiply-adds for ``X`` ``(m, k)`` and ``W`` ``(k, n)``. Only products without an
addend: ``addmm`` first copies its addend (a bias row) into the result with torch's own parallel
loop, which wakes the workers anyway (measured: ``(2708 x 32) (32 x 32)`` plus a bias row 124 us
on two threads, 112 us with MKL on one, against 60 us for the product alone). Where MKL is not
torch's BLAS, or the workers spin (any other wait policy), products run as before.
"""
import contextlib
import ctypes
import functools
import os

import torch

SERIAL_MACS = 1 << 23


@functools.lru_cache(maxsize=None)
def _set_local_threads():
    """MKL's ``mkl_set_num_threads_local`` (C spelling ``MKL_Set_Num_Threads_Local``) from
    torch's library, or ``None``."""
    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local     # by value (the lower-case
                                                            # name is the by-reference one here)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn


@functools.lru_cache(maxsize=None)
def workers_sleep():
    """True under ``OMP_WAIT_POLICY=PASSIVE`` (read once, case and surrounding spaces ignored, as
    the OpenMP runtime and ``csrc/native.h``'s ``serial_work`` read it)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"


def serial(x, w):
    """Whether ``X W`` is small enough to run on the calling thread (see the module doc)."""
    return (x.dim() == 2 and w.dim() == 2 and x.device.type == "cpu"
            and x.layout == w.layout == torch.strided
            and x.dtype in (torch.float32, torch.float64) and w.dtype == x.dtype
            and x.shape[0] * x.shape[1] * w.shape[1] < SERIAL_MACS
            and workers_sleep() and torch.get_num_threads() > 1
            and _set_local_threads() is not None)


@contextlib.contextmanager
def one_thread():
    """MKL on one thread for the products made inside, on this thread only."""
    set_local = _set_local_threads()
    set_local(1)
    try:
        yield
    finally:
        set_local(0)    # back to the global count, torch's (MKL returns that when none is set,
                        # so what it returns cannot tell a local setting apart)


class _SerialMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        with one_thread():
            return x @ w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        with one_thread():
            dx = _in_layout_of(x, dy, w.t()) if ctx.needs_input_grad[0] else None
            dw = _in_layout_of(w, x.t(), dy) if ctx.needs_input_grad[1] else None
        return dx, dw


def _in_layout_of(like, a, b):
    """``A B``, made as ``(B^T A^T)^T`` when ``like`` is stored column by column, as torch's
    own backward of a product does: the weight gradient of a ``(k, 2..8)`` column-major weight
    (``dense.column_major_if_narrow``) as ``X^T dY`` took 1.36 ms, as ``(dY^T X)^T`` 0.26 ms
    (``(4683 x 256)`` features, 4 columns)."""
    if like.dim() == 2 and like.stride(0) == 1 and like.shape[1] > 1:
        return (b.t() @ a.t()).t()
    return a @ b


def serial_mm(x, w):
    """``X W`` on the calling thread, and its backward's products too."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _SerialMM.apply(x, w)
    with one_thread():
        return x @ w


__all__ = ["SERIAL_MACS", "serial", "serial_mm", "one_thread", "workers_sleep"]
