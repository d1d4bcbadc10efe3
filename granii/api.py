"""``granii(model, graph, feats)``, ``restore(model)`` and ``explain(model)``.

``granii`` finds the GNN layers of ``model`` (modules whose ``forward`` takes a graph first and that
hold no such layer themselves), replaces each one's ``forward`` on the instance by a dispatcher, and
runs the model once on ``(graph, feats)`` without gradients so every layer decides for this input.
The dispatcher, per call:

 1. lowers the layer's forward for this call signature (which optional arguments are given, graph
    or block) through frontend -> rewrite -> enumerate -> prune -> lower, once per signature;
 2. runs the layer's own checks (guards) and checks the feature width;
 3. looks up the decision for (graph, sizes, signature, training): a dictionary lookup after the
    first call; on a miss, ranks the promoted plans with the cost model and compiles the winner;
 4. runs the chosen plan on the module's own parameters.

Anything the frontend cannot lower runs the original forward, and ``explain`` says why.
"""
import inspect
import io
import math
import sys
import types
import weakref
from dataclasses import dataclass, field

import torch

from . import costmodel as cm
from . import ir
from .enumerate import TooManyTrees, layer_forest
from .frontend import FrontendError, RaisesForConfig, lower_layer
from .graph import graph_info
from .plan import COMPUTED, compile_plan, fuse_gemm_add, lower, plan_code, tree_calls
from .prune import prune
from .select import EXPECTED_CALLS, rank

_GRAPH_ARG_NAMES = {"graph", "g", "block", "G", "subgraph"}


@dataclass
class Compiled:
    """The offline stage of one layer for one call signature."""
    layer_ir: object
    n_trees: int
    plans: list
    leaves: dict = field(default_factory=dict)       # variable -> Leaf, over every plan


@dataclass
class LayerState:
    name: str
    module: object
    original: object
    signature: inspect.Signature
    compiled: dict = field(default_factory=dict)     # signature key -> Compiled or FrontendError
    last: object = None                              # (symbols, ranking, chosen, code) of last decision
    fallback: str = None
    calls: int = 0
    last_input: tuple = None                         # (weakref, version) of the last features
    sampled: dict = field(default_factory=dict)      # sampler-configuration key -> decision
    reused: int = 0                                  # block calls that reused such a decision


@dataclass
class Options:
    cost_model: object
    expected_calls: int = EXPECTED_CALLS
    per_batch: bool = False


# -- finding layers --------------------------------------------------------------------------------
def _takes_graph(module):
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 and params[0] in _GRAPH_ARG_NAMES


def find_layers(model):
    """``[(name, module)]``: the innermost modules whose forward takes a graph first."""
    cands = [(n, m) for n, m in model.named_modules() if _takes_graph(m)]
    names = [n for n, _ in cands]
    return [(n, m) for n, m in cands
            if not any(o != n and (n == "" or o.startswith(n + ".")) for o in names)]


# -- public API ------------------------------------------------------------------------------------
def granii(model, graph, feats, cost_model=None, expected_calls=EXPECTED_CALLS, inspect_now=True,
           per_batch=False):
    """Optimize every GNN layer of ``model`` in place and return ``model``.

    ``cost_model``: an object with ``predict(prim, impl, gi, dims)``; by default the learned models
    for this machine, or the analytical model when there are none. ``expected_calls``: how many
    calls once-per-graph work is amortised over when choosing (a sampled block is used once, so
    on blocks it is 1). With ``inspect_now`` the model runs once on ``(graph, feats)`` without
    gradients so each layer decides for this input now.

    Sampled blocks (``dgl.dataloading``): a layer decides on the first block of a sampler
    configuration and reuses that decision for later blocks of the same configuration, skipping
    featurization and ranking (the paper found the choice stable across samples;
    ``scripts/sampling_stability.py`` measures it here). Blocks of one configuration are those
    with the same call signature and sizes and, in powers of two, the same edges per destination
    and sources per destination. ``per_batch=True`` decides again on every block.
    """
    if cost_model is None:
        from .learned import default_cost_model
        cost_model = default_cost_model()
    opts = Options(cost_model, expected_calls, per_batch)
    layers = find_layers(model)
    if not layers:
        raise TypeError(f"granii: {type(model).__name__} holds no GNN layer (a module whose "
                        "forward takes a graph as its first argument)")
    for name, layer in layers:
        if "forward" in layer.__dict__:
            continue      # already optimized
        state = LayerState(name or type(layer).__name__, layer, layer.forward,
                           inspect.signature(layer.forward))
        layer._granii_state = state
        layer.forward = types.MethodType(_make_dispatch(state, opts), layer)
    if inspect_now:
        with torch.no_grad():
            model(graph, feats)
    return model


