"""granii's own CPU kernels for the SpMM family (C++ in ``csrc/spmm.cpp``, built by ``setup.py``).

Implementation ``"native"`` of ``spmm``, ``spmm_weighted`` and ``spmm_mean`` (same signatures and
semantics as the ``dgl`` and ``torch_csr`` ones in ``spmm.py``), and the primitive ``spmm_norm``::

    spmm_norm(gi, d_dst, d_src, x, bias=None, act=None, res=None)
        = act(diag(d_dst) A diag(d_src) X + bias + res)

with ``d_dst`` ``(num_dst,)`` and ``d_src`` ``(num_src,)`` degree-power vectors (or ``None`` for
the identity; ``degree_scales(gi, a, b)`` gives ``D_in^a`` and ``D_out^b`` once per graph), ``bias``
of ``x.shape[1:]`` (or its number of elements) and ``act`` one of ``None``, ``"relu"`` (or
``torch.relu`` / ``F.relu``), ``res`` a matrix of the result's shape (a residual: SAGE's self term,
GIN's ``(1 + eps) X``). Implementations: ``"native"`` (one pass: the degree factors are read per
row and per nonzero, bias, residual and activation applied as each row is written; no E-sized
value array, no extra N x k pass), ``"torch"`` (row scale, ``torch_csr`` product, row scale) and ``"dgl"``
(GraphConv's sequence: row scale, ``copy_u_sum``, row scale).

Every kernel is a torch operator (``torch.ops.granii.spmm_csr``, ``sddmm_dot_csr``) wrapped in an
autograd function: the backward multiplies by ``A^T``, whose CSR is built once per graph on first
use (an inference never builds it), with the two degree vectors swapped; gradients reach ``x``,
edge values (``dw_e = <dY[v], X[u]>``, a native SDDMM in edge order), ``bias`` and the degree
vectors. Edge values are given in DGL edge-id order (``Values`` puts them in CSR order).

If the extension is not built (no compiler at install), or was built from other sources than
``csrc/`` now holds (a stale build, found by the sources' hash compiled into the library, before
it is loaded), importing this module says so once, with how to rebuild, and registers nothing:
the other implementations are used.
"""
import importlib.util
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from granii.kernels.registry import register
try:                             # where the build for the running torch lives (setup.py)
    from granii.kernels import extension
except ImportError:
    extension = None
from granii.kernels import sources as _sources
from granii.kernels import spmm as _spmm

_INT32_MAX = 2**31 - 1
ROOT = Path(__file__).resolve().parent.parent.parent
CSRC = Path(__file__).resolve().parent / "csrc"

ACTS = {None: 0, "relu": 1, torch.relu: 1, F.relu: 1, torch.nn.functional.relu: 1}


class NativeKernelsUnavailable(UserWarning):
    """The compiled extension ``granii._native`` could not be loaded."""


def sources_sha():
    """Hash of the sources the extension is built from (``csrc/*`` and ``setup.py``, as
    ``kernels/sources.py`` reads them); the same value ``setup.py`` compiles into the library.
    ``None`` without the sources (a wheel install)."""
    return _sources.sources_sha(ROOT)


def built_sha(mod):
    """The ``sources_sha()`` the extension module ``mod`` was compiled from (compiled in as
    ``h<hex>``), or ``None`` when it does not say."""
    built = getattr(mod, "sources_sha", None)
    return built[1:] if built else None


def kernels_sha(mod):
    """The hash of the sources the cost models' timings depend on (``kernels/sources.py``) that
    the extension module ``mod`` was compiled from, or ``None`` when it does not say."""
    built = getattr(mod, "kernels_sha", None)
    return built[1:] if built and built != "hunknown" else None


def library_sha_matches(lib, here):
    """Whether the built library ``lib`` was compiled from sources of hash ``here``, read from
    its bytes without loading it (``setup.py`` compiles the hash in as the string ``h<hex>``)."""
    try:
        return b"h" + here.encode() + b"\0" in Path(lib).read_bytes()
    except OSError:
        return False


