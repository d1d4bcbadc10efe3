"""The forward of an optimized layer: ``Dispatcher`` replaces a layer instance's ``forward``; per
call ``dispatch`` tries the fast path of a repeated call (``fastpath``), then the class path of a
new graph of a settled class (``reuse``), then the normal path: bind the call (``bind``), find or
make the decision (``decide``; a measured ``tiebreak`` among close candidates), and run it."""
import contextlib
import copy
import dataclasses
import functools
import time
import warnings

import torch
import torch.utils.checkpoint

from ..device import (free_cached_memory, is_out_of_memory, rng_state, set_rng_state,
                      synchronize)
from .. import ir
from ..kernels import native, pool, readout
from ..plan import REUSE
from .bind import _UserError, _call_shape, prepare, recompute_key
from .decide import _describe, decide, decision_key
from .fastpath import _fast_hit, _remember, call_guard
from .reuse import (_VERIFIED_KEPT, _class_decision, _class_hit, _new_class, _remember_class,
                    _sampler_decision)
from .state import (AUTOCAST, ORIGINAL, PYG_FAST_KEY, RAN_ORIGINAL, Ran, _INSPECTING, _fell_back,
                    _ran_plan, autocast_on, is_pyg_layer, new_state, original_forward)
from .tiebreak import BackwardClock, Trial, _trial_scale
from .variants import _config_holds


class Dispatcher:
    """``layer.forward`` of an optimized layer (set on the instance, so ``type(layer).forward``
    stays the original). Copying or pickling the layer gives a dispatcher of the copy with the
    same options and no decisions: it decides again on its first call."""

    def __init__(self, layer, name, options):
        _load_frontend(layer)
        self.layer = layer
        self.options = options
        self.state = new_state(layer, name)

    def __call__(self, *args, **kwargs):
        if _is_compiling():
            return _outside_the_compiler(_call)(self, args, kwargs)
        return _call(self, args, kwargs)

    def __deepcopy__(self, memo):
        return Dispatcher(copy.deepcopy(self.layer, memo), self.state.name, self.options)

    def __getstate__(self):
        options = self.options
        from ..learned import default_cost_model
        if options.cost_model is not None and options.cost_model is default_cost_model():
            options = dataclasses.replace(options, cost_model=None)
        return {"layer": self.layer, "name": self.state.name, "options": options}

    def __setstate__(self, st):
        self.layer, self.options = st["layer"], st["options"]
        self.state = None                    # the layer is not restored yet: see ``dispatch``
        self._name = st["name"]

    def __repr__(self):
        return f"<granii dispatcher of {self.state.name if self.state else self._name}>"


def _call(dispatcher, args, kwargs):
    return pool.run(args, dispatch, dispatcher.state, dispatcher.options, dispatcher.layer, args,
                    kwargs)


# torch.compile of a model holding optimized layers: the compiler leaves the layers' calls out
# of its graphs and runs them as they run without it (granii's checks, caches and kernels are
# not code it can trace); what lies between them is compiled
_is_compiling = getattr(torch.compiler, "is_compiling", None) or torch._utils.is_compiling


@functools.lru_cache(maxsize=None)
def _outside_the_compiler(fn):
    return torch.compiler.disable(fn)


def _load_frontend(layer):
    """Import PyTorch Geometric's frontend (it registers its binder, ``CALL_BINDERS``) when a
    dispatcher is made for its first layer: a process without PyG layers never loads it."""
    if is_pyg_layer(layer):
        from .. import pyg  # noqa: F401


def dispatch(state, options, layer, args, kwargs):
    if state is None:            # unpickled: the state is made on the first call
        _load_frontend(layer)
        disp = layer.__dict__["forward"]
        state = disp.state = new_state(layer, disp._name)
    if autocast_on():
        _fell_back(state, AUTOCAST)
        return original_forward(layer, args, kwargs)
    # a PyG layer takes its graph second, and its fast tables are keyed by the graph input's
    # index graph (``PYG_FAST_KEY``); it has no class path
    pyg = is_pyg_layer(layer)
    guard = call_guard(layer, args, kwargs, 1 if pyg else 0)
    if guard is not None and torch._C._current_graph_task_id() < 0:
        hit = _fast_hit(state, options, layer, guard, args, kwargs,
                        PYG_FAST_KEY[0] if pyg else None)
        if hit is not None:
            return _fast_run(state, options, layer, hit, args, kwargs)
        if not pyg and state.class_fast and not options.per_batch:
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
        if ckey is not None and record is not None and call.fast_key is None:
            _remember_class(state, layer, guard, call, record, (label, fn, order), args,
                            kwargs)
    return out