def restore(model):
    """Undo ``granii(model, ...)``: every layer runs its original forward again."""
    for _, m in model.named_modules():
        if "_granii_state" in m.__dict__:
            del m.__dict__["forward"]
            del m.__dict__["_granii_state"]
    return model


def layer_states(model):
    return [m._granii_state for _, m in model.named_modules() if "_granii_state" in m.__dict__]


# -- dispatch --------------------------------------------------------------------------------------
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


def prepare(state, module, args, kwargs):
    """Bind a call of ``module``; a string (the reason) when the original forward must run."""
    bound = state.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    names = list(values)
    graph, feat = values[names[0]], values[names[1]]
    reason = _unsupported_input(feat)
    if reason:
        return reason
    present = frozenset(n for n in names[2:] if isinstance(values[n], torch.Tensor))
    config = tuple((n, repr(values[n])) for n in names[2:]
                   if values[n] is not None and n not in present)
    key = (present, bool(graph.is_block), config)
    gi = graph_info(graph)
    compiled = _variant(state, module, key, values, gi)
    if isinstance(compiled, Exception):
        return str(compiled)
    _run_guards(state, compiled.layer_ir, gi, values, module)
    leaf_vals, symbols = _bind(state, compiled, gi, values, module)
    training = torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())
    input_grad = torch.is_grad_enabled() and feat.requires_grad
    last = state.last_input
    repeats = last is not None and last[0]() is feat and last[1] == feat._version
    state.last_input = (weakref.ref(feat), feat._version)
    return Call(compiled, gi, leaf_vals, symbols, id(compiled), training, input_grad, module,
                repeats)


def _variant(state, module, key, values, gi):
    """The compiled variant of this call signature whose assumptions hold for this call: the
    module attributes it branched on and the graph-dependent branches it took."""
    variants = state.compiled.setdefault(key, [])
    for v in variants:
        if _holds(v, module, values, gi):
            return v
    v = _compile(module, key[0], key[1], dict(values, self=module))
    variants.append(v)
    return v


def _holds(variant, module, values, gi):
    from .frontend.rules import config_summary
    spec, config = ((variant.layer_ir.spec, variant.layer_ir.config)
                    if isinstance(variant, Compiled) else (variant.spec, variant.config))
    if any(config_summary(getattr(module, a, None)) != v for a, v in config.items()):
        return False
    graph_name = next(iter(values))
    ns = None
    for text, names, value in spec:
        ckey = ("condition", text)
        graph_only = set(names) <= {graph_name}
        if graph_only and ckey in gi.cache:
            now = gi.cache[ckey]
        else:
            if ns is None:
                ns = dict(type(module).forward.__globals__, **values, self=module)
            now = bool(eval(text, ns))
            if graph_only:
                gi.cache[ckey] = now
        if now != value:
            return False
    return True


def run_plan(call, plan, impls):
    """Run ``plan`` with kernel implementations ``impls`` on a prepared call (compiled each time:
    for tests and benchmarks; the dispatcher caches its compiled choice)."""
    fn, _ = compile_plan(plan, impls)
    return fn(call.gi, call.module, *(call.leaf_vals[v] for v in leaf_vals_order(plan)))


def _make_dispatch(state, opts):
    def forward(self, *args, **kwargs):
        call = prepare(state, self, args, kwargs)
        if isinstance(call, str):
            return _fallback(state, call, args, kwargs)
        mode = (call.training, call.input_grad, call.input_repeats)
        dkey = ("decision", id(state), call.key, tuple(sorted(call.symbols.items()))) + mode
        decision = call.gi.cache.get(dkey)
        skey = None
        if decision is None and call.gi.is_block and not opts.per_batch:
            skey = sampler_key(call) + mode
            decision = state.sampled.get(skey)
            if decision is not None:
                state.reused += 1
                call.gi.cache[dkey] = decision
        if decision is None:
            calls = 1 if call.gi.is_block else opts.expected_calls
            ranking = rank(call.compiled.plans, call.gi, call.symbols, opts.cost_model,
                           call.training, call.input_grad, calls, call.input_repeats)
            best = ranking[0]
            fn, code = compile_plan(best.plan, best.impls)
            decision = call.gi.cache[dkey] = (fn, leaf_vals_order(best.plan))
            if skey is not None:
                state.sampled[skey] = decision
            state.last = (call.symbols, ranking, best, code, call.training, opts.cost_model.name)
        fn, order = decision
        state.calls += 1
        state.fallback = None
        return fn(call.gi, self, *(call.leaf_vals[v] for v in order))
    return forward


