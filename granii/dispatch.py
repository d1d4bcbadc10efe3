"""The forward of an optimized layer: bind the call, find the decision, run the chosen plan.

``granii()`` sets a ``Dispatcher`` as the ``forward`` of each layer instance. Per call it

 1. lowers the layer's forward for this call signature (which optional arguments are given, graph
    or block) through frontend -> rewrite -> enumerate -> prune -> lower, once per signature and
    configuration (``_variant``);
 2. runs the layer's own checks (guards) and checks the operands' sizes (``_bind``);
 3. looks up the decision for (graph, sizes, signature, mode): a dictionary lookup after the first
    call; on a miss, ranks the promoted plans with the cost model and compiles the winner;
 4. runs the chosen plan on the layer's own parameters and submodules.

The fast path: once a verified decision has run the normal way for a call on a graph (from the
second call on that graph), the dispatcher keeps a ``FastRun`` for it, under the call's guard
(``call_guard``: grad mode, threads, deterministic algorithms, the layer's training flag, each
argument's type, shape, dtype, device (CPU or not) and ``requires_grad``) and the mode the guard
does not fix (training, features repeated). A later call with that guard on that graph checks
with one generated function (``_BindWriter``) that each configuration attribute the variant
assumed is the same object, that each parameter has its shape, and runs the checks that read
more than the graph; then it calls the plan on the operands read live. Anything it cannot prove
sends the call through the normal path (steps 1-4), which makes a new run.

Everything a plan reads at run time (parameters, activations, dropout, ``apply_func``) is looked
up on the instance that runs it, so copies, pickles and two models in one process each use their
own. Anything the offline stage cannot handle, for any reason, runs the original forward and the
reason is kept for ``explain``.
"""
import contextlib
import copy
import dataclasses
import inspect
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.utils.checkpoint

from .enumerate import (TooManyTrees, binary_orders, budget_seconds, enumerate_layer,
                        layer_forest)
from .enumerate import clock as enum_clock
from .fuse import fused_variants
from .frontend import FrontendError, RaisesForConfig, lower_layer
from .frontend.rules import Same, config_summary
from .graph import graph_info, known_info
from . import ir
from .featurize import class_shape
from .kernels import native, pool, sparse_rows
from .memory import plan_memory
from .plan import COMPUTED, REUSE, compile_plan, fuse_gemm_add, lower, tree_calls
from .prune import prune
from .select import EXPECTED_CALLS, TRIAL_MARGIN, rank, trial_candidates


@dataclass
class Compiled:
    """The offline stage of one layer for one call signature."""
    layer_ir: object
    n_trees: int                                     # association trees enumerated
    plans: list                                      # promoted plans, then their fused variants
    leaves: dict = field(default_factory=dict)       # variable -> Leaf, over every plan
    n_promoted: int = 0                              # plans that survived pruning
    n_orders: int = 0                                # binary association orders in all
    note: str = ""                                   # what bounded enumeration (``explain``)
    symbols: dict = field(default_factory=dict)      # shapes of a call -> (symbols, sorted)
    views: dict = field(default_factory=dict)        # variable -> (weight, key, view) no grad


@dataclass
class Options:
    """What the user chose in ``granii(...)``; ``cost_model=None`` is this machine's default."""
    cost_model: object = None
    expected_calls: int = EXPECTED_CALLS
    per_batch: bool = False
    reuse_inputs: bool = True
    tune: bool = True
    decisions: dict = None       # layer name -> decision_key -> plan, from ``save_decisions``
    memory_limit: int = None     # bytes of predicted peak extra memory a plan may use

    def model(self):
        if self.cost_model is None:
            from .learned import default_cost_model
            self.cost_model = default_cost_model()
        return self.cost_model


@dataclass
class LayerState:
    """What the dispatcher of one layer knows: compiled variants, decisions, what happened."""
    name: str
    module: object
    signature: inspect.Signature
    compiled: dict = field(default_factory=dict)     # signature key -> [Compiled or Exception]
    decisions: object = field(default_factory=weakref.WeakKeyDictionary)   # GraphInfo -> {}
    last: object = None                              # (symbols, ranking, chosen, code, ...)
    fallback: str = None
    calls: int = 0
    last_input: tuple = None                         # identity of the last features
    forward_run: tuple = None                        # (call key, label, fn, order) last run
                                                     # outside a backward (``_recompute``)
    sampled: dict = field(default_factory=dict)      # sampler-configuration key -> decision
    reused: int = 0                                  # block calls that reused such a decision
    failed: dict = field(default_factory=dict)       # decision key -> reason a plan raised
    verified: set = field(default_factory=set)       # (decision key, plan) that ran once
    tuned: tuple = None                              # (median seconds per candidate, kept)
    fallbacks: dict = field(default_factory=dict)    # call shape -> reason, for any input
    chosen: dict = field(default_factory=dict)       # decision_key -> the plan kept (saved)
    last_failure: Exception = None                   # the variant that failed on this call
    params: tuple = None                             # (names, defaults, all plain) of forward
    fast: object = field(default_factory=weakref.WeakKeyDictionary)  # gi -> {guard: entry}
    hot: tuple = None                                # (graph, GraphInfo) by weak reference, table
    ran: tuple = None                                # ``Ran``: what the last call ran
    classes: dict = field(default_factory=dict)      # graph-class key -> [class record]
    class_reused: int = 0                            # calls on a new whole graph that reused
                                                     # its class's decision
    class_fast: dict = field(default_factory=dict)   # size-free guard -> [(record, entry)]
    ranked: int = 0                                  # rankings made (``_decide``)


class Ran(NamedTuple):
    """What one call of a layer ran: ``kind`` ``"plan"`` (a compiled plan, ``label`` ``[i]`` or
    ``[i] impl/..``), ``"original"`` (the layer's own forward as the decision for the call:
    measured faster by the tie-break, its turn in it, or a saved decision) or ``"fallback"``
    (the layer's own forward because granii cannot run this call: ``reason`` says why)."""
    kind: str
    label: str
    reason: str = None


_PLAN_RAN = {}


def _ran_plan(label):
    ran = _PLAN_RAN.get(label)
    if ran is None:
        ran = _PLAN_RAN[label] = Ran("plan", label)
    return ran


RAN_ORIGINAL = Ran("original", "original forward", "the decision for this call")


def _fell_back(state, reason):
    state.fallback = reason
    state.ran = Ran("fallback", "original forward", reason)


def new_state(layer, name=None):
    sig = inspect.signature(type(layer).forward.__get__(layer))
    ps = sig.parameters
    params = (list(ps), {n: p.default for n, p in ps.items()},
              all(p.kind == p.POSITIONAL_OR_KEYWORD for p in ps.values()))
    return LayerState(name or type(layer).__name__, layer, sig, params=params)


class Dispatcher:
    """``layer.forward`` of an optimized layer (set on the instance, so ``type(layer).forward``
    stays the original). Copying or pickling the layer gives a dispatcher of the copy with the
    same options and no decisions: it decides again on its first call."""

    def __init__(self, layer, name, options):
        self.layer = layer
        self.options = options
        self.state = new_state(layer, name)

    def __call__(self, *args, **kwargs):
        return pool.run(args, dispatch, self.state, self.options, self.layer, args, kwargs)

    def __deepcopy__(self, memo):
        return Dispatcher(copy.deepcopy(self.layer, memo), self.state.name, self.options)

    def __getstate__(self):
        options = self.options
        from .learned import default_cost_model
        if options.cost_model is not None and options.cost_model is default_cost_model():
            options = dataclasses.replace(options, cost_model=None)
        return {"layer": self.layer, "name": self.state.name, "options": options}

    def __setstate__(self, st):
        self.layer, self.options = st["layer"], st["options"]
        self.state = None                    # the layer is not restored yet: see ``dispatch``
        self._name = st["name"]

    def __repr__(self):
        return f"<granii dispatcher of {self.state.name if self.state else self._name}>"


def original_forward(layer, args, kwargs):
    return type(layer).forward(layer, *args, **kwargs)


# -- one call ----------------------------------------------------------------------------------------
AUTOCAST = ("autocast is on: DGL's layer and torch's autocast rules decide the dtype of each "
            "step (and of the output), which granii's plans do not follow")


def autocast_on():
    """Whether the call runs in an autocast region (CPU or CUDA): then the original forward runs
    (``AUTOCAST``). DGL's GraphConv, for one, returns float32 there from a bfloat16 product
    plus its float32 bias."""
    return torch.is_autocast_cpu_enabled() or torch.is_autocast_enabled()


