"""``HeteroGraphConv`` containers, and the dispatcher each relational layer gets.

Where every relation into a destination type is a GraphConv, a mean SAGEConv or a GATConv and
the relations are summed or averaged, ``hetero_flat`` runs them as one typed product per
destination type (its docstring). Otherwise each relation ``g[s, e, d]`` is a homogeneous graph;
its module (GraphConv, SAGEConv, GATConv) is optimized by the homogeneous dispatcher, which takes
one feature tensor on a graph or a block.
DGL calls the module with a pair ``(x_s, x_d)``. ``HeteroDispatcher`` makes the equivalent single
tensor call: the relation graph itself when ``s == d`` (non-block: ``x_s is x_d``; block:
``x_d = x_s[:N_dst]``, the block convention), and otherwise a block whose sources are the
destination nodes followed by the source nodes, on ``cat(x_d, x_s)`` (GraphConv reads no
destination features: there the block's sources are the source nodes alone). Relation graphs
of a full graph are built once per graph. Where the two calls are not the same function (a
module with separate source/destination weights, features of different widths, dropout drawn
in training, any other module) the relation runs DGL's pair call, and ``explain`` says why.

``dispatcher_class`` picks a wrapped layer's dispatcher (``hetero.RelDispatcher`` for
RelGraphConv, ``hetero_hgt.HGTDispatcher`` for HGTConv), ``wrap_containers`` sets a
``HeteroDispatcher`` on every HeteroGraphConv of a model. This module imports the relational
ones (``hetero``, ``hetero_flat``, ``hetero_hgt``), none of which imports it, when a model
has such a layer: ``granii(...)`` of a model without one imports none of them.
"""
import copy
import time
import weakref

import torch

from .runtime.dispatch import Dispatcher, dispatcher_of
from .runtime.state import AUTOCAST, ORIGINAL, autocast_on, original_forward
from .runtime.tiebreak import BackwardClock, Trial
from .kernels import pool


# -- HeteroGraphConv -------------------------------------------------------------------------------------
def _module_kind(mod):
    """``(kind, reason)``: how a relation's module is called with one tensor; kind ``"src"``
    (reads no destination features), ``"cat"`` (destination rows first), or ``None``."""
    from dgl.nn.pytorch import GATConv, GraphConv, SAGEConv
    if dispatcher_of(mod) is None:
        return None, "the relation's module is not optimized by granii"
    if type(mod) is GraphConv:
        return "src", None
    if type(mod) is SAGEConv:
        if mod._in_src_feats != mod._in_dst_feats:
            return None, "SAGEConv with different source and destination input sizes"
        return "cat", None
    if type(mod) is GATConv:
        if hasattr(mod, "fc_src"):
            return None, "GATConv built with (source, destination) input sizes: separate weights"
        return "cat", None
    return None, f"{type(mod).__name__} is not known to give the same result on one tensor"


def _drops_in_training(mod):
    return mod.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0
                                for m in mod.modules())


def _cat_block(rel, with_dst):
    """A block on the edges of ``rel`` (edge ids kept) whose sources are the destination nodes
    followed by the source nodes (``with_dst``), or the source nodes alone."""
    import dgl
    u, v = rel.edges(order="eid")
    nd, ns = rel.num_dst_nodes(), rel.num_src_nodes()
    off = nd if with_dst else 0
    return dgl.create_block((u + off, v), num_src_nodes=ns + off, num_dst_nodes=nd,
                            idtype=rel.idtype)


class HeteroState:
    def __init__(self, name, module):
        self.name, self.module = name, module
        self.fallback = None
        self.routes = {}            # canonical etype -> how it was called last
        self.chosen = {}
        self.calls = 0
        self.graphs = weakref.WeakKeyDictionary()    # heterograph -> (index, {etype: graph})
        self.routed_calls = 0       # calls routed relation by relation, before the tie-break
        self.trial = None           # the container's measured tie-break while it runs
        self.kept = None            # ROUTED, FLAT or ORIGINAL once it is settled
        self.tuned = None           # [(label, median seconds)] of that tie-break
        self.flat_reason = None     # why the relations last ran one by one (hetero_flat)
        self.flat_info = {}         # destination type -> its typed product's decision
        self.flat_calls = 0         # calls that ran as typed products

    def explain(self, p):
        p(f"== layer '{self.name}' ({type(self.module).__name__}) " + "=" * 40)
        if self.fallback:
            p(f"  last call ran the original forward: {self.fallback}")
        from . import hetero_flat
        hetero_flat.explain(self, p)
        for cet, how in self.routes.items():
            p(f"  relation {cet}: {how}")
        if not self.routes and not self.fallback:
            p("  no call yet")
        if self.tuned:
            times = ", ".join(f"{lb} {t * 1e3:.3f} ms" for lb, t in self.tuned)
            p(f"  measured on the first calls (median forward, + backward in training): {times};"
              f" kept {self.kept}")
        p("  (each relation's module is explained as its own layer)")
        p("")


