"""Decisions reused across graphs: a sampler configuration's decision for its blocks, and a class
of whole graphs' decision (sizes and degree statistics within ``SHAPE_SLACK``) for its new
graphs, with the class path that runs such a graph's call without binding it."""
import math
import weakref

import torch

from .. import ir
from ..featurize import class_shape
from ..graph import graph_info
from ..kernels import native
from .bind import _CheckedGraph, _repeats, graph_index, input_identity
from .fastpath import (FastEntry, _FAST_AFTER, _GRAD, _SEEN, _TRAINING, _arg_reader,
                       _fast_run_of, _places, held_info)
from .state import _any_requires_grad
from .tiebreak import Trial, _graph_work
from .variants import _graph_condition, _guard_on_graph, check_code


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
    settled decision has a class run, else ``None``. The class found for the last graph, per
    guard, is kept (``state.class_last``): the layer's later calls on it (a readout after every
    layer of a model) skip placing it again."""
    g = args[0]
    if getattr(g, "is_block", True) or not hasattr(g, "_graph"):
        return None
    last = state.class_last
    gi = held_info(last, g)
    if gi is None:
        gi = graph_info(g)
        last = state.class_last = (weakref.ref(g), weakref.ref(gi), {})
    # a graph called again and again gets a fast path of its own (``_remember``): the calls it
    # takes here count as there, and the call that reaches the count takes the normal path
    table = state.fast.get(gi)
    seen = 0 if table is None else table.get(_SEEN, _FAST_AFTER)
    if seen >= _FAST_AFTER - 1:
        return None
    found = last[2].get(guard)
    if found is None:
        found = _class_of(state, guard, gi)
        if found is None:
            return None
    record, entry = found
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
        if guard not in last[2]:
            if not _graph_checks(state, entry.compiled, layer, g, gi):
                return None
            last[2][guard] = found
        vals = run.bind(layer, gi, args, kwargs)
    except Exception:            # noqa: BLE001 - a failing check: the normal path raises it
        return None
    if vals is None:
        return None
    if table is None:
        table = state.fast[gi] = {}
    table[_SEEN] = seen + 1
    state.last_input = None if ident is None else (weakref.ref(feat), ident)
    return gi, run, vals, record


def _class_of(state, guard, gi):
    """``(record, entry)``: the first class run kept under the call guard (sizes taken out)
    whose class's shape lies within ``SHAPE_SLACK`` of this graph's, else ``None``."""
    entries = state.class_fast.get(_size_free(guard, gi))
    shape = None
    for record, entry, structural in entries or ():
        if shape is None or shape[0] != structural:
            shape = (structural, graph_shape(gi, structural, guard[_GRAD] and guard[_TRAINING]))
        if all(abs(a - b) <= SHAPE_SLACK for a, b in zip(record["shape"], shape[1])):
            return record, entry
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
    return ("graph", call.key, sizes) + ((call.gi.device.type,) if call.gi.gpu else ())


def graph_shape(gi, structural=True, training=False):
    """``featurize.class_shape`` of a whole graph, once per graph. With the native kernels the
    degrees come from the pass that builds their index (``native.csr_index``), which their
    plans read next; in ``training`` (a backward will follow) that pass makes the index of
    ``A^T`` too, which the backward reads. A layer that reads no edge of the graph (a readout)
    is placed by its sizes alone (``structural`` false): counting degrees would cost it more
    than its call."""
    if not structural:
        return class_shape(gi.num_src, gi.num_edges, None, None, (0.0, 0.0, 0.0))

    def make():
        if training and native.available() and not gi.gpu:
            native.csr_index(gi, "at")
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
    shape = graph_shape(call.gi, reads_edges(call.compiled.layer_ir.root),
                        call.training and call.module is not None and call.module.training)
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