def dispatch(state, options, layer, args, kwargs):
    if state is None:            # unpickled: the state is made on the first call
        disp = layer.__dict__["forward"]
        state = disp.state = new_state(layer, disp._name)
    if autocast_on():
        _fell_back(state, AUTOCAST)
        return original_forward(layer, args, kwargs)
    # a PyG layer's call binds per-edge values the fast path's reader does not compute
    guard = None if is_pyg_layer(layer) else call_guard(layer, args, kwargs)
    if guard is not None and torch._C._current_graph_task_id() < 0:
        hit = _fast_hit(state, options, layer, guard, args, kwargs)
        if hit is not None:
            return _fast_run(state, options, layer, hit, args, kwargs)
        if state.class_fast and not options.per_batch:
            hit = _class_hit(state, options, layer, guard, args, kwargs)
            if hit is not None:
                return _class_run(state, options, layer, hit, guard, args, kwargs)
    return _dispatch(state, options, layer, args, kwargs, guard)


def _dispatch(state, options, layer, args, kwargs, guard):
    """The normal path: bind the call, find or make the decision, run it; then keep the fast
    path of the call when it can be proven on later calls (``guard`` is ``None`` when not)."""
    shape = _call_shape(args, kwargs)
    known = state.fallbacks.get(shape)
    if known is not None and _config_holds(known, layer):
        _fell_back(state, str(known))
        return original_forward(layer, args, kwargs)
    try:
        call = prepare(state, layer, args, kwargs, options.reuse_inputs)
    except _UserError:
        raise
    except Exception as e:       # noqa: BLE001 - any failure to bind runs the original forward
        call = f"binding the call failed ({type(e).__name__}: {e})"
    if isinstance(call, str):
        _fell_back(state, call)
        variant, state.last_failure = state.last_failure, None
        if isinstance(variant, Exception) and getattr(variant, "spec", None) == []:
            state.fallbacks[shape] = variant     # the same reason holds for every such call
        return original_forward(layer, args, kwargs)
    if torch._C._current_graph_task_id() >= 0:
        return _recompute(state, call, layer, args, kwargs)
    mode = (call.training, call.input_grad, call.input_repeats, torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled())
    per_graph = state.decisions.get(call.gi)
    if per_graph is None:
        per_graph = state.decisions[call.gi] = {}
    dkey = (call.key, call.sym_key) + mode
    if dkey in state.failed:
        _fell_back(state, state.failed[dkey])
        return original_forward(layer, args, kwargs)
    decision = per_graph.get(dkey)
    skey = ckey = record = None
    if decision is None and not options.per_batch:
        if call.gi.is_block:
            skey, decision = _sampler_decision(state, call, mode)
            if decision is not None:
                state.reused += 1
        else:
            ckey, shape, record = _class_decision(state, call, mode)
            if record is not None:
                decision = record["decision"]
                state.class_reused += 1
        if decision is not None:
            per_graph[dkey] = decision
    if decision is None:
        decision = per_graph[dkey] = decide(state, options, call)
        if skey is not None:
            state.sampled[skey] = decision
            if isinstance(decision, Trial):
                decision.homes.append((state.sampled, skey))
        elif ckey is not None:
            record = _new_class(state, ckey, shape, decision, call)
            if isinstance(decision, Trial):
                decision.homes.append((record, "decision"))
    REUSE["inputs"] = options.reuse_inputs
    if isinstance(decision, Trial):
        return _trial_call(state, per_graph, dkey, decision, call, layer, args, kwargs)
    label, fn, order = decision[:3]
    out = _run(state, dkey, label, fn, order, call, layer, args, kwargs)
    if guard is not None and (fn is None or (dkey, label) in state.verified):
        _remember(state, layer, guard, call, (label, fn, order), args, kwargs)
        if ckey is not None and record is not None:
            _remember_class(state, layer, guard, call, record, (label, fn, order), args,
                            kwargs)
    return out


# raised through a plan by torch's own machinery, not by the plan: the non-reentrant activation
# checkpoint ends its recomputation with one once it has the tensors the backward needs
_NOT_THE_PLANS = tuple(c for c in (getattr(torch.utils.checkpoint, "_StopRecomputationError",
                                           None),) if c is not None)


def recompute_key(call):
    """What a recomputation must share with the call it repeats (``_recompute``)."""
    return (call.key, call.sym_key, call.training)


def _recompute(state, call, layer, args, kwargs):
    """A call made during a backward pass: activation checkpointing (``torch.utils.checkpoint``)
    running a forward call again. The non-reentrant kind checks that it saves the tensors the
    first run saved, so it runs what the layer's last call outside a backward ran (a plan or
    the original forward, with no tie-break turn) when it is that call's kind; otherwise the
    original forward."""
    run = state.forward_run
    if run is None or run[2] is None or run[0] != recompute_key(call):
        state.ran = (RAN_ORIGINAL if run is not None and run[0] == recompute_key(call)
                     else Ran("fallback", ORIGINAL, "a recomputation in the backward (activation "
                              "checkpointing) of a call unlike the layer's last"))
        return original_forward(layer, args, kwargs)
    _, label, fn, order = run
    state.calls += 1
    state.ran = _ran_plan(label)
    return fn(call.gi, layer, *(call.leaf_vals[v] for v in order))


def _run(state, dkey, label, fn, order, call, layer, args, kwargs):
    """Run one decision: a compiled plan, or the original forward (``fn`` is ``None``)."""
    state.forward_run = (recompute_key(call), label, fn, order)
    if fn is None:
        state.fallback = None
        state.ran = RAN_ORIGINAL
        state.calls += 1
        return original_forward(layer, args, kwargs)
    if (dkey, label) in state.verified:
        out = fn(call.gi, layer, *(call.leaf_vals[v] for v in order))
        state.calls += 1
        state.fallback = None
        state.ran = _ran_plan(label)
        return out
    # the first run of a plan: if it raises, the original forward runs instead, with the random
    # numbers the plan drew given back
    rng = torch.get_rng_state()
    try:
        out = fn(call.gi, layer, *(call.leaf_vals[v] for v in order))
    except _NOT_THE_PLANS:
        raise
    except Exception as e:       # noqa: BLE001 - a plan that raises is never used again
        torch.set_rng_state(rng)
        reason = f"plan {label} raised {type(e).__name__}: {e}"
        state.failed[dkey] = reason
        state.forward_run = (recompute_key(call), ORIGINAL, None, None)
        warnings.warn(f"granii: layer '{state.name}': {reason}; running the original forward "
                      "from now on for this input", RuntimeWarning)
        _fell_back(state, reason)
        return original_forward(layer, args, kwargs)
    if len(state.verified) >= _VERIFIED_KEPT:     # keys hold graph sizes: new graphs add keys
        state.verified.clear()
    state.verified.add((dkey, label))
    state.calls += 1
    state.fallback = None
    state.ran = _ran_plan(label)
    return out


# -- the fast path -----------------------------------------------------------------------------------
# A call whose decision ran the normal way leaves a ``FastEntry`` behind, kept per graph and per
# call guard; a later call with the same guard on the same graph runs that decision after a few
# identity and shape checks, without binding, checking sizes or looking the decision up again.
_GRAD = 0                # where ``torch.is_grad_enabled()`` is in a call guard
_PLAIN = (type(None), bool, int, float, str)
_FAST_ENTRIES = 32       # fast entries kept per (layer, graph): guards beyond that are rare
_FAST_AFTER = 6          # normal-path calls on a graph before its fast path is built
_SEEN = object()         # the key of that count in a graph's table (never a call guard)
_FAST_BUILDS = 16        # runs made per entry: an attribute re-assigned on every call (or a run
                         # that cannot be made) leaves the calls to the normal path, unpaid for


def call_guard(layer, args, kwargs):
    """What a call's fast path is keyed by, or ``None`` when the call cannot have one.

    ``(grad mode, threads, deterministic algorithms, layer.training, number of positional
    arguments, the guard of each argument after the graph, then each keyword with its guard)``.
    A tensor's guard is its type, shape, dtype, whether it is on the CPU (only CPU tensors are
    optimized: the normal path runs any other) and ``requires_grad``; a plain value's (``None``,
    bool, int, float, str) its type and ``repr`` (what the normal path keys a call signature
    by); other values have none. The graph is not in it: fast entries are kept per
    ``GraphInfo``, which is new for a new graph and for a graph edited in place. (Inference
    mode needs no place: it turns gradients off, and what else depends on it, the plans and
    their caches check at run time.)"""
    if not args:
        return None
    mode = (torch.is_grad_enabled(), torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(), layer.training, len(args))
    if len(args) == 2 and not kwargs:
        g = _value_guard(args[1])
        return None if g is None else mode + (g,)
    parts = list(mode)
    for a in args[1:]:
        g = _value_guard(a)
        if g is None:
            return None
        parts.append(g)
    for k, v in kwargs.items():
        g = _value_guard(v)
        if g is None:
            return None
        parts += (k, g)
    return tuple(parts)


def _value_guard(v):
    if isinstance(v, torch.Tensor):
        return (type(v), v.shape, v.dtype, v.is_cpu, v.requires_grad)
    if type(v) in _PLAIN:
        return (type(v), repr(v))
    return None