def library():
    """The file of the built extension this environment loads, or ``None`` when there is none:
    the build for the running torch (``extension.path()``), or ``granii/_native*.so``."""
    if extension is not None:
        lib = extension.path()
        return lib if lib.is_file() else None
    return next(iter(sorted(ROOT.joinpath("granii").glob("_native*.so"))), None)


def _import():
    if extension is not None:
        # as an import statement would, a finder on sys.meta_path may refuse the module first
        importlib.util.find_spec("granii._native")
        return extension.load()
    import granii._native as mod
    return mod


def _stale(here, lib):
    """Whether the library ``lib`` is older than a source of ``csrc/`` or ``setup.py`` and was
    built from other sources than they hold now. (A library newer than every source is checked
    once loaded, by the hash it carries.)"""
    if here is None or lib is None:
        return False
    newest = max(p.stat().st_mtime for p in [ROOT / "setup.py", *CSRC.glob("*")]
                 if p.suffix in (".cpp", ".h", ".py"))
    return lib.stat().st_mtime < newest and not library_sha_matches(lib, here)


def _refuse(reason):
    warnings.warn(reason, NativeKernelsUnavailable, stacklevel=3)
    return None, reason


def _load():
    """``(module or None, reason)``: import the extension; a missing one, or one built from other
    sources than ``csrc/`` holds now (a stale build: its kernels may not be the ones the Python
    side calls), is not used, with one warning that says how to build it."""
    rebuild = "rebuild them with: bash scripts/env.sh (needs a C++ compiler)"
    here, lib = sources_sha(), library()
    if _stale(here, lib):           # refused before loading: its operators stay unregistered
        return _refuse(f"granii: the native kernels in {lib.name} were built from other "
                       f"sources than granii/kernels/csrc/ now holds, so they are not used "
                       f"(granii runs its DGL/torch kernels); {rebuild}")
    try:
        mod = _import()
    except ImportError as e:
        return _refuse(f"granii: native kernels unavailable ({e}); using the DGL/torch "
                       f"implementations. Build them with: bash scripts/env.sh (needs a C++ "
                       f"compiler)")
    built = built_sha(mod)
    if here is not None and built != here:
        return _refuse(f"granii: the native kernels in {Path(mod.__file__).name} were built from "
                       f"other sources than granii/kernels/csrc/ now holds, so they are not "
                       f"used (granii runs its DGL/torch kernels); {rebuild}")
    return mod, None


_MODULE, LOAD_ERROR = _load()
AVAILABLE = _MODULE is not None and hasattr(torch.ops.granii, "spmm_csr")


def available():
    """True when the native SpMM kernels are loaded."""
    return AVAILABLE


# -- per-graph index structures ---------------------------------------------------------------------
class CsrIndex:
    """CSR of ``A`` (``which="a"``: rows are destinations) or ``A^T`` (``"at"``) for the kernels.

    ``indptr``, ``indices``, ``eids`` share one integer type (int32 when the edge count and every
    index fit); ``eids[j]`` is the DGL edge id of entry ``j``, ``None`` when it is ``j`` itself
    (edges stored in this order), so edge-order values are read directly. ``pos`` (``A^T``
    only): the position in ``A``'s CSR of each entry.
    """
    __slots__ = ("indptr", "indices", "eids", "rows", "cols", "pos")

    def __init__(self, indptr, indices, eids, rows, cols, pos=None):
        self.indptr, self.indices, self.eids, self.rows, self.cols = indptr, indices, eids, rows, cols
        self.pos = pos


