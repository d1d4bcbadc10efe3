"""Predicted extra memory of a plan: what its steps allocate beyond the inputs and parameters.

Each priced step writes one result, whose size follows from its signature:

    gemm, head_gemm (m, k, n)   m x n        spmm*, spmm_norm, gat_aggregate (E, k)   N_dst x k
    row_scale, add, cat         n x k        spmm_heads (E, k)                        N_dst x heads k
    diag_mul (n)                n            sddmm_*, edge_softmax (E)                E x heads

Results computed once per graph or once per input stay in the graph's cache (``kept``); the others
live during the call (``transient``; in training autograd keeps most of them until the backward,
so their sum is the bound used). ``peak = kept + transient``, in bytes of float32.
"""
from .ir import size_value
from .plan import EVERY

FLOAT = 4


def step_bytes(step, symbols, heads=1):
    prim, _, sizes = step.sig
    v = [size_value(s, symbols) if isinstance(s, str) else s for s in sizes]
    n_dst = symbols.get("N_dst", symbols.get("N", 0))
    if prim in ("gemm", "head_gemm"):
        return FLOAT * v[0] * v[2]
    if prim == "spmm_heads":
        return FLOAT * n_dst * v[1] * heads
    if prim.startswith("spmm") or prim == "gat_aggregate":
        return FLOAT * n_dst * v[1]
    if prim in ("sddmm_scale", "sddmm_add", "edge_softmax"):
        return FLOAT * symbols["E"] * heads
    if len(v) >= 2:
        return FLOAT * v[0] * v[1]
    return FLOAT * (v[0] if v else 1)


def plan_memory(plan, symbols):
    """``(kept, transient)`` bytes of ``plan`` for the sizes ``symbols``."""
    heads = int(plan.heads[0]) if plan.heads else 1
    kept = transient = 0
    for step in plan.steps:
        if step.sig is None:
            continue
        b = step_bytes(step, symbols, heads)
        if step.when == EVERY:
            transient += b
        else:
            kept += b
    return kept, transient


def fmt_bytes(b):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