@dataclass
class FastRun:
    """One decision of a fast entry: ``fn`` (``None``: the original forward) run on the values
    ``bind(layer, gi, args, kwargs)`` returns, the plan's operands in its argument order.

    ``bind`` is generated for this run (``_BindWriter``; its code is ``source``). It reads every
    operand live on every call (parameters are the module's tensors of this call, however an
    optimizer, ``load_state_dict`` or an assignment changed them) and returns ``None`` when an
    assumption of the decision no longer holds: a configuration attribute the compiled variant
    assumed is not the object it was when the run was made (re-assigned, even to an equal
    value: the normal path then checks it and makes a new run), a parameter, an attention
    vector or an edge value the normal path would bind has another shape (the decision was made
    for those sizes), or a condition the variant branched on that reads more than the graph has
    another value; a check of the layer's own that reads more than the graph runs too, and
    raises as in the normal path."""
    label: str
    fn: object
    bind: object
    source: str
    key: tuple = None                                # the call key of ``recompute_key``
    order: tuple = None                              # the plan's leaf order


@dataclass
class FastEntry:
    """The fast path of calls on one graph with one call guard: the compiled variant, where the
    features are among the arguments, and a ``FastRun`` per ``(training, input repeats)``, the
    part of a decision's mode the guard does not fix."""
    compiled: object
    feat: object                                     # the features' position, or a reader
    runs: dict = field(default_factory=dict)
    builds: int = 0                                  # runs made (``_FAST_BUILDS`` at most)


class _BindWriter:
    """Writes the source of a ``FastRun``'s ``bind``: straight-line reads and checks.

    A module attribute is read where ``_get`` found it when the run was made: the instance
    dictionary, a module store (``_parameters``, ``_buffers``, ``_modules``: only while the
    instance dictionary does not have the name, which would take precedence) or ``getattr`` (a
    name the class defines, or an attribute of an object that is no module). Every object read
    from must still be of its class (a class defines which names it takes over). ``nn.Module``'s
    own assignments keep a name in one store, and moving it leaves the old one without it, so a
    read either finds the current value or fails. Each prefix of the paths is read once."""

    def __init__(self, layer):
        self.lines = ["def bind(m, gi, a, k):"]
        self.consts = {}
        self.objs = {(): ("m", layer)}        # path -> (local variable, object when made)
        self.containers = set()                 # variables whose class is checked
        self.shaped = set()                     # variables whose shape is checked

    def const(self, value):
        name = f"c{len(self.consts)}"
        self.consts[name] = value
        return name

    def read(self, parts):
        """The local variable holding the attribute at ``parts`` (``_get`` semantics)."""
        if parts in self.objs:
            return self.objs[parts][0]
        parent = self.read(parts[:-1])
        obj = self.objs[parts[:-1]][1]
        name = parts[-1]
        store = _store_of(obj, name)
        if parent not in self.containers:
            self.containers.add(parent)
            self.lines.append(f"    if type({parent}) is not {self.const(type(obj))}: return None")
            if store is not None:
                self.lines.append(f"    d_{parent} = {parent}.__dict__")
        var = f"o{len(self.objs)}"
        if store is None:
            self.lines.append(f"    {var} = getattr({parent}, {name!r})")
        elif not store:
            self.lines.append(f"    {var} = d_{parent}[{name!r}]")
        else:
            self.lines.append(f"    if {name!r} in d_{parent}: return None")
            self.lines.append(f"    {var} = d_{parent}[{store!r}][{name!r}]")
        self.objs[parts] = (var, _get(obj, name))
        return var

    def same(self, parts):
        var = self.read(parts)
        self.lines.append(f"    if {var} is not {self.const(self.objs[parts][1])}: return None")

    def shape(self, var, shape):
        if var not in self.shaped:
            self.shaped.add(var)
            self.lines.append(f"    if {var}.shape != {self.const(shape)}: return None")

    def compile(self, returned):
        self.lines.append(f"    return ({''.join(e + ', ' for e in returned)})")
        source = "\n".join(self.lines) + "\n"
        code = _BIND_CODE.get(source)
        if code is None:
            if len(_BIND_CODE) >= _BIND_CODE_KEPT:
                _BIND_CODE.clear()
            code = _BIND_CODE[source] = compile(source, "<granii fast path>", "exec")
        ns = dict(self.consts)
        exec(code, ns)
        return ns["bind"], source


# the code of a bind by its source: a layer called on many graphs (a new batch each step) writes
# the same source for each, with its own constants, and compiling it costs a quarter millisecond
_BIND_CODE = {}
_BIND_CODE_KEPT = 256


def _store_of(obj, name):
    """Where ``_get`` finds ``obj.<name>``: ``None`` (getattr), ``""`` (the instance dictionary)
    or the module store that holds it (see ``_BindWriter``)."""
    cls = type(obj)
    if hasattr(cls, name) or not isinstance(obj, torch.nn.Module):
        return None
    d = obj.__dict__
    if name in d:
        return ""
    return next((s for s in ("_parameters", "_buffers", "_modules") if name in d[s]), None)


def _fast_hit(state, options, layer, guard, args, kwargs):
    """``(gi, run, plan arguments)`` when this call's fast run holds, else ``None``."""
    gi, table = _fast_table(state, args[0])
    entry = table.get(guard) if table else None
    if entry is None:
        return None
    training = guard[_GRAD] and _any_requires_grad(layer)
    feat = args[entry.feat] if type(entry.feat) is int else entry.feat(args, kwargs)
    ident = input_identity(feat) if options.reuse_inputs else None
    run = entry.runs.get((training, _repeats(state, feat, ident)))
    if run is None:
        return None
    try:
        vals = run.bind(layer, gi, args, kwargs)
    except Exception:            # noqa: BLE001 - whatever fails here, the normal path decides
        return None
    if vals is None:
        return None
    state.last_input = None if ident is None else (weakref.ref(feat), ident)
    return gi, run, vals


def _fast_table(state, g):
    """``(gi, {guard: FastEntry})`` of graph ``g`` for this layer, or ``(None, None)``. The last
    graph's are kept at hand (``state.hot``, weakly: they die with the graph) while its
    structure is the same."""
    hot = state.hot
    if hot is not None and hot[0]() is g:
        gi = hot[1]()
        if gi is not None and gi.index is getattr(g, "_graph", None):
            return gi, hot[2]
    gi = known_info(g)
    table = None if gi is None else state.fast.get(gi)
    if table is not None:
        state.hot = (weakref.ref(g), weakref.ref(gi), table)
    return gi, table


def _fast_run(state, options, layer, hit, args, kwargs):
    gi, run, vals = hit
    REUSE["inputs"] = options.reuse_inputs
    state.calls += 1
    state.fallback = None
    state.forward_run = (run.key, run.label, run.fn, run.order)
    if run.fn is None:
        state.ran = RAN_ORIGINAL
        return original_forward(layer, args, kwargs)
    state.ran = _ran_plan(run.label)
    return run.fn(gi, layer, *vals)


# -- the class path ----------------------------------------------------------------------------------
# A new whole graph of a known class (graph classification: a new ``dgl.batch`` each step) has no
# fast entry of its own, and binding its call the normal way costs more than a small layer's
# work. Once a class's decision is settled and has run on one of its graphs, its ``FastRun`` is
# kept under the call guard with the graph's sizes taken out (``_size_free``); a call on a new
# graph of that class then runs the graph's own checks once (``_graph_checks``) and the run,
# and a run that raises on it gives its random numbers back and leaves the call to the normal
# path, as a plan's first run on a graph does there.
_CLASS_FAST_KEPT = 16    # (class, run) pairs kept per size-free guard


def _size_free(guard, gi):
    """``guard`` with every tensor dimension equal to the graph's node or edge count written
    ``"N"`` or ``"E"``: alike for the graphs of a class, whose features have a row per node."""
    n, e = gi.num_src, gi.num_edges
    out = []
    for part in guard:
        if type(part) is tuple and len(part) == 5 and type(part[1]) is torch.Size:
            dims = tuple("N" if d == n else "E" if d == e else d for d in part[1])
            part = (part[0], dims) + part[2:]
        out.append(part)
    return tuple(out)


