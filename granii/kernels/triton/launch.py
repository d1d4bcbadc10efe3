"""One place that launches the kernels, and an ahead-of-time compile of what was launched.

``launch(kernel, grid, args, consts)`` runs ``kernel[grid](*args, **consts)``. While a
``recording()`` block is open it also notes each distinct launch signature (the pointer dtypes,
integer widths and compile-time constants), and ``compile_signatures(...)``, in another process,
compiles every noted signature for a GPU with Triton's own compiler (to PTX and a cubin with the
``ptxas`` that ships with Triton): a machine without a GPU, running the kernels under the
interpreter, can still check that the compiled form of the very same launches builds (the
interpreter is more lenient than the compiler about types and shapes).
"""
import contextlib

import torch

_PTR = {torch.float32: "*fp32", torch.float64: "*fp64", torch.float16: "*fp16",
        torch.bfloat16: "*bf16", torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8"}
_recorded = None


def launch(kernel, grid, args, consts):
    """``kernel[grid](*args, **consts)``; empty grids launch nothing."""
    if any(g == 0 for g in grid):
        return
    if _recorded is not None:
        _recorded.add(_signature(kernel, args, consts))
    kernel[grid](*args, **consts)


def _arg_type(a):
    if isinstance(a, torch.Tensor):
        return _PTR[a.dtype]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if -2**31 <= a < 2**31 else "i64"
    if isinstance(a, float):
        return "fp32"
    raise TypeError(f"granii: cannot type kernel argument {a!r}")


def _signature(kernel, args, consts):
    """``(module, kernel name, ((arg, type), ...), ((constant, value), ...))``: plain data, so
    that another process (one not under the interpreter) can compile it."""
    fn = getattr(kernel, "fn", kernel)
    types = tuple((n, _arg_type(a)) for n, a in zip(kernel.arg_names, args))
    return fn.__module__, fn.__name__, types, tuple(sorted(consts.items()))


@contextlib.contextmanager
def recording():
    """Note the signatures of the launches in this block; yields the set they go into."""
    global _recorded
    before, _recorded = _recorded, set()
    try:
        yield _recorded
    finally:
        _recorded = before


def compile_signatures(signatures, arch=90, warp_size=32):
    """Compile every signature (``_signature``) for ``cuda:arch`` with Triton's compiler; no GPU
    needed, but not under the interpreter (its kernels are not compilable objects). Returns the
    number compiled; raises the compiler's error on the first that fails."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", arch, warp_size)
    n = 0
    for module, name, types, consts in signatures:
        kernel = getattr(importlib.import_module(module), name)
        signature = {a: t for a, t in types}
        constexprs = {}
        for c, value in consts:
            signature[c] = "constexpr"
            constexprs[c] = value
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=target)
        n += 1
    return n