def csr_index(gi, which="a"):
    """The ``CsrIndex`` of ``A`` or ``A^T`` of graph ``gi``, built once per graph on first use.

    ``A`` is DGL's in-edge index (a sampled block comes with it) in the index type, read in one
    pass (``csr_narrow``) that also counts the degrees; a graph that holds only its edge list
    (a new batch, a PyG edge index) is counted from it once (``gi.counted()``: ``coo_to_csr``,
    with the degree statistics of ``featurize.class_shape``), which the cost model's features,
    ``gi.out_degrees()`` and ``gi.in_degrees()`` read too. ``A^T`` is transposed from it
    (``csr_transpose``, a counting sort), which also gives the position in ``A`` of each entry
    (``CsrIndex.pos``). On a block, DGL's out-degrees and out-edge index would each cost
    several times as much, and each block is used once."""
    def make():
        if which == "at":
            made = gi.cache.get("edge_list_transposed")
            if made is None and "edge_list_counted" not in gi.cache:
                gi.counted(transpose=True)
                made = gi.cache.get("edge_list_transposed")
            if made is not None:
                indptr, indices, eids, pos = made
                return CsrIndex(indptr, indices, eids, gi.num_src, gi.num_dst, pos)
            a = csr_index(gi, "a")
            indptr, indices, eids, pos = torch.ops.granii.csr_transpose(
                a.indptr, a.indices, a.eids, gi.num_src)
            return CsrIndex(indptr, indices, eids, gi.num_src, gi.num_dst, pos)
        counted = gi.counted()          # which keeps the degrees it counted
        if counted is not None:
            indptr, indices, eids = counted[:3]
        else:
            small = max(gi.num_edges, gi.num_src, gi.num_dst) <= _INT32_MAX
            indptr, indices, eids, out_deg, in_deg = torch.ops.granii.csr_narrow(
                *(t.long().contiguous() for t in gi.csc()), gi.num_src, small)
            gi.set_degrees(out_deg, in_deg)
        return CsrIndex(indptr, indices, eids, gi.num_dst, gi.num_src)
    return gi.memo(("native_csr", which), make)


def made_csr_index(gi, which="a"):
    """``csr_index(gi, which)`` when it is already made, else ``None`` (nothing is built)."""
    return gi.cache.get(("native_csr", which))


def degree_scales(gi, a, b, dtype=torch.float32):
    """``(D_in^a, D_out^b)``: destination in-degrees and source out-degrees clamped to 1, raised to
    ``a`` and ``b`` (``None`` for a power of 0), once per graph and dtype. GCN's ``norm="both"`` is
    ``(-0.5, -0.5)``, ``"right"`` (mean) ``(-1, 0)``, ``"left"`` ``(0, -1)``."""
    def make():
        d_dst = None if not a else gi.in_degrees().to(dtype).clamp(min=1).pow(a).contiguous()
        d_src = None if not b else gi.out_degrees().to(dtype).clamp(min=1).pow(b).contiguous()
        return d_dst, d_src
    return gi.memo(("native_degree_scales", a, b, dtype), make)


def _mean_scale(gi, dtype):
    return gi.memo(("native_mean_scale", dtype),
                   lambda: gi.in_degrees().to(dtype).clamp(min=1).reciprocal().contiguous())


# -- the operators ------------------------------------------------------------------------------------
class Values:
    """Edge values ``w2`` (``(E, H)``, DGL edge-id order) in the CSR order of ``A`` or ``A^T``.

    Reading ``w[eid]`` inside the kernel costs a cache miss per nonzero on graphs whose edge ids
    are scattered (measured 1.3-1.7x the unweighted product on R-MAT); one gather into CSR order
    costs less. The values of a constant ``w`` (no grad: a normalised adjacency) are gathered once
    per graph and order, kept while the same tensor, or a view of it taken the same way (a plan
    reshapes its once-per-graph values at each call), comes back unchanged (``_version``, which
    views share; an inference tensor has none, and is gathered at each call).
    """
    __slots__ = ("gi", "w2", "store")

    def __init__(self, gi, w2, user_w=None):
        self.gi, self.w2, self.store = gi, w2, None
        if user_w is not None and not user_w.requires_grad and not user_w.is_inference():
            cache = gi.cache.setdefault("native_values", {})
            base = user_w if user_w._base is None else user_w._base
            key = (id(base), user_w.storage_offset(), tuple(user_w.shape), user_w.stride(),
                   w2.dtype, tuple(w2.shape))
            entry = cache.get(key)
            if entry is None or entry[0]() is not base or entry[1] != user_w._version:
                for k in [k for k, e in cache.items() if e[0]() is None]:
                    del cache[k]
                entry = cache[key] = (weakref.ref(base), user_w._version, {})
            self.store = entry[2]

    def get(self, which):
        if self.store is not None and which in self.store:
            return self.store[which]
        eids = csr_index(self.gi, which).eids
        vals = self.w2 if eids is None else self.w2.index_select(0, eids)
        if self.store is not None:
            self.store[which] = vals
        return vals