def _class_hit(state, options, layer, guard, args, kwargs):
    """``(gi, run, plan arguments, record)`` for a call on a whole graph of a class whose
    settled decision has a class run, else ``None``."""
    g = args[0]
    if getattr(g, "is_block", True) or not hasattr(g, "_graph"):
        return None
    gi = graph_info(g)
    entries = state.class_fast.get(_size_free(guard, gi))
    if not entries:
        return None
    # a graph called again and again gets a fast path of its own (``_remember``): the calls it
    # takes here count as there, and the call that reaches the count takes the normal path
    table = state.fast.get(gi)
    seen = 0 if table is None else table.get(_SEEN, _FAST_AFTER)
    if seen >= _FAST_AFTER - 1:
        return None
    shape = None
    for record, entry, structural in entries:
        if shape is None or shape[0] != structural:
            shape = (structural, graph_shape(gi, structural))
        if not all(abs(a - b) <= SHAPE_SLACK for a, b in zip(record["shape"], shape[1])):
            continue
        decision = record["decision"]
        if isinstance(decision, Trial):
            return None
        training = guard[_GRAD] and _any_requires_grad(layer)
        feat = args[entry.feat] if type(entry.feat) is int else entry.feat(args, kwargs)
        ident = input_identity(feat) if options.reuse_inputs else None
        run = entry.runs.get((training, _repeats(state, feat, ident)))
        if run is None or run.fn is not decision[1]:
            return None
        try:
            if not _graph_checks(state, entry.compiled, layer, g, gi):
                return None
            vals = run.bind(layer, gi, args, kwargs)
        except Exception:        # noqa: BLE001 - a failing check: the normal path raises it
            return None
        if vals is None:
            return None
        if table is None:
            table = state.fast[gi] = {}
        table[_SEEN] = seen + 1
        state.last_input = None if ident is None else (weakref.ref(feat), ident)
        return gi, run, vals, record
    return None


def _graph_checks(state, compiled, layer, graph, gi):
    """Whether the checks of ``compiled`` that read the graph alone hold on this graph: the
    layer's own (a zero in-degree check raises) and the branches the variant took on it. Once
    per graph and variant, as the normal path runs them."""
    per_graph = state.decisions.get(gi)
    if per_graph is None:
        per_graph = state.decisions[gi] = {}
    key = ("graph checks", id(compiled))
    if per_graph.get(key):
        return True
    lir = compiled.layer_ir
    names = state.params[0]
    graph_name = names[0]
    module_globals = type(layer).forward.__globals__
    for text, reads in lir.guards:
        if _guard_on_graph(reads, names, module_globals):
            ns = dict(module_globals, self=layer)
            ns[graph_name] = _CheckedGraph(graph, gi)
            exec(check_code(text, "exec"), ns)
    for text, reads, value in lir.spec:
        if set(reads) <= {graph_name} and _graph_condition(
                gi, text, lambda: dict(module_globals, self=layer, **{graph_name: graph})) \
                != value:
            return False
    per_graph[key] = True
    return True


def _class_run(state, options, layer, hit, guard, args, kwargs):
    gi, run, vals, record = hit
    state.class_reused += 1
    if run.fn is None:
        return _fast_run(state, options, layer, (gi, run, vals), args, kwargs)
    rng = torch.get_rng_state()
    try:
        return _fast_run(state, options, layer, (gi, run, vals), args, kwargs)
    except _NOT_THE_PLANS:
        raise
    except Exception:            # noqa: BLE001 - the normal path runs it and decides
        torch.set_rng_state(rng)
        state.calls -= 1
        state.class_reused -= 1
        return _dispatch(state, options, layer, args, kwargs, guard)


def _remember_class(state, layer, guard, call, record, decision, args, kwargs):
    """Keep the run of a class's settled ``decision``, just run the normal way on one of its
    graphs, for the class's later graphs (``_class_hit``)."""
    if isinstance(record["decision"], Trial) or record["decision"][1] is not decision[1]:
        return
    names, defaults, simple = state.params
    if not simple or any(":" in leaf.source[1] for leaf in call.compiled.leaves.values()
                         if leaf.source[0] in ("arg", "edge")):
        return                   # a value read from the graph's frames: sized per graph
    key = _size_free(guard, call.gi)
    entries = state.class_fast.setdefault(key, [])
    mode = (call.training, call.input_repeats)
    for rec, entry, _ in entries:
        if rec is record and entry.compiled is call.compiled and mode in entry.runs:
            return
    try:
        run = _fast_run_of(state, layer, call, decision, len(args), kwargs)
    except Exception:            # noqa: BLE001 - no run: the class's calls take the normal path
        run = None
    if run is None:
        return
    for rec, entry, _ in entries:
        if rec is record and entry.compiled is call.compiled:
            entry.runs[mode] = run
            return
    if len(entries) >= _CLASS_FAST_KEPT:
        entries.pop(0)
    place = _places(names, defaults, len(args), kwargs)
    entry = FastEntry(call.compiled, _arg_reader(names[1], place))
    entry.runs[mode] = run
    entries.append((record, entry, reads_edges(call.compiled.layer_ir.root)))


def _remember(state, layer, guard, call, decision, args, kwargs):
    """Keep ``decision`` (verified, just run the normal way) as this call's fast path.

    Not before ``_FAST_AFTER`` calls on a graph: a sampled block is called once, and a batch
    of graph classification a few times (a readout after each layer); building a run costs
    more than the calls it would speed up there."""
    table = state.fast.get(call.gi)
    if table is None:
        state.fast[call.gi] = {_SEEN: 1}
        return
    seen = table.get(_SEEN, _FAST_AFTER)
    if seen < _FAST_AFTER:
        table[_SEEN] = seen + 1
        return
    entry = table.get(guard)
    if entry is None or entry.compiled is not call.compiled:
        names, defaults, simple = state.params
        if not simple:
            return
        if len(table) >= _FAST_ENTRIES:
            table.clear()
            table[_SEEN] = _FAST_AFTER
        place = _places(names, defaults, len(args), kwargs)
        builds = entry.builds if entry is not None else 0
        entry = table[guard] = FastEntry(call.compiled, _arg_reader(names[1], place),
                                         builds=builds)
    mode = (call.training, call.input_repeats)
    if entry.builds >= _FAST_BUILDS:
        entry.runs.pop(mode, None)
        return
    entry.builds += 1
    try:
        run = _fast_run_of(state, layer, call, decision, len(args), kwargs)
    except Exception:            # noqa: BLE001 - an attribute gone since the call: no run
        run = None
    if run is None:
        entry.runs.pop(mode, None)
    else:
        entry.runs[mode] = run


def _fast_run_of(state, layer, call, decision, n_args, kwargs):
    """A ``FastRun`` of ``decision`` for calls like this one, or ``None`` when the normal path's
    checks cannot all be replaced by its ``bind``: an attribute that no longer has the value the
    variant assumed (a plan that stores one, as SGConv's cache) or an operand of a kind it does
    not know."""
    label, fn, order = decision
    names, defaults, _ = state.params
    compiled = call.compiled
    w = _BindWriter(layer)
    for parts, want_id, want in _config_checks(compiled):
        w.read(parts)
        if not _config_value_holds(w.objs[parts][1], want_id, want):
            return None
        w.same(parts)
    place = _places(names, defaults, n_args, kwargs)
    exprs = {}
    for var, leaf in compiled.leaves.items():
        if leaf.source[0] in COMPUTED and leaf.source[0] != "headdiag":
            continue
        expr = _leaf_expr(w, compiled, var, leaf, place, call.leaf_vals.get(var),
                          fn is not None and var in order)
        if expr is None:
            return None
        exprs[var] = expr
    guards, conditions = _per_call_checks(compiled.layer_ir, names, layer)
    if guards or conditions:
        values = ", ".join(f"{n!r}: {_arg_expr(w, n, place, None)}" for n in names)
        w.lines.append(f"    if not {w.const(_checks_hold)}(m, {{{values}}}, "
                       f"{w.const(guards)}, {w.const(conditions)}): return None")
    bind, source = w.compile([exprs[v] for v in order] if fn is not None else [])
    return FastRun(label, fn, bind, source, recompute_key(call), order)


def _leaf_expr(w, compiled, var, leaf, place, value, used):
    """The expression of ``bind`` reading one leaf as ``_bind`` does, after the reads and
    checks it needs (written whether the plan uses the leaf or not: the normal path checks
    every leaf's size); a view of a weight only when ``used``. ``None`` for a kind the fast path
    does not know."""
    kind = leaf.source[0]
    if kind in ("arg", "edge"):
        return _arg_expr(w, leaf.source[1], place, value)
    if kind == "arg_dst":
        return None if ":" in leaf.source[1] else \
            f"{_arg_expr(w, leaf.source[1], place, None)}[:gi.num_dst]"
    if kind not in ("param", "param_block", "headdiag"):
        return None
    parts = _parts(leaf.source[1])
    obj = w.read(parts)
    shape = getattr(w.objs[parts][1], "shape", None)
    if shape is None:
        return None
    w.shape(obj, shape)
    if used and (kind == "param_block" or leaf.transposed):
        return f"{w.const(_view)}({w.const(compiled)}, {var!r}, {w.const(leaf)}, {obj})"
    return obj