class HeteroDispatcher(Dispatcher):
    """``forward`` of an optimized ``HeteroGraphConv`` (see the module docstring)."""

    def __init__(self, layer, name, options):
        self.layer, self.options = layer, options
        self.state = HeteroState(name, layer)

    def __call__(self, g, inputs, mod_args=None, mod_kwargs=None):
        if self.state is None:
            self.state = HeteroState(getattr(self, "_name", type(self.layer).__name__), self.layer)
        if autocast_on():
            self.state.fallback = AUTOCAST
            return original_forward(self.layer, (g, inputs, mod_args, mod_kwargs), {})
        feats = tuple(inputs.values()) if isinstance(inputs, dict) else (inputs,)
        return pool.run(feats, hetero_call, self.state, self.options, self.layer, g, inputs,
                        mod_args, mod_kwargs)

    def __deepcopy__(self, memo):
        return HeteroDispatcher(copy.deepcopy(self.layer, memo), self.state.name, self.options)


def _hetero_original(layer, *args):
    return type(layer).forward(layer, *args)


def _rel_graphs(state, g):
    """Relation graphs of a heterograph or block, built once per graph: ``{etype: graph}``."""
    hit = state.graphs.get(g)
    if hit is None or hit[0] is not g._graph:
        hit = (g._graph, {})
        state.graphs[g] = hit
    return hit[1]


ROUTED = "relations routed"
FLAT = "typed products"    # hetero_flat: the relations into each destination type at once
ROUTED_WARMUP = 12     # routed calls before the container's tie-break: each relation's own
                       # tie-break (at most 3 candidates x 4 calls) has settled by then


def hetero_call(state, options, layer, g, inputs, mod_args, mod_kwargs):
    """One call of an optimized HeteroGraphConv. Each relation's module decides on its own; over
    them, a measured tie-break (``dispatch.Trial``) times the routed call against DGL's own
    forward (every relation's module run as DGL wrote it), forward and, in training, backward, on
    the calls after ``ROUTED_WARMUP``; the routed call is kept only when it was faster by the
    trial's margin. So many small relations, where a dispatcher per relation costs more than
    its plans save, run as DGL runs them."""
    args = (state, layer, g, inputs, mod_args, mod_kwargs)
    if state.kept == ORIGINAL:
        return hetero_dispatch(*args, dgl_only=True)
    tune = (options.tune and options.expected_calls > 1
            and not torch.are_deterministic_algorithms_enabled())
    # typed products decide on their first call: the tie-break can start on the next one
    warmup = 1 if state.flat_calls else ROUTED_WARMUP
    if state.kept in (ROUTED, FLAT) or not tune or state.routed_calls < warmup:
        state.routed_calls += 1
        return hetero_dispatch(*args, tune=tune)
    routed = FLAT if state.flat_calls else ROUTED
    trial = state.trial = state.trial or Trial([(routed, None, None), (ORIGINAL, None, None)])
    trial.collect()
    trial.drop_slow()
    label = trial.next()[0]
    # on sampled blocks each call has a block of its own: times per unit of its size
    scale = float(max(g.num_edges() + g.num_src_nodes() + g.num_dst_nodes(), 1)
                  if g.is_block else 1)
    t0 = time.perf_counter()
    out = hetero_dispatch(*args, dgl_only=label == ORIGINAL, tune=tune)
    seconds = (time.perf_counter() - t0) / scale
    clock = _DictClock.of(out, layer, inputs, scale)
    if clock is None:
        trial.record(label, seconds)
    else:
        trial.await_backward(label, seconds, clock)
    if trial.done():
        trial.close()
        state.kept = trial.winner()[0]
        state.tuned = [(lb, t * scale) for lb, t in trial.report()]
        state.trial = None
    return out


class _DictClock(BackwardClock):
    """``BackwardClock`` over every output of a dict: the backward starts at the first output
    gradient and ends at the last gradient of the parameters and inputs."""

    @classmethod
    def of(cls, out, layer, inputs, scale=1.0):
        if not torch.is_grad_enabled():
            return None
        outs = [o for o in out.values() if isinstance(o, torch.Tensor) and o.requires_grad]
        feats = inputs if isinstance(inputs, tuple) else (inputs,)
        tensors = [p for p in layer.parameters() if p.requires_grad]
        tensors += [t for d in feats if isinstance(d, dict) for t in d.values()
                    if isinstance(t, torch.Tensor) and t.requires_grad]
        return cls(outs, tensors, scale) if outs and tensors else None