_GRAPH_SYMBOLS = ("N", "N_src", "N_dst", "E")


def sampler_key(call):
    """What identifies a sampler configuration on a block: the call signature, the sizes that
    are not graph sizes, and log2 of edges per destination and of sources per destination."""
    s = call.symbols
    n_dst = max(s.get("N_dst", s.get("N", 1)), 1)
    shape = (round(math.log2(max(s["E"], 1) / n_dst)),
             round(math.log2(max(s.get("N_src", n_dst), 1) / n_dst)))
    sizes = tuple(sorted((k, v) for k, v in s.items() if k not in _GRAPH_SYMBOLS))
    return ("sampled", call.key, sizes, shape)


def leaf_vals_order(plan):
    return [v for v, l in plan.leaves.items() if l.source[0] not in COMPUTED]


def _unsupported_input(feat):
    if isinstance(feat, (tuple, list)):
        return "a pair of (source, destination) features is not optimized yet"
    if not isinstance(feat, torch.Tensor):
        return f"features of type {type(feat).__name__}"
    if feat.dim() != 2:
        return f"features with {feat.dim()} dimensions (only N x k features are optimized)"
    if feat.is_cuda or feat.dtype != torch.float32:
        return f"features of dtype {feat.dtype} on {feat.device} (float32 on CPU is optimized)"
    return None


def _fallback(state, reason, args, kwargs):
    state.fallback = reason
    return state.original(*args, **kwargs)


def _compile(module, present, is_block, real=None):
    try:
        lir = lower_layer(module, present, is_block, real)
    except (FrontendError, RaisesForConfig) as e:
        return e
    try:
        forest, n_trees = layer_forest(lir.root)
    except TooManyTrees as e:
        e.spec, e.config = lir.spec, lir.config
        return e
    kept = prune([tree_calls(root, choice) for root, choice in forest])
    promoted = [fuse_gemm_add(lower(i, *forest[t], scenarios, heads=lir.heads))
                for i, (t, scenarios) in enumerate(sorted(kept.items()))]
    leaves = {v: l for plan in promoted for v, l in plan.leaves.items()}
    return Compiled(lir, n_trees, promoted, leaves)


def _run_guards(state, lir, gi, values, module):
    """Run the checks kept from the layer's source; those on the graph alone once per graph."""
    module_globals = type(module).forward.__globals__
    graph_name = next(iter(values))
    for i, (text, names) in enumerate(lir.guards):
        reads = {n for n in names if n in values or n not in module_globals}
        graph_only = reads <= {graph_name, "self"}
        gkey = ("guard", id(state), i)
        if graph_only and gi.cache.get(gkey):
            continue
        ns = dict(module_globals)
        ns.update(values)
        ns["self"] = module
        exec(compile(text, f"<check in {state.name}>", "exec"), ns)
        if graph_only:
            gi.cache[gkey] = True


def _bind(state, compiled, gi, values, module):
    """Leaf values by variable name and the size symbols of this call, checked for consistency."""
    feat = values[list(values)[1]]
    symbols = {"E": gi.num_edges}
    if gi.is_block:
        symbols.update(N_src=gi.num_src, N_dst=gi.num_dst)
    else:
        symbols["N"] = gi.num_src
    out = {}
    for var, leaf in compiled.leaves.items():
        src = leaf.source
        if src[0] == "headdiag":
            symbols[leaf.cols] = _module_value(module, src[1]).shape[-2]
        if src[0] in COMPUTED:
            continue
        if src[0] in ("arg", "edge"):
            val = _arg_value(values, src[1])
            if src[0] == "edge":
                out[var] = val
                continue
        elif src[0] == "arg_dst":
            val = values[src[1]][: gi.num_dst]
        elif src[0] == "param_block":
            _, attr, i, m, transposed = src
            full = _module_value(module, attr)
            full = full.t() if transposed else full
            k = full.shape[0] // m
            val = full[i * k:(i + 1) * k]
        else:
            val = _module_value(module, src[1])
            if leaf.transposed:
                val = val.t()
        out[var] = val
        _check_size(state, leaf, val, symbols, feat)
    return out, symbols


def _arg_value(values, name):
    """A forward() argument, or ``srcdata:h`` / ``dstdata:h`` / ``edata:w`` read from the graph."""
    if ":" not in name:
        return values[name]
    frame, key = name.split(":", 1)
    graph = next(iter(values.values()))
    return getattr(graph, frame)[key]


