"""``granii(model, graph, feats)``, ``restore(model)``: wrapping a model's GNN layers.

``granii`` finds the GNN layers of ``model`` by running it once on ``(graph, feats)``: a layer is a
submodule called with a graph among its arguments (a ``DGLGraph``, a sampled block, a list of
blocks or a ``dgl.sparse`` matrix), or holding one it reads (``self.g``), none of whose own
submodules was (``find_layers``), whatever its forward calls its parameters (``g``, ``bg``, ``mfg``,
``blocks``, ``A``). It sets a ``dispatch.Dispatcher`` as the ``forward`` of each. With
``inspect_now`` it then runs the model again as its next calls will run (a training step's forward
in training mode, without gradients otherwise), so every layer compiles and decides for this
input now. Both runs leave the model as they found it (parameters, buffers, attributes, training
flags and the random number generator). A layer granii cannot lower (a ``dgl.sparse`` product, a
graph held rather than passed) runs its own forward, and ``explain`` says why.
"""
import functools
import inspect
import json
import os
import sys

import torch

from .runtime.bind import prepare
from .runtime.dispatch import Dispatcher, dispatcher_of, inspecting, layer_states
from .runtime.state import Options, Ran, _any_requires_grad, is_pyg_layer
from .runtime.variants import leaf_vals_order
from .explain import explain
from .kernels import dropout, pool
from .plan import plan_code
from .select import EXPECTED_CALLS

DECISIONS_FORMAT = 1
# what a graph argument is usually called: only for a hint on a features-first forward, and for
# finding layers without running the model (``inspect_now=False``)
_GRAPH_ARG_NAMES = {"graph", "g", "block", "G", "subgraph", "bg", "hg", "mfg", "blocks", "sg",
                    "batched_graph"}


def _forward_params(module):
    """The parameter names of the forward of ``module``'s class after ``self`` (``[]`` when its
    signature cannot be read)."""
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def _takes_graph(module):
    params = _forward_params(module)
    return len(params) >= 2 and params[0] in _GRAPH_ARG_NAMES


def _innermost(cands):
    """The ``(name, module)`` of ``cands`` none of whose submodules is in ``cands``."""
    names = [n for n, _ in cands]
    return [(n, m) for n, m in cands
            if not any(o != n and (n == "" or o.startswith(n + ".")) for o in names)]


def find_layers(model, graph=None, feats=None, extra_args=(), extra_kwargs=None):
    """``[(name, module)]``: the GNN layers of ``model``.

    Given ``graph`` and ``feats``: the innermost submodules that receive a graph when the model
    runs on them (``graph_receivers``; the model is left as found). Without: the innermost
    modules whose forward's first parameter has a graph's usual name (``_GRAPH_ARG_NAMES``)."""
    if graph is None:
        return _innermost([(n, m) for n, m in model.named_modules() if _takes_graph(m)])
    pyg = _pyg_layers(model, graph, feats, extra_args, extra_kwargs or {})
    if pyg is not None:
        return pyg
    known = _dgl_layers(model)
    if known is not None:
        return known
    return graph_receivers(model, lambda: _call_model(model, graph, feats, extra_args,
                                                      extra_kwargs or {}))


def _pyg_layers(model, graph, feats, extra_args, extra_kwargs):
    """The innermost PyG ``MessagePassing`` modules of ``model``, when the call holds no DGL
    graph and no module holds one: what the run of ``graph_receivers`` would find (it takes PyG
    layers by their class), less a layer the run does not call (wrapped, never run), without
    the run, a whole forward of the model that the first call paid twice. ``None`` otherwise."""
    if _graph_in((graph, feats, *extra_args), extra_kwargs):
        return None
    found, dgl_held = [], False
    for name, m in model.named_modules():
        if is_pyg_layer(m):
            found.append((name, m))
        elif _holds_graph(m):
            dgl_held = True
    return _innermost(found) if found and not dgl_held else None


# DGL's graph layers: their forward takes the graph, and they call their own submodules with
# tensors only (``apply_func``, ``fc``, ``gate_nn``), so the innermost of them receive the graph
_DGL_LAYER_MODULES = ("dgl.nn.pytorch.conv.", "dgl.nn.pytorch.glob")


