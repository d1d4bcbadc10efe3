"""granii for PyTorch Geometric layers: lower a ``MessagePassing`` layer, enumerate and run its plans.

A model holding PyG layers is optimized by the one entry point, with the arguments of one
forward call: ``granii(model, x, edge_index)`` (then ``granii.explain(model)``,
``granii.restore(model)``); the dispatcher binds each call through ``prepare_call``. The pieces,
for tests and benchmarks:

    from granii import pyg
    prepared = pyg.prepare(conv, x, edge_index, edge_weight)   # lower + enumerate + bind one call
    out = pyg.run(prepared)                                    # the first promoted plan
    for plan, impls in pyg.plan_choices(prepared):             # every plan, every kernel
        out = pyg.run(prepared, plan, impls)

The layer's forward is read from the installed PyG source (``frontend.py``), lowered to granii's
matrix IR, and the plans are those of the core (``granii.enumerate``, ``prune``, ``plan``,
``fuse``), as for DGL layers. The graph may be ``edge_index`` [2, E], PyG's ``EdgeIndex`` or a
``torch.sparse`` adjacency (``graph.py``); kernels run on granii's index structures, never on DGL
(the DGL implementations of a primitive are left out). Nothing here imports DGL.

A layer or call the frontend does not lower raises ``FrontendError`` naming the construct;
``granii(model, x, edge_index)`` then runs the layer's own forward.
"""
import inspect
import types
import weakref

import torch

from ..frontend.values import FrontendError, RaisesForConfig
from ..ir import size_value
from .frontend import PygIR, is_pyg_layer, lower_pyg
from .graph import IndexGraph, derived, graph_info, index_graph, input_kind, known_index_graph

__all__ = ["FrontendError", "IndexGraph", "PygIR", "Prepared", "bind_values", "compile_pyg",
           "derived", "graph_info", "index_graph", "input_kind", "is_pyg_layer", "plan_choices",
           "prepare", "run", "step_impls"]



_SIGNATURES = {}


def bind_values(layer, args, kwargs):
    """``{parameter: value}`` of a call of the forward of ``layer``'s class, defaults filled in
    (``layer.forward`` may be granii's dispatcher)."""
    sig = _SIGNATURES.get(type(layer))
    if sig is None:
        sig = _SIGNATURES[type(layer)] = inspect.signature(type(layer).forward.__get__(layer))
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def unsupported_input(values, feat, graph):
    """Why a call cannot run a plan (a string), or ``None``."""
    from ..runtime.bind import unsupported_features
    x, g = values.get(feat), values.get(graph)
    if isinstance(x, (tuple, list)):
        return "a pair of (source, target) features is not optimized yet"
    why = unsupported_features(x)
    if why is not None:
        return why
    if input_kind(g) is None:
        return (f"a graph given as {type(g).__name__}: PyG's edge_index [2, E], EdgeIndex or a "
                "torch.sparse adjacency are read")
    if input_kind(g) == "adj_t" and tuple(g.shape) != (x.shape[0], x.shape[0]):
        return f"a sparse adjacency of shape {tuple(g.shape)} for {x.shape[0]} nodes"
    return None


def compile_pyg(layer, values):
    """``(PygIR, Compiled)`` of ``layer`` for the call signature of ``values``; raises
    ``FrontendError`` (or ``RaisesForConfig``) when the forward is not lowered."""
    from ..runtime.variants import compiled
    names = list(values)
    kind = input_kind(values[names[1]])
    pir = lower_pyg(layer, values, kind)
    done = compiled(pir.layer_ir, type(layer).__name__)
    if isinstance(done, Exception):
        raise done
    return pir, done


class Prepared:
    """One bound call of a PyG layer: ``call`` is the core's ``dispatch.Call``, ``pir`` and
    ``compiled`` its lowered and enumerated forms."""

    def __init__(self, layer, pir, compiled, call, values):
        self.layer, self.pir, self.compiled, self.call = layer, pir, compiled, call
        self.values = values

    @property
    def plans(self):
        return self.compiled.plans