def _module_value(module, dotted):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _check_size(state, leaf, val, symbols, feat):
    dims = (leaf.rows, leaf.cols) if val.dim() == 2 else (leaf.cols,)
    for sym, n in zip(dims, val.shape[-len(dims):]):
        if sym == "1":
            continue
        if "+" in sym:      # a concatenation's width: its parts are checked on their own leaves
            continue
        have = symbols.setdefault(sym, n)
        if have != n:
            raise ValueError(_size_message(state, leaf, sym, have, n, feat))


def _size_message(state, leaf, sym, have, n, feat):
    layer = f"granii: layer '{state.name}' ({type(state.module).__name__})"
    if sym == "k_in":
        return (f"{layer} expects input features of width {n} (its '{leaf.name}' is "
                f"{tuple(leaf_shape(leaf, state))}), but the features given are "
                f"{tuple(feat.shape)}: pass features with {n} columns or build the layer with "
                f"in_feats={feat.shape[-1]}")
    if sym in ("N", "N_src"):
        return (f"{layer}: the features have {n} rows but the graph has {have} source nodes: "
                "pass one row of features per node")
    return f"{layer}: size '{sym}' is {have} in one operand and {n} in '{leaf.name}'"


def leaf_shape(leaf, state):
    return state.module.get_parameter(leaf.source[1]).shape if leaf.source[0] == "param" else ()


# -- explain ---------------------------------------------------------------------------------------
def explain(model, file=None):
    """Print (and return) for each layer: IR, promoted trees with cost, the choice, its code."""
    out = io.StringIO()
    states = layer_states(model)
    if not states:
        print("granii: this model is not optimized (call granii(model, graph, feats) first)",
              file=out)
    for st in states:
        _explain_layer(st, out)
    text = out.getvalue()
    print(text, file=file or sys.stdout, end="")
    return text


def _fmt_ms(s):
    return f"{s * 1e3:9.3f} ms"


def _explain_layer(st, out):
    p = lambda *a: print(*a, file=out)
    p(f"== layer '{st.name}' ({type(st.module).__name__}) " + "=" * 40)
    for (present, is_block, _), comp in ((k, c) for k, cs in st.compiled.items() for c in cs):
        sig = ", ".join(sorted(present)) or "no optional arguments"
        p(f"call signature: {sig}{' (block)' if is_block else ''}")
        spec = comp.layer_ir.spec if isinstance(comp, Compiled) else getattr(comp, "spec", [])
        for text, _, value in spec:
            p(f"  specialised on: ({text}) is {value}")
        if isinstance(comp, Exception):
            p(f"  NOT OPTIMIZED, the original forward runs: {comp}")
            continue
        p("  IR as parsed:     " + str(comp.layer_ir.raw))
        p("  after rewrite:    " + str(comp.layer_ir.root))
        p("  leaves:")
        for leaf in {l.name: l for l in ir.leaves(comp.layer_ir.root)}.values():
            p(f"    {leaf.name:<12} [{leaf.rows} x {leaf.cols}] {leaf.kind}/{leaf.sub}")
        n_prom = len(comp.plans)
        p(f"  association trees: {comp.n_trees} enumerated, {comp.n_trees - n_prom} pruned "
          f"offline, {n_prom} promoted")
        for plan in comp.plans:
            p(f"    [{plan.index}] scenarios {'/'.join(plan.scenarios):<6} {plan.composition()}")
            p(f"        {plan.trees()}")
        if comp.layer_ir.guards:
            p(f"  checks kept from the source: {len(comp.layer_ir.guards)}")
    if st.fallback:
        p(f"  last call ran the original forward: {st.fallback}")
    if st.sampled:
        p(f"  sampled blocks: {len(st.sampled)} sampler configuration(s) decided on their first "
          f"block; {st.reused} later block call(s) reused that decision")
    if st.last is None:
        if not st.fallback:
            p("  no decision yet (the layer has not run on an input)")
        p("")
        return
    symbols, ranking, best, code, training, model_name = st.last
    sizes = " ".join(f"{k}={v}" for k, v in symbols.items())
    p(f"  last input: {sizes}  mode: {'training' if training else 'inference'}  "
      f"cost model: {model_name}")
    p(f"  {'plan':<6}{'predicted':>13}  composition")
    for c in ranking:
        mark = "  <- chosen" if c is best else ""
        p(f"  [{c.plan.index}]  {_fmt_ms(c.cost)}  {c.plan.composition()}{mark}")
    p("  chosen plan, step by step:")
    for step, impl, t in best.step_costs:
        p(f"    {step.var:<4} {step.prim:<14} {impl:<10} {step.when:<15} {_fmt_ms(t)}  {step.key}")
    p("  generated code:")
    for line in code.splitlines():
        p("    " + line)
    p("")


__all__ = ["granii", "restore", "explain", "find_layers", "plan_code"]