def _dgl_layers(model):
    """The innermost DGL graph layers of ``model`` (classes of DGL's ``conv`` and ``glob``
    packages) when no other module could be a graph layer, without running the model: what the
    run of ``graph_receivers`` would find, less a layer the run does not call (wrapped, never
    run), without that run, a whole forward of DGL's layers that a first call paid twice.
    ``None`` (the run decides) when some module outside DGL's layers, none of them below it,
    takes two or more arguments, takes a first argument named like a graph, holds a graph or is
    a PyG layer; or when the model holds DGL's relational containers (``HeteroGraphConv``
    calls its submodules with graphs)."""
    mods = list(model.named_modules())
    found = [n for n, m in mods if type(m).__module__.startswith(_DGL_LAYER_MODULES)]
    if not found:
        return None

    def below(name, root):
        return root == "" or name.startswith(root + ".")
    for name, m in mods:
        if type(m).__module__.startswith("dgl.nn.pytorch.hetero"):
            return None
        if name in found or any(below(name, f) for f in found) \
                or any(below(f, name) for f in found if f != name):
            continue             # a DGL layer, inside one, or above one: not innermost
        params = _forward_params(m)
        if (len(params) >= 2 or (params and params[0] in _GRAPH_ARG_NAMES)
                or _holds_graph(m) or is_pyg_layer(m)):
            return None
    return _innermost([(n, m) for n, m in mods if n in found])


def _holds_graph(module):
    """Whether ``module`` keeps a DGL graph in an attribute."""
    return any(is_graph(v) for v in module.__dict__.values())


def is_graph(value):
    """A DGL graph (a block too) or a ``dgl.sparse`` matrix."""
    dgl = sys.modules.get("dgl")        # without DGL loaded, no DGL graph exists
    if dgl is not None and isinstance(value, dgl.DGLGraph):
        return True
    cls = type(value)
    return cls.__name__ == "SparseMatrix" and cls.__module__.startswith("dgl.sparse")


def _graph_in(args, kwargs):
    for v in (*args, *kwargs.values()):
        if is_graph(v) or (isinstance(v, (list, tuple)) and v and all(is_graph(b) for b in v)):
            return True
    return False


def graph_receivers(model, run):
    """``[(name, module)]``: the innermost submodules of ``model`` called with a graph (or a
    list of blocks) among their arguments, or holding a graph in an attribute, while ``run()``
    runs the model. Layers optimized already run their own forward meanwhile; the run leaves
    the model as it found it (``_snapshot``)."""
    got = {}

    def saw(name, module, args, kwargs):
        if name not in got and (_graph_in(args, kwargs) or is_pyg_layer(module)
                                or _holds_graph(module)):
            got[name] = module
    handles, hidden = [], []
    for name, m in model.named_modules():
        if dispatcher_of(m) is not None:
            hidden.append((m, m.__dict__.pop("forward")))
        handles.append(m.register_forward_pre_hook(functools.partial(saw, name),
                                                   with_kwargs=True))
    saved = _snapshot(model)
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
        for m, d in hidden:
            m.__dict__["forward"] = d
        _restore_snapshot(saved)
    return _innermost([(n, m) for n, m in model.named_modules() if n in got])


