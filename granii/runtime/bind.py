"""Binding one call: the call's arguments read into the plan's symbols and leaf values, the
layer's own checks run, operand sizes checked, the input's identity for reuse."""
import inspect
import weakref
from dataclasses import dataclass

import torch

from ..device import gpu_unavailable
from ..graph import graph_info
from ..kernels import native, sparse_rows
from ..plan import COMPUTED
from .state import CALL_BINDERS, _any_requires_grad
from .variants import _guard_on_graph, _variant, attribute, check_code


def recompute_key(call):
    """What a recomputation must share with the call it repeats (``_recompute``)."""
    return (call.key, call.sym_key, call.training)


def _repeats(state, feat, ident):
    """Whether ``feat`` is the previous call's features, unchanged: the same object (held by
    weak reference) with the same storage and version (``ident``, ``None`` when not tracked)."""
    last = state.last_input
    return ident is not None and last is not None and last[0]() is feat and last[1] == ident


class _UserError(ValueError, RuntimeError):
    """A call DGL's layer would also refuse (wrong feature width, ...): raised, not hidden; a
    ``RuntimeError`` as torch's own size errors in DGL's layer are, and a ``ValueError``."""


@dataclass
class Call:
    """One call of a layer, bound: what its plans need to run."""
    compiled: object
    gi: object
    leaf_vals: dict
    symbols: dict
    key: tuple
    training: bool
    input_grad: bool
    module: object = None
    input_repeats: bool = False
    sym_key: tuple = ()                  # sorted symbol items but densities (shared: read-only)
    original_bytes: int = None           # the least the layer's own forward writes, where the
                                         # frontend knows it (PyG's messages per edge)
    fast_key: object = None              # what the layer's fast tables are keyed by where not
                                         # ``gi`` (PyG: the graph input's index graph)


def prepare(state, module, args, kwargs, reuse_inputs=True):
    """Bind a call of ``module``; a string (the reason) when the original forward must run.
    A layer another frontend claims (``CALL_BINDERS``) is bound by it."""
    for claims, bind in CALL_BINDERS:
        if claims(module):
            return bind(state, module, args, kwargs, reuse_inputs)
    values = _bind_arguments(state, args, kwargs)
    names = list(values)
    graph, feat = values[names[0]], values[names[1]]
    reason = _unsupported_input(graph, feat)
    if reason:
        return reason
    present = frozenset(n for n in names[2:] if isinstance(values[n], torch.Tensor))
    config = tuple((n, repr(values[n])) for n in names[2:]
                   if values[n] is not None and n not in present)
    key = (present, bool(graph.is_block), config)
    gi = graph_info(graph)
    compiled = _variant(state, module, key, values, gi)
    if isinstance(compiled, Exception):
        state.last_failure = compiled
        return str(compiled)
    _run_guards(state, compiled.layer_ir, gi, values, module)
    leaf_vals, (symbols, sym_key) = _bind(state, compiled, gi, values, module)
    grad = torch.is_grad_enabled()
    training = grad and _any_requires_grad(module)
    input_grad = grad and feat.requires_grad
    ident = input_identity(feat) if reuse_inputs else None
    repeats = _repeats(state, feat, ident)
    state.last_input = None if ident is None else (weakref.ref(feat), ident)
    return Call(compiled, gi, leaf_vals, symbols, (id(compiled),) + key, training, input_grad,
                module, repeats, sym_key)


def _call_shape(args, kwargs):
    """What decides the call signature without binding it: which arguments are given, which
    are tensors, graph or block."""
    g = args[0] if args else None
    return (len(args), tuple(kwargs), tuple(isinstance(a, torch.Tensor) for a in args[2:]),
            tuple(isinstance(v, torch.Tensor) for v in kwargs.values()),
            getattr(g, "is_block", None), type(args[1]) if len(args) > 1 else None)


def input_identity(t):
    """What identifies a tensor's value without reading it, beside the object itself (held by
    weak reference: a new tensor at a freed one's address is another tensor): its storage and
    version. ``None`` for tensors without a version counter (made under ``inference_mode``)."""
    if t.is_inference():
        return None
    return (t.data_ptr(), t._version)