def bind_call(layer, pir, compiled, values, state=None):
    """The core's ``Call`` of a PyG call: the graph the propagates run on (self loops added as
    the code adds them), the per-edge values computed, leaves bound and sizes checked."""
    from ..runtime.bind import Call, _bind
    from ..runtime.state import new_state
    from .bind import edge_values
    x = values[pir.feat]
    base = index_graph(values[pir.graph], x.shape[0])
    g = derived(base, pir.how)
    gi = graph_info(g)
    vals = {pir.graph: g, pir.feat: x}
    vals.update((n, v) for n, v in values.items() if n not in vals)
    for key, ev in pir.edge_values.items():
        vals[key] = edge_values(ev, base, values, x.dtype)
    state = state or new_state(layer)
    leaf_vals, (symbols, sym_key) = _bind(state, compiled, gi, vals, layer)
    grad = torch.is_grad_enabled()
    training = grad and any(p.requires_grad for p in layer.parameters())
    key = (id(compiled), pir.layer_ir.present, False, ())
    return Call(compiled, gi, leaf_vals, symbols, key, training, grad and x.requires_grad,
                layer, False, sym_key, fast_key=base)


def prepare(layer, *args, **kwargs):
    """Lower ``layer`` for this call, enumerate its plans and bind the call: a ``Prepared``.
    Raises ``FrontendError`` when the layer or the call is not lowered, ``ValueError`` for
    inputs no plan runs on."""
    values = bind_values(layer, args, kwargs)
    names = list(values)
    why = unsupported_input(values, names[0], names[1])
    if why:
        raise ValueError(f"granii: {why}")
    pir, compiled = compile_pyg(layer, values)
    if not compiled.plans:
        raise FrontendError("enumeration", "no plan was promoted")
    return Prepared(layer, pir, compiled, bind_call(layer, pir, compiled, values), values)


def step_impls(step, graph):
    """The kernel implementations of a plan step that run on the index graph ``graph`` (not
    DGL's; the GPU's on a graph on the GPU)."""
    from ..plan import step_impls as all_impls
    return tuple(i for i in all_impls(step) if graph.runs(i))


def edge_grad(call):
    """Per-edge values of the call (an edge-weight argument, or values computed from one) need a
    gradient."""
    return torch.is_grad_enabled() and any(
        call.compiled.leaves[v].source[0] == "edge" and getattr(t, "requires_grad", False)
        for v, t in call.leaf_vals.items())


def plan_choices(prepared):
    """``(plan, impls)`` for every promoted plan (and fused variant) and every kernel of each
    step: the ``i``-th choice takes each step's ``i``-th implementation (its last where it has
    fewer), so each implementation runs in place once. Plans with a step that only DGL runs
    are left out."""
    out = []
    for plan in prepared.plans:
        graph = prepared.call.gi.g
        per_step = [step_impls(s, graph) for s in plan.steps]
        if any(not o for o in per_step):
            continue
        n = max((len(o) for o in per_step), default=1)
        for impls in dict.fromkeys(tuple(o[min(i, len(o) - 1)] for o in per_step)
                                   for i in range(n)):
            out.append((plan, impls))
    return out


def run(prepared, plan=None, impls=None):
    """Run ``plan`` (default: the first promoted plan that runs here) with kernel
    implementations ``impls`` (default: each step's first) on the prepared call."""
    from ..runtime.variants import run_plan
    call = prepared.call
    if edge_grad(call):             # values computed from an argument: a graph per run
        call = bind_call(prepared.layer, prepared.pir, prepared.compiled, prepared.values)
    if plan is None:
        choices = plan_choices(prepared)
        if not choices:
            raise FrontendError("plans", "every plan needs a kernel only DGL has")
        plan, impls = choices[0]
    if impls is None:
        impls = tuple(step_impls(s, call.gi.g)[0] for s in plan.steps)
    return run_plan(call, plan, impls)


_ = RaisesForConfig