def granii(model, graph, feats, cost_model=None, expected_calls=EXPECTED_CALLS, inspect_now=True,
           per_batch=False, reuse_inputs=True, tune=True, deterministic=False, decisions=None,
           memory_limit=None, extra_args=(), extra_kwargs=None):
    """Optimize every GNN layer of ``model`` in place and return ``model``.

    The layers are the innermost submodules that receive a graph (a DGL graph or block, a list
    of blocks, a ``dgl.sparse`` matrix, or one they hold in an attribute) when the model runs
    on ``(graph, feats)`` without gradients (``find_layers``); with ``inspect_now=False`` the
    model is not run, and they are the innermost modules whose forward's first parameter is
    named like a graph (``g``, ``graph``, ``block``, ``bg``, ``hg``, ``mfg``, ``blocks``, ...).
    ``granii.api.what_ran(model)`` tells what each layer's last call ran.

    ``cost_model``: an object with ``predict(prim, impl, gi, dims)``, or the path of a folder of
    learned models (``granii.learned.load``); by default the learned models for this machine, or
    the analytical model when there are none. ``expected_calls``: how many
    calls once-per-graph work is amortised over when choosing (a sampled block is used once, so
    on blocks it is 1). With ``inspect_now`` the model runs once on ``(graph, feats)`` (or on
    ``feats`` alone when its forward takes only the features and holds the graph), so each
    layer decides for this input now; the model is left as it was found. It runs as the calls
    that follow will: with gradients when the model is in training mode (``model.train()``, the
    default of a new module) and gradients are on, so training steps use the decisions it made;
    call ``model.eval()`` first (or ``granii`` under ``torch.no_grad()``) when inference
    follows.

    ``extra_args``, ``extra_kwargs``: more arguments of the model's forward for that run
    (``model(graph, feats, *extra_args, **extra_kwargs)``), e.g. edge weights.

    ``reuse_inputs``: work on features that need no gradient (a first layer's ``A X``) is
    computed once and reused while the same tensor comes back unchanged. "Unchanged" is what
    autograd sees: the same object, storage and version counter. A write autograd does not see
    (through ``x.data``, through the array of ``x.numpy()``) is not noticed: pass
    ``reuse_inputs=False`` if your code changes features that way.

    Sampled blocks (``dgl.dataloading``): a layer decides on the first block of a sampler
    configuration and reuses that decision for later blocks of the same configuration (same
    call signature and sizes, and in powers of two the same edges and sources per destination).
    ``per_batch=True`` decides again on every block.

    ``tune``: when many calls follow (not on sampled blocks), the first calls of a decision time
    the best predicted plan, the runner-up when predicted close, and the layer's original forward
    in turn (each call gives the same result) and keep the fastest; ``explain`` shows the times.
    ``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``) makes no decision
    that depends on a measurement: the same input always gets the same plan.

    ``decisions``: the plans chosen in an earlier run (``save_decisions``), a dict or a file;
    each layer then runs the saved plan for each call it has one for, without ranking or
    timing, so a run is repeated exactly and a deployment skips deciding.

    ``memory_limit``: bytes; plans whose predicted peak extra memory (results kept per graph or
    input, plus those of one call) is above it are not chosen (``explain`` shows each plan's).

    Calling ``granii`` again on a model updates the options of its layers (and forgets their
    decisions); layers already optimized are not wrapped twice.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"granii: the model must be a torch.nn.Module holding DGL layers, not "
                        f"{type(model).__name__}")
    if isinstance(decisions, (str, os.PathLike)):
        decisions = load_decisions(decisions)
    elif isinstance(decisions, dict) and "layers" in decisions and "format" in decisions:
        decisions = _saved_layers(decisions, "the dict given")     # save_decisions' whole result
    _check_options(expected_calls, memory_limit, decisions,
                   dict(inspect_now=inspect_now, per_batch=per_batch, reuse_inputs=reuse_inputs,
                        tune=tune, deterministic=deterministic))
    if cost_model is not None or not (isinstance(feats, torch.Tensor) and feats.is_cuda):
        cost_model = _checked_cost_model(cost_model)     # the GPU's is made at its first call
    opts = Options(cost_model, expected_calls, per_batch, reuse_inputs,
                   tune and not deterministic and decisions is None, decisions, memory_limit)
    if inspect_now:
        try:
            layers = find_layers(model, graph, feats, extra_args, extra_kwargs)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note("granii: running the model on the given input failed, so it was "
                           "left unchanged" + _order_hint(model))
            raise
    else:
        layers = find_layers(model)
    if not layers:
        how = ("no submodule of it was called with a graph when it ran on the given input"
               if inspect_now else "no submodule's forward takes a graph first (pass "
               "inspect_now=True to find the layers by running the model)")
        raise TypeError(f"granii: {type(model).__name__} holds no GNN layer: {how}")
    pool.install()
    dropout.install(model)
    wrapped = []
    for name, layer in layers:
        d = dispatcher_of(layer)
        if d is not None:
            d.options = opts
            d.state = None
            d._name = name or type(layer).__name__
            continue
        layer.forward = Dispatcher(layer, name or type(layer).__name__, opts)
        wrapped.append(layer)
    # relational layers (RelGraphConv, HGTConv, HeteroGraphConv): their own dispatchers,
    # granii/hetero_conv.py (DGL's layers: without DGL loaded the model holds none)
    if "dgl" in sys.modules and _relational(model):
        from . import hetero_conv
        for layer in wrapped:
            if hetero_conv.dispatcher_class(layer) is not Dispatcher:
                layer.forward = hetero_conv.dispatcher_class(layer)(
                    layer, layer.forward.state.name, opts)
        wrapped += hetero_conv.wrap_containers(model, opts)
    if inspect_now:
        try:
            _inspect(model, graph, feats, extra_args, extra_kwargs or {})
        except Exception as e:
            for layer in wrapped:
                del layer.__dict__["forward"]
            dropout.uninstall(model)
            # the model's own exception, unchanged (its class may not take one message)
            if hasattr(e, "add_note"):
                e.add_note("granii: running the model on the given input failed, so it was "
                           "left unchanged" + _order_hint(model))
            raise
    return model


def _relational(model):
    """Whether ``model`` holds one of DGL's relational layers (their module, imported only
    then, is a few milliseconds of a first call)."""
    from dgl.nn.pytorch import HeteroGraphConv, HGTConv, RelGraphConv
    return any(isinstance(m, (HeteroGraphConv, HGTConv, RelGraphConv)) for m in model.modules())


def _checked_cost_model(cost_model):
    """The cost model to use: this machine's default for ``None``, the folder's models for a
    path (``granii.learned.load``), else an object with ``predict(prim, impl, gi, dims)``."""
    from . import learned
    if cost_model is None:
        return learned.default_cost_model()
    if isinstance(cost_model, (str, os.PathLike)):
        return learned.load(cost_model)
    if not callable(getattr(cost_model, "predict", None)):
        raise TypeError(f"granii: cost_model must be a folder of cost models (a path) or an "
                        f"object with predict(prim, impl, gi, dims), not "
                        f"{type(cost_model).__name__}; leave it out for this machine's models")
    return cost_model


def _check_options(expected_calls, memory_limit, decisions, flags):
    """``TypeError``/``ValueError`` naming the option, for values the options cannot mean."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"granii: {name} must be True or False, not {value!r}")
    if not number(expected_calls) or not expected_calls >= 1:
        raise ValueError(f"granii: expected_calls is how many calls the model will make on a "
                         f"graph (at least 1), not {expected_calls!r}")
    if memory_limit is not None and not number(memory_limit):
        raise TypeError(f"granii: memory_limit is a number of bytes (or None), not "
                        f"{memory_limit!r}")
    if decisions is not None and not (
            isinstance(decisions, dict)
            and all(isinstance(calls, dict) and all(isinstance(d, dict) and "plan" in d
                                                    for d in calls.values())
                    for calls in decisions.values())):
        raise ValueError("granii: decisions must be what granii.save_decisions(model) returned "
                         "(its 'layers'), or the file it wrote")