def _bind_arguments(state, args, kwargs):
    """``{parameter: value}`` of a call, defaults filled in (``Signature.bind`` without its
    generality: forward() has no ``*args``/``**kwargs``, which the frontend refuses anyway)."""
    names, defaults, simple = state.params
    if not simple or len(args) > len(names) or any(k not in defaults for k in kwargs):
        bound = state.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments
    values = dict(zip(names, args))
    for k, v in kwargs.items():
        if k in values:
            raise TypeError(f"multiple values for argument '{k}'")
        values[k] = v
    for n in names[len(args):]:
        if n not in values:
            d = defaults[n]
            if d is inspect.Parameter.empty:
                raise TypeError(f"missing a required argument: '{n}'")
            values[n] = d
    return {n: values[n] for n in names}


def _unsupported_input(graph, feat):
    if not hasattr(graph, "is_block") or not hasattr(graph, "num_src_nodes"):
        return f"a first argument of type {type(graph).__name__}, not a DGL graph"
    if len(graph.srctypes) > 1 or len(graph.dsttypes) > 1 or len(graph.canonical_etypes) > 1:
        return "a heterogeneous graph (more than one node or edge type) is not optimized yet"
    if isinstance(feat, (tuple, list)):
        return "a pair of (source, destination) features is not optimized yet"
    return unsupported_features(feat)


def unsupported_features(feat):
    """Why features ``feat`` cannot go through a plan (a string), or ``None``: plans take one
    float32 tensor of N x k on the CPU (either framework) or a CUDA GPU (``granii.device``)."""
    if not isinstance(feat, torch.Tensor):
        return f"features of type {type(feat).__name__}"
    if feat.dim() != 2:
        return f"features with {feat.dim()} dimensions (only N x k features are optimized)"
    if feat.device.type not in ("cpu", "cuda") or feat.dtype != torch.float32:
        return (f"features of dtype {feat.dtype} on {feat.device} (float32 on the CPU or a "
                "CUDA GPU is optimized)")
    if feat.device.type == "cuda":
        return gpu_unavailable(feat.device)
    return None


def _run_guards(state, lir, gi, values, module):
    """Run the checks kept from the layer's source; those on the graph alone once per graph."""
    module_globals = type(module).forward.__globals__
    graph_name = next(iter(values))
    per_graph = state.decisions.get(gi)
    if per_graph is None:
        per_graph = state.decisions[gi] = {}
    for i, (text, names) in enumerate(lir.guards):
        graph_only = _guard_on_graph(names, list(values), module_globals)
        gkey = ("guard", id(lir), i)
        if graph_only and per_graph.get(gkey):
            continue
        ns = dict(module_globals)
        ns.update(values)
        ns[graph_name] = _CheckedGraph(values[graph_name], gi)
        ns["self"] = module
        # a check that fails raises here; the dispatcher then runs the original forward,
        # which raises the layer's own error
        exec(check_code(text, "exec"), ns)
        if graph_only:
            per_graph[gkey] = True


class _CheckedGraph:
    """The graph as a layer's checks kept from its source read it (``_run_guards``): its
    ``in_degrees()`` and ``out_degrees()`` (of every node) are counted by the pass that builds
    the index granii's kernels read (``graph_index``), not by DGL, which on a new graph builds an
    index of its own for them (``(graph.in_degrees() == 0).any()``, the zero in-degree check of
    GraphConv, GATConv and SGConv); anything else is read from the graph itself."""
    __slots__ = ("_graph", "_gi")

    def __init__(self, graph, gi):
        self._graph, self._gi = graph, gi

    def in_degrees(self, *args, **kwargs):
        if args or kwargs or not hasattr(self._graph, "idtype"):
            return self._graph.in_degrees(*args, **kwargs)
        return graph_index(self._gi).in_degrees().to(self._graph.idtype)

    def out_degrees(self, *args, **kwargs):
        if args or kwargs or not hasattr(self._graph, "idtype"):
            return self._graph.out_degrees(*args, **kwargs)
        return graph_index(self._gi).out_degrees().to(self._graph.idtype)

    def __getattr__(self, name):
        return getattr(self._graph, name)


def graph_index(gi):
    """``gi`` after building the native kernels' index of its graph (when they are built): one
    pass that also counts both degree vectors (``native.csr_index``), so ``gi.in_degrees()`` and
    ``gi.out_degrees()`` read those, and the plans find the index made."""
    if native.available() and not gi.gpu:
        native.csr_index(gi)
    return gi