def _op(idx, x, val=None, rs=None, cs=None, bias=None, act=0, res=None):
    """``act(diag(rs) M_val diag(cs) x + bias + res)`` with ``M`` the CSR ``idx``; ``x``
    ``(n, H, K)``, ``val`` ``(E, H)`` in the CSR order of ``M`` (``Values``), ``res``
    ``(rows, H K)``."""
    return torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x, val, None, rs, cs, bias, act, 0,
                                     res)


_OTHER = {"a": "at", "at": "a"}


class _SpmmFn(torch.autograd.Function):
    """``Y = act(diag(r) M_w diag(c) X + bias + R)`` with ``M`` = ``A`` (``which="a"``) or
    ``A^T``, and its gradients in all tensor inputs.

    ``x`` ``(cols, H, K)``, or ``(cols, ...)`` read as that with ``heads=H``; ``w`` ``(E, H)``
    in edge-id order or None; ``r``/``c`` vectors or None; ``bias`` ``(H * K,)`` or None; ``res`` (``R``) ``(rows, H * K)`` or None. Backward (``P`` =
    gradient before the activation): ``dX = diag(c) M_w^T diag(r) P`` (the same kernel on the
    transpose, scales swapped), ``dw_e = r[v] c[u] <P[v], X[u]>``, ``dbias = sum_v P[v]``,
    ``dR = P``, ``dr[v] = <P[v], (M_w diag(c) X)[v]>``, ``dc[u] = <X[u], (M_w^T diag(r) P)[u]>``.
    The backward is made of these functions again, so double backward works too.
    """

    @staticmethod
    def forward(ctx, x, w, r, c, bias, gi, act, which, vals, res=None, heads=None):
        # ``x`` may come in any shape ``(n, ...)`` with ``heads`` given: it is read as
        # ``(n, heads, K)`` here, where autograd does not see the reshape (``_plain``)
        ctx.x_shape, ctx.heads = x.shape, heads
        x3 = x if heads is None else x.reshape(x.shape[0], heads, -1).contiguous()
        y = _op(csr_index(gi, which), x3, None if w is None else vals.get(which), r, c, bias,
                act, res)
        ctx.gi, ctx.act, ctx.which, ctx.vals = gi, act, which, vals
        need_x = ctx.needs_input_grad[1] or ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        ctx.save_for_backward(x if need_x else None, w, r, c, y if act else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, r, c, y = ctx.saved_tensors
        if x is not None and ctx.heads is not None:
            x = x.reshape(x.shape[0], ctx.heads, -1)
        gi, which, vals = ctx.gi, ctx.which, ctx.vals
        other = _OTHER[which]
        p = dy.contiguous()
        if ctx.act:
            p = torch.ops.aten.threshold_backward(p, y, 0)
        dx = dw = dr = dc = dbias = None
        need_x, need_w, need_r, need_c, need_b = ctx.needs_input_grad[:5]
        if need_c:
            g = _backward_product(p, w, None, r, gi, other, vals)  # M_w^T diag(r) P
            dc = (x * g).sum(dim=(1, 2))
            if need_x:
                dx = g * c.reshape(-1, 1, 1) if c is not None else g
        elif need_x:
            dx = _backward_product(p, w, c, r, gi, other, vals)
        if need_r:
            s = _backward_product(x, w, None, c, gi, which, vals)  # M_w diag(c) X
            dr = (p * s).sum(dim=(1, 2))
        if need_w:
            pv = p if r is None else p * r.reshape(-1, 1, 1)
            xu = x if c is None else x * c.reshape(-1, 1, 1)
            dw = _SddmmFn.apply(pv.contiguous(), xu.contiguous(), gi, which)
        if need_b:
            dbias = p.sum(dim=0).reshape(-1)
        # without a residual there are nine inputs: autograd accepts the trailing None
        dres = p.reshape(p.shape[0], -1) if any(ctx.needs_input_grad[9:]) else None
        if dx is not None and ctx.heads is not None:
            dx = _plain(dx, ctx.x_shape)
        return dx, dw, dr, dc, dbias, None, None, None, None, dres, None


def _backward_product(x, w, r, c, gi, which, vals):
    """``diag(r) M_w diag(c) X`` inside a backward: a ``_SpmmFn`` under ``create_graph`` (a
    double backward differentiates through it), else the kernel alone, without an autograd
    node nobody reads."""
    if torch.is_grad_enabled():
        return _SpmmFn.apply(x, w, r, c, None, gi, 0, which, vals)
    return _op(csr_index(gi, which), x, None if w is None else vals.get(which), r, c)


def _plain(t, shape):
    """``t`` as a tensor of ``shape`` that is not a view: a gradient autograd then adds another
    one into in place. Autograd adds into a view out of place: when the gradient of a block's
    source features comes from an aggregation and from the destination rows (SAGE's self term,
    GIN's ``(1 + eps) H``), that is one more pass over an ``N_src x k`` matrix, into fresh
    memory. Under ``create_graph`` (a double backward), the differentiable reshape."""
    if torch.is_grad_enabled():
        return t.reshape(shape)
    t = t.contiguous()
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape,
                               tuple(reversed(strides)))