def _inspect(model, graph, feats, extra_args=(), extra_kwargs=None):
    """Run ``model`` once on the input as its next calls will run, leaving it exactly as it was.

    A model in training mode with parameters that need gradients, while gradients are on, runs
    with gradients (and no backward): its layers then decide for the training calls that
    follow, not for a call without gradients no training step makes. Otherwise it runs
    without gradients. See ``dispatch.inspecting`` for what the run does not count."""
    saved = _snapshot(model)
    train = model.training and torch.is_grad_enabled() and _any_requires_grad(model)
    parts = graph if isinstance(graph, (list, tuple)) else [graph]
    blocks = bool(parts) and all(getattr(b, "is_block", False) for b in parts)
    try:
        with torch.set_grad_enabled(train), inspecting(model, blocks):
            _call_model(model, graph, feats, extra_args, extra_kwargs or {})
    finally:
        _restore_snapshot(saved)


def _call_model(model, graph, feats, extra_args, extra_kwargs):
    """``model(graph, feats, ...)``, or ``model(feats)`` when its forward takes only the
    features (it holds its graph)."""
    if _takes_features_only(model) and not extra_args:
        return model(feats, **extra_kwargs)
    return model(graph, feats, *extra_args, **extra_kwargs)


def _order_hint(model):
    """A hint when ``model``'s forward takes the features before the graph: the run that
    decides calls ``model(graph, feats)``."""
    names = _forward_params(model)[:2]
    if len(names) == 2 and names[1] in _GRAPH_ARG_NAMES and names[0] not in _GRAPH_ARG_NAMES:
        return (f". It ran model(graph, feats), and this forward takes ({names[0]}, "
                f"{names[1]}): pass inspect_now=False to decide at the model's first call "
                "instead")
    return ""