def _bind(state, compiled, gi, values, module):
    """Leaf values by variable name and the size symbols of this call, checked for consistency.

    The symbols depend only on the graph's sizes and the leaves' shapes: they are worked out and
    checked once per combination of those (``Compiled.symbols``), then looked up."""
    out = {}
    shapes = [gi.num_src, gi.num_dst, gi.num_edges, gi.is_block]
    for var, leaf in compiled.leaves.items():
        src = leaf.source
        kind = src[0]
        if kind in COMPUTED:
            if kind == "headdiag":
                shapes.append(attribute(module, src[1]).shape)
            continue
        if kind == "arg" or kind == "edge":
            val = _arg_value(values, src[1])
        elif kind == "arg_dst":
            val = values[src[1]][: gi.num_dst]
        elif kind == "param_block" or leaf.transposed:
            val = _view(compiled, var, leaf, attribute(module, src[1]))
        else:
            val = attribute(module, src[1])
        out[var] = val
        shapes.append(getattr(val, "shape", None))
    shapes = tuple(shapes)
    known = compiled.symbols.get(shapes)
    if known is None:
        known = _symbols(state, compiled, gi, out, values, module)
        if len(compiled.symbols) >= 64:      # graphs of many sizes (a new batch per call)
            compiled.symbols.clear()
        compiled.symbols[shapes] = known
    return out, known


def _view(compiled, var, leaf, base):
    """A weight's transpose or row block. Without autograd, made once per weight (the same
    object, shape and storage) and mode, and reused: a view sees in-place updates."""
    src = leaf.source
    grad = torch.is_grad_enabled()
    if not grad and isinstance(base, torch.Tensor):
        key = (base.shape, base.data_ptr(), torch.is_inference_mode_enabled())
        hit = compiled.views.get(var)
        if hit is not None and hit[0] is base and hit[1] == key:
            return hit[2]
    if src[0] == "param_block":
        _, _, i, m, transposed = src
        full = base.t() if transposed else base
        k = full.shape[0] // m
        val = full[i * k:(i + 1) * k]
    else:
        val = base.t()
    if not grad and isinstance(base, torch.Tensor):
        compiled.views[var] = (base, key, val)
    return val


def _symbols(state, compiled, gi, out, values, module):
    """``(symbols, sorted items)`` of a call: graph sizes, then each leaf's shape checked against
    the sizes other leaves gave the same symbol."""
    feat = values[list(values)[1]]
    symbols = {"E": gi.num_edges}
    if gi.is_block:
        symbols.update(N_src=gi.num_src, N_dst=gi.num_dst)
    else:
        symbols["N"] = gi.num_src
    for var, leaf in compiled.leaves.items():
        src = leaf.source
        if src[0] == "headdiag":
            symbols[leaf.cols] = attribute(module, src[1]).shape[-2]
        if src[0] in COMPUTED or src[0] == "edge":
            continue
        _check_size(state, leaf, out[var], symbols, feat)
        if leaf.sub == "data":         # mostly-zero features make some GEMMs cheaper (select.py)
            density = sparse_rows.sampled_density(out[var])
            if density is not None:
                symbols[sparse_rows.density_symbol(var)] = density
    return symbols, tuple(sorted((k, v) for k, v in symbols.items()
                                 if not sparse_rows.is_density_symbol(k)))


def _arg_value(values, name):
    """A forward() argument, or ``srcdata:h`` / ``dstdata:h`` / ``edata:w`` read from the graph."""
    if ":" not in name:
        return values[name]
    frame, key = name.split(":", 1)
    graph = next(iter(values.values()))
    return getattr(graph, frame)[key]


def _check_size(state, leaf, val, symbols, feat):
    dims = (leaf.rows, leaf.cols) if val.dim() == 2 else (leaf.cols,)
    for sym, n in zip(dims, val.shape[-len(dims):]):
        if sym == "1":
            continue
        if "+" in sym:      # a concatenation's width: its parts are checked on their own leaves
            continue
        have = symbols.setdefault(sym, n)
        if have != n:
            raise _UserError(_size_message(state, leaf, val, sym, have, n, feat))


def _size_message(state, leaf, val, sym, have, n, feat):
    layer = f"granii: layer '{state.name}' ({type(state.module).__name__})"
    if sym == "k_in":
        return (f"{layer} expects input features of width {n} (its '{leaf.name}' is "
                f"{tuple(val.shape)}), but the features given are "
                f"{tuple(feat.shape)}: pass features with {n} columns or build the layer with "
                f"in_feats={feat.shape[-1]}")
    if sym in ("N", "N_src"):
        return (f"{layer}: the features have {n} rows but the graph has {have} source nodes: "
                "pass one row of features per node")
    return f"{layer}: size '{sym}' is {have} in one operand and {n} in '{leaf.name}'"