def message_bytes(module, pir, graph, symbols, x):
    """The bytes of the messages PyG's own forward of ``module`` writes in this call: each
    unfused ``propagate`` collects ``x_j`` and writes ``message``'s result, one row per edge,
    before it aggregates (``MessagePassing.propagate``), so at least ``E * width`` elements per
    propagate (``PygIR.messages``); none where PyG fuses message and aggregation: the frontend
    lowered ``message_and_aggregate`` on a sparse adjacency (no message recorded), and on an
    ``EdgeIndex`` sorted by column for a layer that supports it (``propagate``'s own test)."""
    if not pir.messages:
        return 0
    if (pir.kind == "EdgeIndex" and getattr(module, "fuse", False)
            and getattr(module, "SUPPORTS_FUSED_EDGE_INDEX", False)
            and getattr(graph, "is_sorted_by_col", False)):
        return 0
    return x.element_size() * symbols["E"] * sum(size_value(w, symbols) for w in pir.messages)


# -- the dispatcher's entry (``dispatch.prepare`` calls this for PyG layers) --------------------------
def prepare_call(state, module, args, kwargs, reuse_inputs=True):
    """Bind a call of the PyG layer ``module`` for the dispatcher: its ``dispatch.Call``, or a
    string (the reason) when the original forward must run. Compiled variants are kept in
    ``state.compiled`` per call signature (which arguments are tensors, the graph input's kind,
    plain arguments) and reused while the configuration they read holds."""
    from ..runtime.bind import _repeats, input_identity
    from ..runtime.variants import _holds
    values = bind_values(module, args, kwargs)
    names = list(values)
    feat, graph = names[0], names[1]
    why = unsupported_input(values, feat, graph)
    if why:
        return why
    present = frozenset(n for n in names[2:] if isinstance(values[n], torch.Tensor))
    config = tuple((n, repr(values[n])) for n in names[2:]
                   if values[n] is not None and n not in present)
    # the dispatcher's key of a call signature: (present, is_block, configuration)
    key = (present, False, (("graph input", input_kind(values[graph])),) + config)
    variants = state.compiled.setdefault(key, [])
    found = None
    no_graph = types.SimpleNamespace(cache={})      # conditions are evaluated at each call
    for v in variants:
        if _holds(v, module, values, no_graph):
            found = v
            break
    if found is None:
        try:
            pir, found = compile_pyg(module, values)
            found.pyg = pir
        except (FrontendError, RaisesForConfig) as e:
            found = e
        except Exception as e:        # noqa: BLE001 - whatever fails, the original forward runs
            from ..runtime.variants import _failure
            found = _failure("the PyG frontend", e)
        variants.append(found)
    if isinstance(found, Exception):
        state.last_failure = found
        return str(found)
    compiled = found
    call = bind_call(module, compiled.pyg, compiled, values, state)
    # the pricing counts edge values among the inputs needing a gradient only with the
    # features (``select._needs_grad``): an edge weight that needs one makes the call so
    call.input_grad = call.input_grad or edge_grad(call)
    x = values[feat]
    call.original_bytes = message_bytes(module, compiled.pyg, values[graph], call.symbols, x)
    ident = input_identity(x) if reuse_inputs else None
    call.input_repeats = _repeats(state, x, ident)
    state.last_input = None if ident is None else (weakref.ref(x), ident)
    call.key = (id(compiled),) + key
    return call


def fast_graph_key(args):
    """The index graph granii keeps for the graph input ``args[1]`` of a call ``(x,
    edge_index, ...)`` while it is the same unchanged tensor (``graph.known_index_graph``), or
    ``None``: a PyG layer's fast tables are keyed by it (``Call.fast_key``)."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    return known_index_graph(args[1], x.shape[0])


def _register():
    from ..runtime.state import CALL_BINDERS, PYG_FAST_KEY, is_pyg_layer as claims
    if all(c is not claims for c, _ in CALL_BINDERS):
        CALL_BINDERS.append((claims, prepare_call))
    PYG_FAST_KEY[0] = fast_graph_key


_register()