# raised through a plan by torch's own machinery, not by the plan: the non-reentrant activation
# checkpoint ends its recomputation with one once it has the tensors the backward needs
_NOT_THE_PLANS = tuple(c for c in (getattr(torch.utils.checkpoint, "_StopRecomputationError",
                                           None),) if c is not None)


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
    rng = rng_state(call.gi.gpu)
    try:
        out = fn(call.gi, layer, *(call.leaf_vals[v] for v in order))
    except _NOT_THE_PLANS:
        raise
    except Exception as e:       # noqa: BLE001 - a plan that raises is never used again
        set_rng_state(rng)
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


def _class_run(state, options, layer, hit, guard, args, kwargs):
    gi, run, vals, record = hit
    state.class_reused += 1
    if run.fn is None:
        return _fast_run(state, options, layer, (gi, run, vals), args, kwargs)
    rng = rng_state(gi.gpu) if getattr(run.fn, "draws", True) else None
    try:
        return _fast_run(state, options, layer, (gi, run, vals), args, kwargs)
    except _NOT_THE_PLANS:
        raise
    except Exception:            # noqa: BLE001 - the normal path runs it and decides
        if rng is not None:
            set_rng_state(rng)
        state.calls -= 1
        state.class_reused -= 1
        return _dispatch(state, options, layer, args, kwargs, guard)


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


def _trial_call(state, per_graph, dkey, trial, call, layer, args, kwargs):
    trial.collect()
    trial.drop_slow()
    label, fn, order = trial.next()[:3]
    scale = _trial_scale(trial, call)
    call, args, kwargs = _own_gradients(call, args, kwargs)
    _shared_graph_work(call, layer)
    gpu = call.gi.gpu
    rng = rng_state(gpu) if fn is None else None
    synchronize(gpu)
    t0 = time.perf_counter()
    try:
        out = _run(state, dkey, label, fn, order, call, layer, args, kwargs)
    except Exception as e:       # noqa: BLE001 - only the original forward's turn, out of memory
        if fn is not None or not is_out_of_memory(e) or len(trial.candidates) < 2:
            raise
        set_rng_state(rng)
        return _without_original(state, per_graph, dkey, trial, call, layer, args, kwargs, e)
    synchronize(gpu)
    seconds = (time.perf_counter() - t0) / scale
    if state.ran.kind != "fallback" and not _INSPECTING[0]:
        state.ran = Ran(state.ran.kind, label, "a turn of the measured tie-break")
    clock = BackwardClock.of(out, layer, args, scale, gpu)
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


def _without_original(state, per_graph, dkey, trial, call, layer, args, kwargs, error):
    """The original forward ran out of memory in its turn (PyG's GAT on a large graph holds
    heads x features per edge, where granii's plans do not): the trial goes on without it, and
    this call runs the next candidate, with the random numbers the original drew given back."""
    trial.candidates = [c for c in trial.candidates if c[0] != ORIGINAL]
    trial.times.pop(ORIGINAL, None)
    free_cached_memory()
    warnings.warn(f"granii: layer '{state.name}': its own forward ran out of memory in a turn of "
                  f"the measured tie-break ({type(error).__name__}); its plans go on without it",
                  RuntimeWarning)
    return _trial_call(state, per_graph, dkey, trial, call, layer, args, kwargs)


def _own_gradients(call, args, kwargs):
    """``(call, args, kwargs)`` with each argument tensor that needs a gradient replaced by a
    view of itself, for a measured turn in training. A hook on the tensor itself fires once its
    gradient is complete, summed over every use of it in the model: where the layer's input
    feeds other layers too (a readout after each layer), the backward clock then ran on through
    theirs. The view's gradient is this call's contribution alone."""
    if not torch.is_grad_enabled():
        return call, args, kwargs
    views = {}
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad and id(a) not in views:
            views[id(a)] = a.view_as(a)
    if not views:
        return call, args, kwargs

    def swap(v):
        return views.get(id(v), v) if isinstance(v, torch.Tensor) else v
    call = dataclasses.replace(call, leaf_vals={k: swap(v) for k, v in call.leaf_vals.items()})
    return call, tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


def _shared_graph_work(call, layer):
    """Before a measured turn, the structures of a whole graph that every layer's calls on it
    read, whichever call builds them first paying for them: the native index of ``A^T``, which
    every backward on the graph reads, in training; a batch's segments (``readout.segments``),
    which every readout on it reads. On a new graph each step (graph classification) the first
    layer in the backward, or the first readout after the model's input, paid for them, so a
    turn's time depended on what the other layers had run before it: the readout of the input
    features measured DGL's readout faster than granii's, which then paid the segments in the
    next readout instead."""
    gi = call.gi
    if gi.is_block or gi.gpu:
        return
    if layer.training and torch.is_grad_enabled() and native.available():
        native.csr_index(gi, "at")
    if _reads_batch(call.compiled.layer_ir.root):
        readout.segments(gi)


def _reads_batch(root):
    """Whether the layer IR ``root`` holds a readout (one row per graph of a batch)."""
    if isinstance(root, ir.Aggregate) and root.out_rows is not None:
        return True
    return any(_reads_batch(c) for c in ir.children(root))


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
