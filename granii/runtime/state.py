"""What the runtime keeps per optimized layer: the options, the per-layer state, what a call ran,
and where PyG layers register their call binders."""
import inspect
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..select import EXPECTED_CALLS


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
            from ..learned import default_cost_model
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
    class_last: tuple = None                         # (graph, GraphInfo) by weak reference,
                                                     # {guard: (record, entry)} found for it
    ranked: int = 0                                  # rankings made (``_decide``)
    original_turn: str = None                        # why the own forward took no turn in
                                                     # the last tie-break (``decide``)


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


def original_forward(layer, args, kwargs):
    return type(layer).forward(layer, *args, **kwargs)


# -- one call ----------------------------------------------------------------------------------------
AUTOCAST = ("autocast is on: DGL's layer and torch's autocast rules decide the dtype of each "
            "step (and of the output), which granii's plans do not follow")


def _autocast_check():
    """torch's test of autocast on the CPU or CUDA: ``is_autocast_enabled(device)`` from torch
    2.4 (where ``is_autocast_cpu_enabled`` warns that it is deprecated), the two older calls
    before."""
    try:
        torch.is_autocast_enabled("cpu")
    except TypeError:
        return lambda: torch.is_autocast_cpu_enabled() or torch.is_autocast_enabled()
    return lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


_AUTOCAST_ON = _autocast_check()


def autocast_on():
    """Whether the call runs in an autocast region (CPU or CUDA): then the original forward runs
    (``AUTOCAST``). DGL's GraphConv, for one, returns float32 there from a bfloat16 product
    plus its float32 bias."""
    return _AUTOCAST_ON()


def _any_requires_grad(module):
    """``any(p.requires_grad for p in module.parameters())``, without building the generator."""
    for p in module._parameters.values():
        if p is not None and p.requires_grad:
            return True
    return any(m is not None and _any_requires_grad(m) for m in module._modules.values())


# -- deciding ----------------------------------------------------------------------------------------
ORIGINAL = "original forward"


_INSPECTING = [False]


# (claims(module), prepare(state, module, args, kwargs, reuse_inputs)) of frontends other than
# DGL's: granii/pyg registers PyTorch Geometric's layers when imported (dispatch.Dispatcher
# imports it for the first PyG layer)
CALL_BINDERS = []
# ``[graph_key(args)]``: what a PyG layer's fast tables are keyed by for a call (the index graph
# granii keeps for its unchanged graph input, or ``None``), set by granii/pyg when imported
PYG_FAST_KEY = [None]
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