def _arg_expr(w, name, place, value):
    """A forward() argument (its shape is in the call guard), or ``srcdata:h`` / ``edata:w``
    read from the graph, whose shape must be ``value``'s (a frame's value can be replaced)."""
    if ":" in name:
        frame, key = name.split(":", 1)
        var = f"e{len(w.lines)}"
        w.lines.append(f"    {var} = getattr(a[0], {frame!r})[{key!r}]")
        w.shape(var, value.shape)
        return var
    where, at = place[name]
    if where == "pos":
        return f"a[{at}]"
    return f"k[{at!r}]" if where == "kw" else w.const(at)


def _guard_on_graph(reads, names, module_globals):
    """Whether a check of the layer's source reads nothing but the graph (``names[0]``, the
    forward's first parameter) and the module: once it held on a graph it holds for every call
    on it."""
    return {n for n in reads if n in names or n not in module_globals} <= {names[0], "self"}


def _graph_condition(gi, text, namespace):
    """A branch condition that reads the graph alone, evaluated once per graph (``namespace()``
    gives what it reads when it must be)."""
    ckey = ("condition", text)
    now = gi.cache.get(ckey)
    if now is None:
        now = gi.cache[ckey] = bool(eval(check_code(text, "eval"), namespace()))
    return now


def _per_call_checks(lir, names, module):
    """The checks of a variant the normal path runs on every call, compiled: ``(guards,
    conditions)``, the layer's own checks and the conditions the variant branched on that read
    more than the graph (a guard: than the graph and the module). The others ran for this graph
    and hold for every call on it."""
    graph_name = names[0]
    module_globals = type(module).forward.__globals__
    guards = [check_code(text, "exec") for text, reads in lir.guards
              if not _guard_on_graph(reads, names, module_globals)]
    conditions = [(check_code(text, "eval"), value) for text, reads, value in lir.spec
                  if not set(reads) <= {graph_name}]
    return guards, conditions


def _checks_hold(module, values, guards, conditions):
    """Run ``_per_call_checks`` as the normal path does, in one namespace per call: the
    module's globals, the forward's arguments and ``self``. A failing guard raises."""
    ns = dict(type(module).forward.__globals__)
    ns.update(values)
    ns["self"] = module
    for code in guards:
        exec(code, ns)
    return all(bool(eval(code, ns)) == value for code, value in conditions)


def _places(names, defaults, n_args, kwargs):
    """Where each forward() parameter's value is in a call: ``("pos", i)``, ``("kw", name)`` or
    ``("default", value)``."""
    place = {}
    for i, n in enumerate(names):
        if i < n_args:
            place[n] = ("pos", i)
        elif n in kwargs:
            place[n] = ("kw", n)
        else:
            place[n] = ("default", defaults[n])
    return place


def _arg_reader(name, place):
    """Where the forward() argument ``name`` is: its position among the arguments, or a
    function of ``(args, kwargs)`` reading it."""
    where, at = place[name]
    if where == "pos":
        return at
    if where == "kw":
        return lambda a, k: k[at]
    return lambda a, k: at


def _repeats(state, feat, ident):
    """Whether ``feat`` is the previous call's features, unchanged: the same object (held by
    weak reference) with the same storage and version (``ident``, ``None`` when not tracked)."""
    last = state.last_input
    return ident is not None and last is not None and last[0]() is feat and last[1] == ident


def _any_requires_grad(module):
    """``any(p.requires_grad for p in module.parameters())``, without building the generator."""
    for p in module._parameters.values():
        if p is not None and p.requires_grad:
            return True
    return any(m is not None and _any_requires_grad(m) for m in module._modules.values())


# -- deciding ----------------------------------------------------------------------------------------
ORIGINAL = "original forward"
TRIAL_ROUNDS = 3         # timed calls per candidate, after one untimed call each
TRIAL_DROP = 1.5         # a candidate whose fastest timed call is this much slower is dropped
TRIAL_DROP_ONE = 2.0     # ... on sampled blocks, while a candidate has only one timed call
TRIAL_FIRST_DROP = 4.0   # ... or whose untimed first call is this much slower than a timed one
TRIAL_FIRST_EXCESS = 0.001  # ... and by this many seconds (beyond timer noise)
ORIGINAL_MARGIN = 0.05   # a plan is kept over the layer's own forward when this much faster


def decision_key(call):
    """What a saved decision is looked up by: signature, sizes and mode (no object identities)."""
    present, is_block, config = call.key[1:]
    return repr((sorted(present), is_block, config, sorted(call.symbols.items()),
                 call.training, call.input_grad, call.input_repeats))


def decide(state, options, call):
    """Rank the promoted plans for this call and compile the cheapest: ``(label, fn, leaf order)``;
    or a ``Trial`` when many calls follow and tuning is on (``granii(..., tune=True)``); or the
    decision given by ``granii(..., decisions=...)`` for this call, without ranking."""
    dk = decision_key(call)
    preset = (options.decisions or {}).get(state.name, {}).get(dk)
    if preset is not None:
        return _preset(state, call, dk, preset)
    decided = _decide(state, options, call)
    kept = decided.candidates[0] if isinstance(decided, Trial) else decided
    state.chosen[dk] = _describe(kept, call)
    return decided


def _plan_part(label):
    """``[i]`` of a trial label ``[i]`` or ``[i] impl/impl..`` (a plan's implementation
    variant)."""
    return label.split(" ")[0]


def _describe(decision, call):
    label = decision[0]
    if label == ORIGINAL:
        return {"plan": ORIGINAL}
    plan = next(p for p in call.compiled.plans if f"[{p.index}]" == _plan_part(label))
    return {"plan": str(plan.index), "impls": list(decision[3]) if len(decision) > 3 else None,
            "composition": plan.composition()}


def _preset(state, call, dk, preset):
    if preset["plan"] == ORIGINAL:
        return (ORIGINAL, None, None)
    plan = next((p for p in call.compiled.plans if str(p.index) == preset["plan"]), None)
    if plan is None or preset.get("impls") is None:
        raise ValueError(f"granii: the saved decision for layer '{state.name}' names plan "
                         f"{preset['plan']}, which this version of granii does not have for "
                         "this call: decide again (leave out decisions=)")
    try:
        fn, _ = compile_plan(plan, tuple(preset["impls"]))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"granii: the saved decision for layer '{state.name}' names kernels "
                         f"{list(preset['impls'])} that this version of granii does not have for "
                         f"plan {plan.index}: decide again (leave out decisions=)") from None
    state.chosen[dk] = preset
    return (f"[{plan.index}]", fn, leaf_vals_order(plan), tuple(preset["impls"]))


def _decide(state, options, call):
    model = options.model()
    state.ranked += 1
    calls = 1 if call.gi.is_block else options.expected_calls
    ranking = rank(call.compiled.plans, call.gi, call.symbols, model, call.training,
                   call.input_grad, calls, call.input_repeats)
    if options.memory_limit is not None:
        ranking = within_memory(ranking, call.symbols, options.memory_limit)
    best = ranking[0]
    fn, code = compile_plan(best.plan, best.impls)
    state.last = (call.symbols, ranking, best, code, call.training,
                  getattr(model, "name", type(model).__name__))
    chosen = (f"[{best.plan.index}]", fn, leaf_vals_order(best.plan), best.impls)
    if not _tuning(options, call):
        return chosen
    cands = [chosen]
    for c in trial_candidates(ranking)[1:]:
        f, _ = compile_plan(c.plan, c.impls)
        label = f"[{c.plan.index}]"
        if any(label == _plan_part(lb) for lb, *_ in cands):     # another implementation
            label += " " + "/".join(i for i in c.impls if i != "inline")
        cands.append((label, f, leaf_vals_order(c.plan), c.impls))
    # DGL runs Python message and reduce functions once per degree bucket: timing that forward
    # would cost several calls at many times a plan's time, and it never wins
    if not getattr(call.compiled.layer_ir, "udfs", ()):
        cands.append((ORIGINAL, None, None))
    # each sampled block is new, so a candidate's first call on one is like its later calls
    return Trial(cands, warm=0 if call.gi.is_block else 1) if len(cands) > 1 else chosen


def within_memory(ranking, symbols, limit):
    """The choices whose predicted peak extra memory (``memory.plan_memory``) is at most
    ``limit`` bytes, cheapest first; if none is, the one that needs the least."""
    peak = {id(c): sum(plan_memory(c.plan, symbols)) for c in ranking}
    ok = [c for c in ranking if peak[id(c)] <= limit]
    return ok or [min(ranking, key=lambda c: peak[id(c)])]


def _tuning(options, call):
    """A measured tie-break is worth its calls: many calls follow (on sampled blocks, the later
    blocks of the same sampler configuration, unless each block decides on its own)."""
    if call.gi.is_block and options.per_batch:
        return False
    return (options.tune and options.expected_calls > 1
            and not torch.are_deterministic_algorithms_enabled())


_INSPECTING = [False]