class _SddmmFn(torch.autograd.Function):
    """``out[e, h] = <a[row_e, h], b[col_e, h]>`` over the entries of ``M`` (``A`` or ``A^T``), in
    edge-id order; gradients ``da = M_g b``, ``db = M_g^T a`` (``g``: the incoming edge gradient)."""

    @staticmethod
    def forward(ctx, a, b, gi, which):
        idx = csr_index(gi, which)
        ctx.save_for_backward(a, b)
        ctx.gi, ctx.which = gi, which
        return torch.ops.granii.sddmm_dot_csr(idx.indptr, idx.indices, idx.eids, a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = g.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            da = _backward_product(b, g, None, None, ctx.gi, ctx.which, Values(ctx.gi, g))
        if ctx.needs_input_grad[1]:
            db = _backward_product(a, g, None, None, ctx.gi, _OTHER[ctx.which],
                                   Values(ctx.gi, g))
        return da, db, None, None


def _vec(d, n, dtype, what):
    if d is None:
        return None
    if d.numel() != n:
        raise ValueError(f"granii: {what} has {d.numel()} entries, expected {n}")
    return d.reshape(n).to(dtype).contiguous()


def _act_code(act):
    try:
        return ACTS[act]
    except (KeyError, TypeError):
        raise ValueError(f"granii: spmm_norm supports act None or 'relu', got {act!r}") from None


def _run(gi, x, w=None, heads=1, d_dst=None, d_src=None, bias=None, act=0, res=None):
    user_w = w
    n = x.shape[0]
    width = 1
    for s in x.shape[1:]:
        width *= s
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    if width % heads:
        raise ValueError(f"granii: x of shape {tuple(x.shape)} does not split into {heads} heads")
    dt = x.dtype
    if w is not None:
        w = w.reshape(gi.num_edges, heads).to(dt).contiguous()
    if bias is not None:
        if bias.numel() != width:
            raise ValueError(f"granii: bias has {bias.numel()} entries, expected {width} (the "
                             "width of x)")
        bias = bias.reshape(-1).to(dt).contiguous()
    vals = None if w is None else Values(gi, w, user_w)
    if res is not None:
        r2 = _residual(res, gi.num_dst, width, dt)
        if r2 is None:      # not of the result's shape or dtype: torch adds (broadcasts) it
            y = _run(gi, x, user_w, heads, d_dst, d_src, bias) + res
            return torch.relu(y) if act else y
        res = r2
    r, c = _vec(d_dst, gi.num_dst, dt, "d_dst"), _vec(d_src, gi.num_src, dt, "d_src")
    y = None
    if w is None and bias is None:
        y = _plain_product(gi, x, r, c, act, res, heads)
    if y is None:
        y = _SpmmFn.apply(x, w, r, c, bias, gi, act, "a", vals, res, heads)
    return y.reshape(gi.num_dst, *x.shape[1:])


def _plain_product(gi, x, r, c, act, res, heads):
    """``act(diag(r) A diag(c) X + R)`` without a Python autograd function: the kernel alone
    where no gradient is wanted, else ``granii::spmm_autograd`` (``csrc/spmm_autograd.cpp``: the
    same product and gradients as ``_SpmmFn`` with constant scales, in C++). ``None`` where
    ``_SpmmFn`` is needed: scales that want gradients, or a backward that would need ``A^T``'s
    index before it is made (it is made by the first backward on a graph, or with ``A``'s by
    the first count of a new graph in training; a call that makes it here for an inference
    would pay a count no backward reads)."""
    grad = torch.is_grad_enabled()
    if grad and ((r is not None and r.requires_grad) or (c is not None and c.requires_grad)):
        return None
    a = csr_index(gi, "a")
    if not grad or not (x.requires_grad or (res is not None and res.requires_grad)):
        return _op(a, x.reshape(x.shape[0], heads, -1).contiguous(), None, r, c, None, act, res)
    at = made_csr_index(gi, "at")
    if at is None:
        return None
    return torch.ops.granii.spmm_autograd(x, a.indptr, a.indices, at.indptr, at.indices, r, c,
                                          act, res, heads)


def _residual(res, rows, width, dtype):
    """``res`` as the kernel's ``(rows, H K)`` residual (rows of any stride), or None when it is
    not of the result's shape and dtype."""
    if res.dtype != dtype or not _one_row_each(res, rows, width):
        return None
    r = res.reshape(rows, width)
    return r if r.stride(1) == 1 else r.contiguous()


def _one_row_each(res, rows, width):
    """Whether ``res`` holds one row of ``width`` values for each of the result's ``rows`` (in
    any trailing shape): then it is added row by row; anything else is added as torch
    broadcasts it."""
    return res.dim() >= 2 and res.shape[:1] == (rows,) and res[0:1].numel() == width


def spmm_native(gi, x):
    """``Y = A X``: ``Y[v] = sum_{u -> v} X[u]``, shape ``(num_dst, ...)``."""
    return _run(gi, x)


def spmm_weighted_native(gi, w, x):
    """``Y = A_w X``: ``Y[v] = sum_{e = (u -> v)} w_e X[u]``, shapes as in ``spmm_weighted_dgl``:
    ``w`` ``(E,)`` with ``x`` ``(n, ...)``, or per head ``w`` ``(E, H)`` / ``(E, H, 1)`` with ``x``
    ``(n, H, K)``. Gradients to ``x`` (``A_w^T dY``) and to ``w`` (``<dY[v], X[u]>`` per edge)."""
    e = gi.num_edges
    heads = w.numel() // e if e else (w.shape[1] if w.dim() > 1 else 1)
    if heads > 1 and (x.dim() < 2 or x.shape[1] != heads):
        raise ValueError(f"granii: {heads}-head edge values need x of shape (n, {heads}[, k]), "
                         f"got {tuple(x.shape)}")
    return _run(gi, x, w=w, heads=max(heads, 1))


def spmm_mean_native(gi, x):
    """``Y = D_in^{-1} A X`` with ``D_in`` clamped to 1, so zero-in-degree rows are 0."""
    x2 = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return _run(gi, x2, d_dst=_mean_scale(gi, x2.dtype))


def spmm_norm_native(gi, d_dst, d_src, x, bias=None, act=None, res=None):
    """``act(diag(d_dst) A diag(d_src) X + bias + res)`` in one pass (see the module docstring)."""
    return _run(gi, x, d_dst=d_dst, d_src=d_src, bias=bias, act=_act_code(act), res=res)


class _HeadsFn(torch.autograd.Function):
    """``Y[v, h] = sum_{e = (u -> v)} w[e, h] X[u]``: per-head edge values over features shared
    by the heads (``x`` ``(n_src, 1, K)``, ``w`` ``(E, H)``, ``Y`` ``(n_dst, H, K)``).
    Backward: ``dX[u] = sum_h (A_{w_h}^T dY_h)[u]``, ``dw[e, h] = <dY[v, h], X[u]>``."""

    @staticmethod
    def forward(ctx, x, w, gi, vals):
        idx = csr_index(gi, "a")
        ctx.gi, ctx.vals = gi, vals
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        return torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x, vals.get("a"))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        p = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _backward_product(p, w, None, None, ctx.gi, "at", ctx.vals)
            dx = dx.sum(dim=1, keepdim=True)
        if ctx.needs_input_grad[1]:
            idx = csr_index(ctx.gi, "a")
            dw = torch.ops.granii.sddmm_dot_csr(idx.indptr, idx.indices, idx.eids, p, x)
        return dx, dw, None, None


