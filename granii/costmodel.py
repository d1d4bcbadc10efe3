"""Cost models: predicted seconds of one primitive call by one implementation on one input.

Every cost model is an object with ``name`` and ``predict(prim, impl, gi, dims) -> seconds``
where ``dims`` holds the call's concrete sizes:

    gemm         {"m", "k", "n"}     (m x k) . (k x n)
    spmm*        {"n", "k"}          n destination rows, k columns; E comes from the graph
                                  (spmm_norm too: the fused D_dst A D_src X)
    gat_aggregate {"heads", "k"}     k = heads x F columns of the aggregated features
    row_scale    {"n", "k"}       also add (X + Y), cat (columns side by side) and row_slice
                                  (a view of the first n rows)
    sddmm_scale  {}                  E from the graph
    diag_mul     {"n"}

``AnalyticalCost`` counts flops and bytes (a roofline with this machine's rough rates); it is the
fallback when no learned models for this machine exist. The learned models (``learned.py``) have the
same interface.
"""
from dataclasses import dataclass

from .ir import size_value

FLOAT = 4

# Implementations priced as another one. Their speed against it depends on the values of an
# operand, which no model of shapes sees: ``gemm/native`` reads only the nonzeros of a mostly-zero
# X and is torch's GEMM otherwise (``kernels/sparse_rows.py``), so it costs what ``gemm/torch``
# costs (``select.price`` scales that by the density sampled from the features and adds the
# sample each call takes, so it loses on dense features). The profiler does not time them.
PRICED_AS = {("gemm", "native"): ("gemm", "torch")}


@dataclass
class AnalyticalCost:
    """``time = flops / flop_rate + bytes / byte_rate + call_overhead`` per primitive call.

    Sparse kernels gather one row of ``X`` per edge, so they move ``E k`` floats at the (slower)
    random-access rate; dense kernels stream at ``stream_rate`` and GEMM computes at ``flop_rate``.
    """
    name: str = "analytical"
    flop_rate: float = 40e9
    stream_rate: float = 8e9
    gather_rate: float = 3e9
    call_overhead: float = 10e-6
    # Relative speed of implementations of one primitive, read off results/kernels/spmm.md
    # (scripts/bench_kernels.py on this machine): DGL's u_mul_e_sum is several times slower than
    # its copy_u_sum and than torch's CSR product; torch's CSR product is a little slower than
    # DGL's copy_u_sum.
    # torch's edge messages write the E x k messages M and read them back (a gather per
    # operand, then the sum or the product): about three times the native pass's traffic
    impl_factor: tuple = (("spmm_weighted", "dgl", 6.0), ("spmm", "torch_csr", 1.2),
                          ("spmm_mean", "torch_csr", 1.2), ("edge_message_sum", "torch", 3.0),
                          ("edge_message_score", "torch", 3.0))

    def predict(self, prim, impl, gi, dims):
        factor = next((f for p, i, f in self.impl_factor if p == prim and i == impl), 1.0)
        return factor * self._time(prim, gi, dims)

    def _time(self, prim, gi, dims):
        E = gi.num_edges
        if prim == "gemm":
            m, k, n = dims["m"], dims["k"], dims["n"]
            t = 2 * m * k * n / self.flop_rate + FLOAT * (m * k + k * n + m * n) / self.stream_rate
        elif prim.startswith("edge_message"):
            # a gathered row and a row of edge features per edge; n rows written
            n, k = dims["n"], dims["k"]
            t = (FLOAT * E * k / self.gather_rate + FLOAT * E * k / self.stream_rate
                 + FLOAT * n * k / self.stream_rate + 8 * E / self.stream_rate)
        elif prim.startswith("spmm"):
            n, k = dims["n"], dims["k"]
            t = FLOAT * E * k / self.gather_rate + FLOAT * n * k / self.stream_rate + 8 * E / self.stream_rate
        elif prim == "gat_aggregate":
            n, k, h = gi.num_dst, dims["k"], dims.get("heads", 1)
            t = (FLOAT * E * (k + 2 * h) / self.gather_rate + FLOAT * n * k / self.stream_rate
                 + 8 * E / self.stream_rate)
        elif prim in ("row_scale", "add", "cat"):
            t = (3 if prim == "add" else 2) * FLOAT * dims["n"] * dims["k"] / self.stream_rate
        elif prim == "row_slice":
            return 1e-6
        elif prim.startswith("sddmm") or prim == "edge_softmax":
            t = 3 * FLOAT * E / self.gather_rate + 8 * E / self.stream_rate
        else:
            t = FLOAT * max(dims.get("n", 1), 1) / self.stream_rate
        return t + self.call_overhead


def concrete_dims(sig, symbols):
    """The ``dims`` dict of a step's signature, its size symbols replaced by their values."""
    prim, _, sizes = sig
    vals = [s if isinstance(s, (int, float)) else size_value(s, symbols) for s in sizes]
    if prim in ("gemm", "head_dot", "head_gemm"):
        return {"m": vals[0], "k": vals[1], "n": vals[2]}
    if prim.startswith("spmm") or prim in ("edge_message_sum", "edge_message_score"):
        return {"n": symbols.get("N_dst", symbols.get("N")), "k": vals[1]}
    if prim == "edge_message":                     # one row per edge
        return {"n": vals[0], "k": vals[1]}
    if prim in ("row_scale", "add", "cat", "row_slice"):
        return {"n": vals[0], "k": vals[1]}
    if prim == "diag_mul":
        return {"n": vals[0]}
    if prim == "gat_aggregate":
        return {"heads": vals[1], "k": vals[2]} if len(vals) >= 3 else {"k": vals[-1]}
    return {}     # sddmm_scale, sddmm_add, edge_softmax: sizes of the graph