@contextlib.contextmanager
def inspecting(model, blocks):
    """While ``granii(...)`` runs ``model`` once to decide: each layer decides as on any call,
    but a measured tie-break runs its predicted best untimed (no backward follows this run, so
    its time would not be a training call's). On sampled ``blocks`` no layer then counts the
    features of that run as seen: the next call is the first batch's training step, on the
    same features, and should take the decision made for the new features of the later batches.
    On a whole graph the next call on the same features is a repeat, as the calls after it."""
    previous = _INSPECTING[0]
    _INSPECTING[0] = True
    try:
        yield
    finally:
        _INSPECTING[0] = previous
        if blocks:
            for st in layer_states(model):
                st.last_input = None


@dataclass
class Trial:
    """A measured tie-break (like cuDNN's benchmark mode): the best predicted plan, the next one
    when predicted within ``TRIAL_MARGIN`` of it, the best plan with another implementation of a
    graph kernel when predicted within that margin too (``select.trial_candidates``), and the
    layer's original forward take turns on the first calls of a decision (each call returns the
    same result); after one untimed and ``TRIAL_ROUNDS`` timed calls each, the one with the
    fastest median time is kept: the forward, and in training the forward and the layer's
    backward (``BackwardClock``), recorded when the next call comes.
    So a wrong prediction costs at most those calls, and granii is never kept slower than DGL's
    own layer as measured. A candidate whose fastest timed call is more than ``TRIAL_DROP``
    times the fastest timed call of another leaves the trial at once (``drop_slow``): a plan
    priced far too low (a per-head plan predicted at 43 ms ran 160 ms in training on a PubMed
    block) then costs two calls, not four (on sampled blocks, one when ``TRIAL_DROP_ONE`` times
    slower). One whose untimed first call alone exceeds
    ``TRIAL_FIRST_DROP`` times another's fastest timed call, and by ``TRIAL_FIRST_EXCESS``
    seconds, leaves before its timed call: DGL's GATConv on GitHub at 32 -> 128, 53 ms a call
    beside a 4 ms plan, then runs once, not twice (its second call was a tenth of the first 100
    calls' time). The factor leaves room for a first call's warm-up (DGL's first call on a graph
    builds its sparse formats): across the 162 single-layer configurations of the benchmark,
    DGL's first call on a new graph took at most 3.05x its later calls (GraphConv, GitHub,
    32 -> 32), so the layer's own forward is not dropped for a slow first call when it would
    have been the fastest.

    On sampled blocks the candidates take turns on successive blocks of one sampler
    configuration, whose sizes differ: each time is divided by the block's size
    ``E + N_src + N_dst`` (``block_scale``), so the medians compare time per unit of work; the
    kept decision then serves the later blocks (``homes``: where it is stored besides the block's
    own table). There no call is left untimed (``warm=0``): the first call on a graph builds
    what later calls on it reuse, and on blocks used once every call does that, so a candidate's
    first call is one of its ``TRIAL_ROUNDS``; the trial then costs a call less per candidate."""
    candidates: list
    warm: int = 1                                 # untimed first calls per candidate
    times: dict = field(default_factory=dict)
    turn: int = 0
    homes: list = field(default_factory=list)     # [(dict, key)] that get the kept decision
    pending: list = field(default_factory=list)   # [(label, forward seconds, BackwardClock)]
    dropped: list = field(default_factory=list)   # candidates ``drop_slow`` took out

    def next(self):
        if _INSPECTING[0]:           # ``granii(...)``'s own run is no turn: the predicted best
            return self.candidates[0]
        c = self.candidates[self.turn % len(self.candidates)]
        self.turn += 1
        return c

    def record(self, label, seconds):
        if not _INSPECTING[0]:
            self.times.setdefault(label, []).append(seconds)

    def await_backward(self, label, seconds, clock):
        """Record this call (``seconds`` of forward) when its backward has run (``collect``);
        not the calls of ``granii(...)``'s own run, which no backward follows."""
        if _INSPECTING[0]:
            clock.remove()
        else:
            self.pending.append((label, seconds, clock))

    def collect(self):
        """Record the calls whose backward was awaited: forward + backward seconds (the
        forward alone when no backward ran)."""
        for label, forward, clock in self.pending:
            clock.remove()
            self.record(label, forward + (clock.seconds() or 0.0))
        self.pending.clear()

    def settled(self):
        return all(len(self.times.get(c[0], ())) >= self.warm + TRIAL_ROUNDS
                   for c in self.candidates)

    def done(self):
        """Every candidate timed enough, or one left (the others raised or were dropped)."""
        return self.settled() or len(self.candidates) == 1

    def close(self):
        """Forget the calls whose backward was awaited: their hooks leave the parameters."""
        for _, _, clock in self.pending:
            clock.remove()
        self.pending.clear()

    def drop_slow(self):
        """Take out the candidates whose fastest timed call (after the untimed first, if any)
        exceeds ``TRIAL_DROP`` times another's fastest, once each has two calls; before that, those
        whose untimed first call exceeds ``TRIAL_FIRST_DROP`` times another's fastest timed
        call and by ``TRIAL_FIRST_EXCESS`` seconds. On sampled blocks (no untimed call) a
        candidate leaves after its first call when that is over ``TRIAL_DROP_ONE`` times
        another's: one time each, on blocks of their own, asks for the wider margin."""
        best = {c[0]: min(self.times[c[0]][self.warm:]) for c in self.candidates
                if len(self.times.get(c[0], ())) > self.warm}
        if not best:
            return
        slow = []
        for c in self.candidates:
            ts = self.times.get(c[0], ())
            others = [t for label, t in best.items() if label != c[0]]
            if (len(ts) == 1 and others and ts[0] > TRIAL_FIRST_DROP * min(others)
                    and ts[0] - min(others) > TRIAL_FIRST_EXCESS):
                slow.append(c)
        if len(best) == len(self.candidates) and len(best) >= 2:
            floor = min(best.values())
            once = self.warm == 0 and any(len(self.times[c[0]]) == 1 for c in self.candidates)
            factor = TRIAL_DROP_ONE if once else TRIAL_DROP
            slow += [c for c in self.candidates if best[c[0]] > factor * floor]
        self.dropped += slow
        self.candidates = [c for c in self.candidates if c not in slow]

    def medians(self):
        timed = {label: ts[self.warm:] or ts for label, ts in self.times.items() if ts}
        return {label: sorted(ts)[len(ts) // 2] for label, ts in timed.items()}

    def winner(self):
        """The fastest median; but a plan replaces the layer's own forward only when it beat it
        by ``ORIGINAL_MARGIN``: a few timed calls of a large layer carry several percent of
        noise (and the original's first calls build DGL's formats), and a plan kept by noise
        would be slower than DGL on every later call."""
        med = self.medians()
        timed = [c for c in self.candidates if c[0] in med]
        if not timed:
            return self.candidates[0]
        best = min(timed, key=lambda c: med[c[0]])
        original = next((c for c in timed if c[0] == ORIGINAL), None)
        if original is not None and med[best[0]] > (1 - ORIGINAL_MARGIN) * med[ORIGINAL]:
            return original
        return best

    def report(self):
        med = self.medians()
        return [(c[0], med[c[0]]) for c in self.candidates + self.dropped if c[0] in med]


def _trial_call(state, per_graph, dkey, trial, call, layer, args, kwargs):
    trial.collect()
    trial.drop_slow()
    label, fn, order = trial.next()[:3]
    scale = _trial_scale(trial, call)
    t0 = time.perf_counter()
    out = _run(state, dkey, label, fn, order, call, layer, args, kwargs)
    seconds = (time.perf_counter() - t0) / scale
    if state.ran.kind != "fallback" and not _INSPECTING[0]:
        state.ran = Ran(state.ran.kind, label, "a turn of the measured tie-break")
    clock = BackwardClock.of(out, layer, args, scale)
    if clock is None:
        trial.record(label, seconds)
    else:                       # in training the backward counts too: recorded on the next call
        trial.await_backward(label, seconds, clock)
    if dkey in state.failed:                  # a candidate raised: the others go on
        del state.failed[dkey]
        trial.candidates = [c for c in trial.candidates if c[0] != label]
        trial.times.pop(label, None)
    if trial.done():
        trial.close()
        per_graph[dkey] = trial.winner() if trial.times else trial.candidates[0]
        for home, key in trial.homes:
            home[key] = per_graph[dkey]
        state.tuned = ([(lb, t * scale) for lb, t in trial.report()], per_graph[dkey][0])
        state.chosen[decision_key(call)] = _describe(per_graph[dkey], call)
    return out


class BackwardClock:
    """The seconds of one layer call's backward: from its output's gradient to the last
    gradient of its inputs and parameters, read by tensor hooks that are removed once read
    (sequential models run a layer's backward in one stretch). Divided by ``scale``."""

    def __init__(self, out, tensors, scale):
        self.start = self.end = None
        self.scale = scale
        self.handles = [out.register_hook(self._start)]
        self.handles += [t.register_hook(self._stop) for t in tensors]

    @classmethod
    def of(cls, out, layer, args, scale):
        """A clock for ``out`` when a backward through it can follow, else ``None``."""
        if not (isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled()):
            return None
        tensors = [p for p in layer.parameters() if p.requires_grad]
        tensors += [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        return cls(out, tensors, scale) if tensors else None

    def _start(self, grad):
        self.start = time.perf_counter()

    def _stop(self, grad):
        self.end = time.perf_counter()

    def seconds(self):
        if self.start is None or self.end is None or self.end < self.start:
            return None
        return (self.end - self.start) / self.scale

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def block_scale(call):
    """The size a trial time on a sampled block is divided by (1 on whole graphs)."""
    if not call.gi.is_block:
        return 1.0
    s = call.symbols
    return float(max(s.get("E", 0) + s.get("N_src", 0) + s.get("N_dst", 0), 1))


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


def _config_holds(variant, module):
    try:
        return all(config_summary(attribute(module, a)) == v
                   for a, v in getattr(variant, "config", {}).items())
    except AttributeError:
        return False


def input_identity(t):
    """What identifies a tensor's value without reading it, beside the object itself (held by
    weak reference: a new tensor at a freed one's address is another tensor): its storage and
    version. ``None`` for tensors without a version counter (made under ``inference_mode``)."""
    if t.is_inference():
        return None
    return (t.data_ptr(), t._version)


def _variant(state, module, key, values, gi):
    """The compiled variant of this call signature whose assumptions hold for this call: the
    module attributes it branched on and the graph-dependent branches it took."""
    variants = state.compiled.setdefault(key, [])
    for v in variants:
        if _holds(v, module, values, gi):
            return v
    v = compile_layer(module, key[0], key[1], dict(values, self=module))
    variants.append(v)
    return v


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


_ATTR_PATHS = {}
_MISSING = object()
_CLASS_DEFINES = {}


def attribute(obj, dotted):
    """``obj.a.b.c`` for ``dotted = "a.b.c"`` (submodules of a ``Sequential`` by index too).

    A module's parameters, buffers and submodules are read from its dictionaries directly (what
    ``nn.Module.__getattr__`` does after a failed ordinary lookup), unless its class defines the
    name."""
    return _walk(obj, _parts(dotted))


def _get(obj, name):
    cls = type(obj)
    defines = _CLASS_DEFINES.get((cls, name))
    if defines is None:
        defines = _CLASS_DEFINES[(cls, name)] = (
            hasattr(cls, name) or not isinstance(obj, torch.nn.Module))
    if not defines:
        d = obj.__dict__
        v = d.get(name, _MISSING)
        if v is not _MISSING:
            return v
        for store in ("_parameters", "_buffers", "_modules"):
            v = d[store].get(name, _MISSING)
            if v is not _MISSING:
                return v
    return getattr(obj, name)


def _parts(dotted):
    parts = _ATTR_PATHS.get(dotted)
    if parts is None:
        parts = _ATTR_PATHS[dotted] = tuple(dotted.split("."))
    return parts


def _walk(obj, parts):
    for part in parts:
        obj = _get(obj, part)
    return obj


def _config_checks(variant):
    """``[(path parts, Same or None, summary)]`` of the module attributes a variant assumed (made
    once per variant): attributes holding an object are checked by identity with the object
    held (``rules.Same``), the others by ``config_summary``."""
    checks = getattr(variant, "config_checks", None)
    if checks is None:
        config = (variant.layer_ir.config if isinstance(variant, Compiled)
                  else getattr(variant, "config", {}))
        checks = variant.config_checks = [
            (_parts(a), v if isinstance(v, Same) else None, v) for a, v in config.items()]
    return checks


def _config_value_holds(now, same, want):
    if same is not None:
        return same.holds(now)
    return now is want or config_summary(now) == want


def _holds(variant, module, values, gi):
    spec = (variant.layer_ir.spec if isinstance(variant, Compiled)
            else getattr(variant, "spec", []))
    for parts, want_id, want in _config_checks(variant):
        try:
            now = _walk(module, parts)
        except AttributeError:
            return False
        if not _config_value_holds(now, want_id, want):
            return False
    graph_name = next(iter(values))
    ns = []

    def namespace():
        if not ns:
            ns.append(dict(type(module).forward.__globals__, **values, self=module))
        return ns[0]
    for text, names, value in spec:
        if set(names) <= {graph_name}:
            now = _graph_condition(gi, text, namespace)
        else:
            now = bool(eval(check_code(text, "eval"), namespace()))
        if now != value:
            return False
    return True


# (IR root, heads) -> (trees enumerated, plans, plans promoted, binary orders): enumeration,
# pruning and lowering read nothing but the IR, whose nodes compare by structure and name the
# layer's functions by where they are found (``ir.Apply.ref``), so two instances of one layer
# with the same configuration share them (TAGConv's took 35-65 ms per instance on Cora)
_ENUMERATED = {}
_ENUMERATED_MAX = 256


def compile_layer(module, present, is_block, real=None):
    """The offline stage for one call signature: a ``Compiled``, or the exception that stopped
    it (every exception: whatever goes wrong, the original forward runs)."""
    try:
        lir = lower_layer(module, present, is_block, real)
    except (FrontendError, RaisesForConfig) as e:
        return e
    except Exception as e:       # noqa: BLE001
        return _failure("the frontend", e)
    return compiled(lir, type(module).__name__)


def compiled(lir, name):
    """The ``Compiled`` plans of a lowered layer (any frontend's), or the exception that stopped
    its enumeration; the enumerated plans of one IR are shared by every layer that lowers to it."""
    key = (lir.root, lir.heads)
    done = _ENUMERATED.get(key)
    if done is None:
        done = _enumerate(lir, name)
        if isinstance(done, Exception):
            return done
        if len(_ENUMERATED) >= _ENUMERATED_MAX:
            _ENUMERATED.pop(next(iter(_ENUMERATED)))
        _ENUMERATED[key] = done
    n_trees, plans, n_promoted, n_orders, note = done
    leaves = {v: l for plan in plans for v, l in plan.leaves.items()}
    return Compiled(lir, n_trees, list(plans), leaves, n_promoted, n_orders, note)


def _enumerate(lir, name):
    """``(trees enumerated, promoted plans then their fused variants, plans promoted, binary
    orders, note)`` of a layer's IR, or the exception that stopped it.

    Enumeration, pruning and lowering share one budget (``enumerate.budget_seconds()``); when
    enumeration spends it, the layer is associated as written and ``note`` says so (``explain``
    prints it): a decision never waits on a search."""
    budget = budget_seconds()
    start = enum_clock()
    try:
        found = enumerate_layer(lir.root, deadline=start + budget if budget > 0 else None)
        forest = found.forest
        kept = prune([tree_calls(root, choice) for root, choice in forest])
        promoted = [fuse_gemm_add(lower(i, *forest[t], scenarios, heads=lir.heads))
                    for i, (t, scenarios) in enumerate(sorted(kept.items()))]
    except TooManyTrees as e:
        e.spec, e.config = lir.spec, lir.config
        return e
    except Exception as e:       # noqa: BLE001
        err = _failure("enumeration or lowering", e)
        err.spec, err.config = lir.spec, lir.config
        return err
    n_promoted = len(promoted)
    try:
        promoted += [f for plan in promoted for f in fused_variants(plan)]
    except Exception as e:       # noqa: BLE001 - the unfused plans still hold
        warnings.warn(f"granii: fusing the plans of {name} failed ({e})")
    note = ""
    if found.budget_hit:
        note = (f"decision budget of {budget:g} CPU s spent after {found.n_forms} sub-expressions: "
                f"the layer is associated as written ({len(forest)} trees); "
                "GRANII_DECISION_BUDGET (seconds) allows more")
    return found.n_trees, tuple(promoted), n_promoted, binary_orders(lir.root), note


def every_plan(compiled):
    """Every association tree of a compiled layer as a plan, pruned or not (pruned ones indexed
    ``p<i>``), with their fused variants: for measuring what pruning removed. The promoted plans
    come first, as in ``compiled.plans``."""
    lir = compiled.layer_ir
    forest, _ = layer_forest(lir.root, exhaustive=True)
    seen = {(p.composition(), str(p.choice)) for p in compiled.plans}
    extra = []
    for i, (root, choice) in enumerate(forest):
        plan = fuse_gemm_add(lower(f"p{i}", root, choice, (), heads=lir.heads))
        if (plan.composition(), str(plan.choice)) in seen:
            continue
        seen.add((plan.composition(), str(plan.choice)))
        extra.append(plan)
    extra += [f for plan in extra for f in fused_variants(plan)]
    return list(compiled.plans) + extra


def _failure(stage, e):
    return FrontendError(f"an error in {stage}", f"{type(e).__name__}: {e} (the original "
                         "forward runs; please report this)")


def run_plan(call, plan, impls):
    """Run ``plan`` with kernel implementations ``impls`` on a prepared call (compiled each time:
    for tests and benchmarks; the dispatcher caches its compiled choice)."""
    fn, _ = compile_plan(plan, impls)
    return fn(call.gi, call.module, *(call.leaf_vals[v] for v in leaf_vals_order(plan)))


_GRAPH_SYMBOLS = ("N", "N_src", "N_dst", "E")


SHAPE_SLACK = 0.75      # log2 units: how far a block's shape may lie from a decided one's


def sampler_key(call):
    """What identifies a sampler configuration on a block: the call signature, the sizes that
    are not graph sizes or densities, and log2 of edges per destination and of sources per
    destination, rounded."""
    sizes = tuple((k, v) for k, v in call.sym_key if k not in _GRAPH_SYMBOLS)
    return ("sampled", call.key, sizes, tuple(round(v) for v in _block_shape(call.symbols)))


def _block_shape(s):
    n_dst = max(s.get("N_dst", s.get("N", 1)), 1)
    return (math.log2(max(s["E"], 1) / n_dst), math.log2(max(s.get("N_src", n_dst), 1) / n_dst))


def _sampler_decision(state, call, mode):
    """``(key, decision or None)`` of a block's sampler configuration. A block whose shape lies
    within ``SHAPE_SLACK`` of a configuration already seen takes that one: the blocks of one
    sampler scatter around their mean, and where the mean lies near a rounding boundary (log2
    of 1.45 sources per destination, say) they would otherwise fall on both sides of it and
    start a second tie-break."""
    key = sampler_key(call) + mode
    decision = state.sampled.get(key)
    if decision is None:
        shape = _block_shape(call.symbols)
        for other, seen in state.sampled.items():
            if (other[:3] == key[:3] and other[4:] == key[4:]
                    and all(abs(a - b) <= SHAPE_SLACK for a, b in zip(other[3], shape))):
                return other, seen
    return key, decision


# -- classes of whole graphs -------------------------------------------------------------------------
# Graph classification trains on a new ``dgl.batch`` of small graphs at every step: a new graph
# object per call, of about the same sizes. A layer decides (ranks, and starts a tie-break) on
# the first graph of a class and reuses that decision for every later graph of the class, as a
# sampler configuration's first block decides for the later blocks.
_CLASSES_KEPT = 32       # classes kept per call signature, sizes and mode (the oldest dropped)
_VERIFIED_KEPT = 256     # (decision key, plan) pairs kept as verified (then counted afresh)


def graph_class_key(call):
    """What a class of whole graphs shares: the call signature and the sizes that are not graph
    sizes (``N``, ``E``), as ``sampler_key``; the graph's own ``class_shape`` is compared
    within ``SHAPE_SLACK`` (``_class_decision``)."""
    sizes = tuple((k, v) for k, v in call.sym_key if k not in _GRAPH_SYMBOLS)
    return ("graph", call.key, sizes)


def graph_shape(gi, structural=True):
    """``featurize.class_shape`` of a whole graph, once per graph. With the native kernels the
    degrees come from the pass that builds their index (``native.csr_index``), which their
    plans read next. A layer that reads no edge of the graph (a readout) is placed by its sizes
    alone (``structural`` false): counting degrees would cost it more than its call."""
    if not structural:
        return class_shape(gi.num_src, gi.num_edges, None, None, (0.0, 0.0, 0.0))

    def make():
        graph_index(gi)
        stats = gi.cache.get("degree_stats")
        return class_shape(gi.num_src, gi.num_edges, gi.in_degrees(), gi.out_degrees(),
                           None if stats is None else stats.tolist())
    return gi.memo("class_shape", make)


def _class_decision(state, call, mode):
    """``(key, shape, record or None)``: the class of this whole graph among those this layer
    decided for, its ``class_shape`` within ``SHAPE_SLACK`` of the class's first graph in every
    coordinate (sizes and degree statistics within a factor of 1.7). A graph like none of them
    decides anew (``_new_class``)."""
    key = graph_class_key(call) + mode
    shape = graph_shape(call.gi, reads_edges(call.compiled.layer_ir.root))
    for record in state.classes.get(key, ()):
        if all(abs(a - b) <= SHAPE_SLACK for a, b in zip(record["shape"], shape)):
            return key, shape, record
    return key, shape, None


_EDGE_SOURCES = ("graph", "edge", "degree", "wdegree", "select")


def reads_edges(root):
    """Whether the layer IR ``root`` reads the graph's edges (an adjacency, degrees, edge
    values or an aggregation over in-edges), or only its sizes and batch (a readout)."""
    if isinstance(root, ir.Leaf):
        return root.source[0] in _EDGE_SOURCES
    if isinstance(root, ir.Aggregate):
        return root.out_rows is None or reads_edges(root.x)
    if isinstance(root, (ir.EdgeScore, ir.EdgeSoftmax, ir.SparseEdges)):
        return True
    return any(reads_edges(c) for c in ir.children(root))


def _new_class(state, key, shape, decision, call):
    """Keep ``decision`` for the class of ``call``'s graph: a record ``{"shape", "decision",
    "size"}`` (``size``: the work ``E + N`` of the graph that decided, which the tie-break's
    times on the class's other graphs are scaled to)."""
    records = state.classes.setdefault(key, [])
    if len(records) >= _CLASSES_KEPT:
        records.pop(0)
    record = {"shape": shape, "decision": decision, "size": _graph_work(call)}
    records.append(record)
    return record


def _graph_work(call):
    s = call.symbols
    return float(max(s.get("E", 0) + s.get("N", 0) + s.get("N_src", 0) + s.get("N_dst", 0), 1))


def _trial_scale(trial, call):
    """What a tie-break's time of this call is divided by: the block's size on sampled blocks
    (``block_scale``); on a whole graph the ratio of its work to that of the graph whose class
    the trial decides for (1 on that graph itself), so the turns taken on a class's graphs of
    different sizes compare."""
    if call.gi.is_block:
        return block_scale(call)
    size = next((home["size"] for home, key in trial.homes if key == "decision"), None)
    return 1.0 if size is None else _graph_work(call) / size


def leaf_vals_order(plan):
    return [v for v, l in plan.leaves.items() if l.source[0] not in COMPUTED]


def _unsupported_input(graph, feat):
    if not hasattr(graph, "is_block") or not hasattr(graph, "num_src_nodes"):
        return f"a first argument of type {type(graph).__name__}, not a DGL graph"
    if len(graph.srctypes) > 1 or len(graph.dsttypes) > 1 or len(graph.canonical_etypes) > 1:
        return "a heterogeneous graph (more than one node or edge type) is not optimized yet"
    if isinstance(feat, (tuple, list)):
        return "a pair of (source, destination) features is not optimized yet"
    if not isinstance(feat, torch.Tensor):
        return f"features of type {type(feat).__name__}"
    if feat.dim() != 2:
        return f"features with {feat.dim()} dimensions (only N x k features are optimized)"
    if feat.device.type != "cpu" or feat.dtype != torch.float32:
        return f"features of dtype {feat.dtype} on {feat.device} (float32 on CPU is optimized)"
    return None


_CHECK_CODE = {}


def check_code(text, mode):
    """``compile(text)`` of a check kept from a layer's source, once per text."""
    code = _CHECK_CODE.get((text, mode))
    if code is None:
        code = _CHECK_CODE[(text, mode)] = compile(text, "<check from the layer's source>", mode)
    return code


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
    if native.available():
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


# (claims(module), prepare(state, module, args, kwargs, reuse_inputs)) of frontends other than
# DGL's: granii/pyg registers PyTorch Geometric's layers when imported (granii/api.py imports it)
CALL_BINDERS = []
_PYG_CLASSES = {}


def is_pyg_layer(module):
    """A PyTorch Geometric ``MessagePassing`` layer (lowered by ``granii/pyg``), known by its
    class, without importing PyG."""
    cls = type(module)
    hit = _PYG_CLASSES.get(cls)
    if hit is None:
        hit = _PYG_CLASSES[cls] = any(c.__name__ == "MessagePassing" and
                                      c.__module__.startswith("torch_geometric")
                                      for c in cls.__mro__)
    return hit


def dispatcher_of(module):
    """The ``Dispatcher`` set on ``module`` by ``granii``, or ``None``."""
    d = module.__dict__.get("forward")
    return d if isinstance(d, Dispatcher) else None


def layer_states(model):
    """The dispatcher states of the optimized layers of ``model``."""
    out = []
    for _, m in model.named_modules():
        d = dispatcher_of(m)
        if d is not None:
            if d.state is None:
                d.state = new_state(m, d._name)
            out.append(d.state)
    return out