def spmm_heads_native(gi, w, x):
    """``Y[v, h] = sum_{e = (u -> v)} w[e, h] X[u]``: ``w`` ``(E, H)`` (or ``(E, H, 1)``), ``x``
    ``(n_src, K)`` the same for every head; ``Y`` ``(n_dst, H, K)``. GAT's aggregation of the
    raw features, before each head's own projection (``head_gemm``)."""
    heads = w.shape[1] if w.dim() > 1 else 1
    x3 = x.reshape(x.shape[0], 1, -1)
    x3 = (x3 if x3.dtype in (torch.float32, torch.float64) else x3.float()).contiguous()
    w2 = w.reshape(gi.num_edges, heads).to(x3.dtype).contiguous()
    if gi.num_edges == 0 or heads == 1:
        return _run(gi, x3.expand(-1, heads, -1), w=w2, heads=heads)
    return _HeadsFn.apply(x3, w2, gi, Values(gi, w2, w))


# -- reference implementations of spmm_norm -----------------------------------------------------------
def _norm_sequence(spmm, gi, d_dst, d_src, x, bias, act, res):
    code = _act_code(act)
    tail = [1] * (x.dim() - 1)
    h = x if d_src is None else x * d_src.reshape(gi.num_src, *tail).to(x.dtype)
    y = spmm(gi, h)
    if d_dst is not None:
        y = y * d_dst.reshape(gi.num_dst, *tail).to(y.dtype)
    if bias is not None:
        y = y + bias.reshape(x.shape[1:])
    if res is not None:
        by_row = _one_row_each(res, y.shape[0], y[0:1].numel())
        y = y + (res.reshape(y.shape) if by_row else res)
    return torch.relu(y) if code == 1 else y


@register("spmm_norm", "torch")
def spmm_norm_torch(gi, d_dst, d_src, x, bias=None, act=None, res=None):
    """``act(diag(d_dst) A diag(d_src) X + bias + res)``: row scale, ``torch_csr`` product, row
    scale, adds."""
    return _norm_sequence(_spmm.spmm_torch_csr, gi, d_dst, d_src, x, bias, act, res)


@register("spmm_norm", "dgl")
def spmm_norm_dgl(gi, d_dst, d_src, x, bias=None, act=None, res=None):
    """``act(diag(d_dst) A diag(d_src) X + bias + res)``: GraphConv's row scale, ``copy_u_sum``,
    row scale, adds."""
    import dgl
    return _norm_sequence(lambda g, h: dgl.ops.copy_u_sum(g.g, h), gi, d_dst, d_src, x, bias, act,
                          res)


if AVAILABLE:
    register("spmm", "native")(spmm_native)
    register("spmm_weighted", "native")(spmm_weighted_native)
    register("spmm_mean", "native")(spmm_mean_native)
    register("spmm_norm", "native")(spmm_norm_native)
    register("spmm_heads", "native")(spmm_heads_native)
