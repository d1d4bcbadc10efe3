"""The repeated-call path: a guard of a call (``call_guard``) and, once a verified decision has run
on a graph ``_FAST_AFTER`` times, a generated function (``_BindWriter``) that proves the
configuration the variant assumed and reads the plan's operands live, skipping the binding."""
import weakref
from dataclasses import dataclass, field

import torch

from .. import diskcache
from ..graph import known_info
from ..plan import COMPUTED
from .bind import _repeats, _view, input_identity, recompute_key
from .state import _any_requires_grad
from .variants import _config_checks, _config_value_holds, _get, _guard_on_graph, _parts, check_code


# -- the fast path -----------------------------------------------------------------------------------
# A call whose decision ran the normal way leaves a ``FastEntry`` behind, kept per graph and per
# call guard; a later call with the same guard on the same graph runs that decision after a few
# identity and shape checks, without binding, checking sizes or looking the decision up again.
_GRAD = 0                # where ``torch.is_grad_enabled()`` is in a call guard
_TRAINING = 3            # ... and ``layer.training``
_PLAIN = (type(None), bool, int, float, str)
_FAST_ENTRIES = 32       # fast entries kept per (layer, graph): guards beyond that are rare
_FAST_AFTER = 6          # normal-path calls on a graph before its fast path is built
_SEEN = object()         # the key of that count in a graph's table (never a call guard)
_FAST_BUILDS = 16        # runs made per entry: an attribute re-assigned on every call (or a run
                         # that cannot be made) leaves the calls to the normal path, unpaid for


def call_guard(layer, args, kwargs, graph_at=0):
    """What a call's fast path is keyed by, or ``None`` when the call cannot have one.

    ``(grad mode, threads, deterministic algorithms, layer.training, number of positional
    arguments, the guard of each argument but the graph, then each keyword with its guard)``;
    the graph is the positional argument ``graph_at`` (DGL's layers take it first, PyG's
    second, after the features).
    A tensor's guard is its type, shape, dtype, whether it is on the CPU (only CPU tensors are
    optimized: the normal path runs any other) and ``requires_grad``; a plain value's (``None``,
    bool, int, float, str) its type and ``repr`` (what the normal path keys a call signature
    by); other values have none. The graph is not in it: fast entries are kept per
    ``GraphInfo``, which is new for a new graph and for a graph edited in place. (Inference
    mode needs no place: it turns gradients off, and what else depends on it, the plans and
    their caches check at run time.)"""
    if len(args) <= graph_at:
        return None
    mode = (torch.is_grad_enabled(), torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(), layer.training, len(args))
    if len(args) == 2 and not kwargs:
        g = _value_guard(args[1 - graph_at])
        return None if g is None else mode + (g,)
    parts = list(mode)
    for a in args[:graph_at] + args[graph_at + 1:]:
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
    gi: object = None                                # the graph the plans run on, where the
                                                     # table is keyed by another (``Call.fast_key``)


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
        ns = dict(self.consts)
        # a layer called on many graphs (a new batch each step) writes the same source for each,
        # with its own constants: compiled once (a quarter millisecond)
        exec(diskcache.compiled(source, "<granii fast path>"), ns)
        return ns["bind"], source


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


def _fast_hit(state, options, layer, guard, args, kwargs, graph_key=None):
    """``(gi, run, plan arguments)`` when this call's fast run holds, else ``None``.
    ``graph_key(args)``: what the layer's fast tables are keyed by for a frontend whose graph
    argument is not DGL's first one (``Call.fast_key``); ``None``: DGL's graph ``args[0]``."""
    if graph_key is None:
        gi, table = _fast_table(state, args[0])
    else:
        key = graph_key(args)
        gi, table = None, (None if key is None else state.fast.get(key))
    entry = table.get(guard) if table else None
    if entry is None:
        return None
    gi = entry.gi if entry.gi is not None else gi
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
    gi = held_info(state.hot, g)
    if gi is not None:
        return gi, state.hot[2]
    gi = known_info(g)
    table = None if gi is None else state.fast.get(gi)
    if table is not None:
        state.hot = (weakref.ref(g), weakref.ref(gi), table)
    return gi, table


def held_info(held, g):
    """The ``GraphInfo`` in ``held`` (``(graph, GraphInfo, ...)``, the two by weak reference)
    when it is ``g``'s and ``g``'s structure was not edited since, else ``None``."""
    if held is not None and held[0]() is g:
        gi = held[1]()
        if gi is not None and gi.index is getattr(g, "_graph", None):
            return gi
    return None


def _remember(state, layer, guard, call, decision, args, kwargs):
    """Keep ``decision`` (verified, just run the normal way) as this call's fast path.

    Not before ``_FAST_AFTER`` calls on a graph: a sampled block is called once, and a batch
    of graph classification a few times (a readout after each layer); building a run costs
    more than the calls it would speed up there."""
    key = call.gi if call.fast_key is None else call.fast_key
    table = state.fast.get(key)
    if table is None:
        state.fast[key] = {_SEEN: 1}
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
        feat = names[1] if call.fast_key is None else call.compiled.pyg.feat
        entry = table[guard] = FastEntry(call.compiled, _arg_reader(feat, place),
                                         builds=builds,
                                         gi=None if call.fast_key is None else call.gi)
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
    pir = getattr(compiled, "pyg", None)
    guards, conditions = _per_call_checks(compiled.layer_ir, names, layer,
                                          names[0] if pir is None else pir.graph)
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
        if leaf.source[1] not in place and ":" not in leaf.source[1]:
            return None          # values computed per call (PyG's per-edge values): bound anew
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


def _per_call_checks(lir, names, module, graph_name):
    """The checks of a variant the normal path runs on every call, compiled: ``(guards,
    conditions)``, the layer's own checks and the conditions the variant branched on that read
    more than the graph (the argument ``graph_name``; a guard: than the graph and the module).
    The others ran for this graph and hold for every call on it."""
    module_globals = type(module).forward.__globals__
    guards = [check_code(text, "exec") for text, reads in lir.guards
              if not _guard_on_graph(reads, names, module_globals, graph_name)]
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