def _takes_features_only(model):
    try:
        params = [p for p in list(inspect.signature(type(model).forward).parameters.values())[1:]
                  if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def _snapshot(model):
    """RNG state, buffers, attributes and training flags of every submodule."""
    mods = [m for _, m in model.named_modules()]
    return {
        "rng": torch.get_rng_state(),
        "buffers": [(m, n, b.clone()) for m in mods for n, b in m.named_buffers(recurse=False)
                    if b is not None],
        "dicts": [(m, {k: v for k, v in m.__dict__.items()
                       if k not in ("_parameters", "_buffers", "_modules")}) for m in mods],
        "params": [(p, p._version) for p in model.parameters()],
    }


def _restore_snapshot(saved):
    torch.set_rng_state(saved["rng"])
    with torch.no_grad():
        for m, n, b in saved["buffers"]:
            cur = m._buffers.get(n)
            if cur is not None and cur.shape == b.shape:
                cur.copy_(b)
            else:
                m._buffers[n] = b
    for m, attrs in saved["dicts"]:
        for k in [k for k in m.__dict__ if k not in attrs
                  and k not in ("_parameters", "_buffers", "_modules", "forward")]:
            del m.__dict__[k]
        for k, v in attrs.items():
            if m.__dict__.get(k) is not v and k != "forward":
                m.__dict__[k] = v
    for p, version in saved["params"]:
        if p._version != version:
            raise RuntimeError("granii: the model changed its parameters in place while it was "
                               "inspected; pass inspect_now=False")


def save_decisions(model, path=None):
    """The plans the layers of ``model`` chose, per layer and call (signature, sizes, mode), as a
    dict; written to ``path`` as JSON when given. Load them with ``granii(..., decisions=path)``."""
    out = {"format": DECISIONS_FORMAT,
           "layers": {st.name: dict(st.chosen) for st in layer_states(model)}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    return out


def load_decisions(path):
    """Decisions saved by ``save_decisions``: ``{layer name: {call: plan}}``."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"granii: cannot read saved decisions from {path}: {e}. Save them again "
                         "with granii.save_decisions(model, path) after a run.") from None
    return _saved_layers(data, path)


def _saved_layers(data, where):
    """The ``layers`` of what ``save_decisions`` returned, after checking its format."""
    if not isinstance(data, dict) or data.get("format") != DECISIONS_FORMAT or "layers" not in data:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"granii: {where} is not saved decisions of this version (format "
                         f"{got!r}, expected {DECISIONS_FORMAT}). Save them again with "
                         "granii.save_decisions(model, path) after a run.")
    return data["layers"]


def what_ran(model):
    """``{layer name: Ran}``: what the last call of each optimized layer of ``model`` ran: a
    plan (``kind == "plan"``, ``label`` its index and kernels), the layer's own forward as the
    decision for the call (``"original"``: the measured tie-break kept it or gave it its turn,
    or a saved decision names it) or as a fallback (``"fallback"``, ``reason`` says why).
    ``None`` for a layer not called yet."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"granii.what_ran takes the model given to granii(...), not "
                        f"{type(model).__name__}")
    return {st.name: getattr(st, "ran", None) for st in layer_states(model)}


def restore(model):
    """Undo ``granii(model, ...)``: every layer runs its original forward again."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"granii.restore takes the model given to granii(...), not "
                        f"{type(model).__name__}")
    for _, m in model.named_modules():
        if dispatcher_of(m) is not None:
            del m.__dict__["forward"]
    dropout.uninstall(model)
    return model


__all__ = ["granii", "restore", "explain", "save_decisions", "load_decisions", "find_layers",
           "graph_receivers", "is_graph", "what_ran", "Ran", "plan_code", "layer_states",
           "leaf_vals_order", "prepare"]