def hetero_dispatch(state, layer, g, inputs, mod_args, mod_kwargs, dgl_only=False, tune=False):
    """The routed call: one typed product per destination type (``hetero_flat``) where the
    relations allow it, else relation by relation (``dgl_only``: DGL's forward, each module's
    own ``forward`` on the relation graph and the (source, destination) pair)."""
    from dgl.nn.pytorch import HeteroGraphConv
    if type(layer).forward is not HeteroGraphConv.forward:
        state.fallback = "a subclass of HeteroGraphConv with its own forward"
        return _hetero_original(layer, g, inputs, mod_args, mod_kwargs)
    state.fallback = None
    state.calls += 1
    mod_args = mod_args or {}
    mod_kwargs = mod_kwargs or {}
    outputs = {nty: [] for nty in g.dsttypes}
    pair = isinstance(inputs, tuple)
    if pair or g.is_block:
        src_inputs, dst_inputs = inputs if pair else (
            inputs, {k: v[: g.number_of_dst_nodes(k)] for k, v in inputs.items()})
    else:
        src_inputs = dst_inputs = inputs
        if any(s in inputs and d not in inputs for s, _, d in g.canonical_etypes):
            state.fallback = "no features for a destination type (DGL's forward raises)"
            return _hetero_original(layer, g, inputs, mod_args, mod_kwargs)
    # relation graphs live as long as g (a backward reads their per-graph structures), and are
    # built once per graph
    cache = _rel_graphs(state, g)
    if not dgl_only:
        from . import hetero_flat
        out = hetero_flat.flat_call(state, layer, g, src_inputs, dst_inputs, mod_args,
                                    mod_kwargs, cache, tune)
        if out is not None:
            return out
    for cet in g.canonical_etypes:
        stype, etype, dtype = cet
        if stype not in src_inputs or (g.is_block or pair) and dtype not in dst_inputs:
            continue
        mod = layer._get_module(cet)
        xs, xd = src_inputs[stype], dst_inputs[dtype]
        margs, mkw = mod_args.get(etype, ()), mod_kwargs.get(etype, {})
        if dgl_only:
            outputs[dtype].append(type(mod).forward(mod, g[cet], (xs, xd), *margs, **mkw))
            continue
        kind, why = _module_kind(mod)
        if kind is not None and _drops_in_training(mod):
            kind, why = None, "dropout in training draws separate masks for the pair"
        if kind is not None and (xs.dim() != xd.dim() or xs.shape[1:] != xd.shape[1:]
                                 or xs.dtype != xd.dtype):
            kind, why = None, "source and destination features of different shapes"
        if kind is None:
            state.routes[cet] = f"DGL's (source, destination) call: {why}"
            outputs[dtype].append(mod(g[cet], (xs, xd), *margs, **mkw))
            continue
        same = stype == dtype and not pair and (g.is_block or xs is xd)
        if same:
            rel = cache.get((cet, "same"))
            if rel is None:
                rel = cache[(cet, "same")] = g[cet]
            state.routes[cet] = "one tensor on the relation graph" + (
                " (block)" if g.is_block else "")
            outputs[dtype].append(mod(rel, xs, *margs, **mkw))
            continue
        with_dst = kind == "cat"
        rel = cache.get((cet, with_dst))
        if rel is None:
            rel = cache[(cet, with_dst)] = _cat_block(g[cet], with_dst)
        x = torch.cat([xd, xs]) if with_dst else xs
        state.routes[cet] = ("one tensor cat(x_dst, x_src) on a block" if with_dst
                             else "source features on a block (destination features unread)")
        outputs[dtype].append(mod(rel, x, *margs, **mkw))
    return {nty: layer.agg_fn(alist, nty) for nty, alist in outputs.items() if alist}


# -- wrapping ------------------------------------------------------------------------------------------
def dispatcher_class(layer):
    """The dispatcher for a GNN layer ``granii`` wraps: ``RelDispatcher`` for RelGraphConv,
    ``hetero_hgt.HGTDispatcher`` for HGTConv, else the homogeneous one."""
    from dgl.nn.pytorch import HGTConv, RelGraphConv
    if isinstance(layer, RelGraphConv):
        from .hetero import RelDispatcher
        return RelDispatcher
    if isinstance(layer, HGTConv):
        from .hetero_hgt import HGTDispatcher
        return HGTDispatcher
    return Dispatcher


def wrap_containers(model, options):
    """Set a ``HeteroDispatcher`` on every HeteroGraphConv of ``model`` (options updated on those
    already wrapped); returns the modules newly wrapped."""
    from dgl.nn.pytorch import HeteroGraphConv
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, HeteroGraphConv):
            continue
        d = dispatcher_of(m)
        if d is not None:
            d.options = options
            d.state = HeteroState(name or type(m).__name__, m)
            continue
        m.forward = HeteroDispatcher(m, name or type(m).__name__, options)
        out.append(m)
    return out
