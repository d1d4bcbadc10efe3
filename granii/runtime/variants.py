"""A layer's variants: its forward lowered per call signature and configuration, the
configuration checks that say when a variant still holds, the enumeration cache, and the
plans of a variant compiled to functions."""
import pickle
import warnings

import torch

from .. import diskcache, ir
from ..enumerate import TooManyTrees, binary_orders, budget_seconds, enumerate_layer, layer_forest
from ..enumerate import clock as enum_clock
from ..frontend import FrontendError, RaisesForConfig, lower_layer
from ..frontend.rules import Same, config_summary
from ..fuse import fused_variants
from ..plan import COMPUTED, compile_plan, fuse_gemm_add, lower, tree_calls
from ..prune import prune
from .state import Compiled


def _guard_on_graph(reads, names, module_globals, graph=None):
    """Whether a check of the layer's source reads nothing but the graph (``graph``, by default
    ``names[0]``, the forward's first parameter) and the module: once it held on a graph it
    holds for every call on it."""
    graph = names[0] if graph is None else graph
    return {n for n in reads if n in names or n not in module_globals} <= {graph, "self"}


def _graph_condition(gi, text, namespace):
    """A branch condition that reads the graph alone, evaluated once per graph (``namespace()``
    gives what it reads when it must be)."""
    ckey = ("condition", text)
    now = gi.cache.get(ckey)
    if now is None:
        now = gi.cache[ckey] = bool(eval(check_code(text, "eval"), namespace()))
    return now


def _config_holds(variant, module):
    try:
        return all(config_summary(attribute(module, a)) == v
                   for a, v in getattr(variant, "config", {}).items())
    except AttributeError:
        return False


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
        done = _stored_enumeration(lir, name)
        if isinstance(done, Exception):
            return done
        if len(_ENUMERATED) >= _ENUMERATED_MAX:
            _ENUMERATED.pop(next(iter(_ENUMERATED)))
        _ENUMERATED[key] = done
    n_trees, plans, n_promoted, n_orders, note = done
    leaves = {v: l for plan in plans for v, l in plan.leaves.items()}
    return Compiled(lir, n_trees, list(plans), leaves, n_promoted, n_orders, note)


# the modules whose code decides what ``_enumerate`` returns for an IR (``ir`` included: its
# classes are the key's); a test checks that it holds every granii module they import
ENUMERATION_MODULES = ("granii.ir", "granii.enumerate", "granii.prune", "granii.plan",
                       "granii.fuse", "granii.frontend.udf", "granii.frontend.ops",
                       "granii.frontend.values", "granii.diskcache")


def _stored_enumeration(lir, name):
    """``_enumerate(lir, name)``, read from the disk cache (``diskcache``) when a process of this
    granii has enumerated an equal IR before, else computed and stored there. The key is the
    IR's ``ir.stable_text`` and the stamp of ``ENUMERATION_MODULES``; an IR without a stable
    text (it holds a lambda), a search stopped by its budget or with a note of a failed fusion
    (a result with a ``note``), and a failure are not stored."""
    stamp = diskcache.stamp(*ENUMERATION_MODULES)
    try:
        key = None if stamp is None else "\n".join(
            [stamp, ir.stable_text((lir.root, lir.heads))]).encode()
    except ir.Unstable:
        key = None
    if key is None:
        return _enumerate(lir, name)
    data = diskcache.load("plans", key)
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception:        # noqa: BLE001 - a damaged file: computed and stored again
            pass
    done = _enumerate(lir, name)
    if not isinstance(done, Exception) and not done[4]:
        try:
            diskcache.store("plans", key, pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:        # noqa: BLE001 - plans that do not pickle are not stored
            pass
    return done


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
    note = ""
    try:
        promoted += [f for plan in promoted for f in fused_variants(plan)]
    except Exception as e:       # noqa: BLE001 - the unfused plans still hold
        warnings.warn(f"granii: fusing the plans of {name} failed ({e})")
        note = f"fusing the plans failed ({e}): the unfused plans compete"
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


def leaf_vals_order(plan):
    return [v for v, l in plan.leaves.items() if l.source[0] not in COMPUTED]


def check_code(text, mode):
    """``compile(text)`` of a check kept from a layer's source, once per text."""
    return diskcache.compiled(text, "<check from the layer's source>", mode)
