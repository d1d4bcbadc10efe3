"""The runtime: what runs in place of an optimized layer's forward.

``granii()`` sets a ``Dispatcher`` (``dispatch.py``) as the ``forward`` of each layer instance.
Per call it

 1. lowers the layer's forward for this call signature (which optional arguments are given,
    graph or block) through frontend -> rewrite -> enumerate -> prune -> lower, once per
    signature and configuration (``variants.py``);
 2. runs the layer's own checks (guards) and checks the operands' sizes (``bind.py``);
 3. looks up the decision for (graph, sizes, signature, mode): a dictionary lookup after the
    first call; on a miss, ranks the promoted plans with the cost model and compiles the winner
    (``decide.py``), or lets the close candidates take measured turns (``tiebreak.py``); a
    sampled block or a new graph of a known class reuses its configuration's or class's
    decision (``reuse.py``);
 4. runs the chosen plan on the layer's own parameters and submodules.

The fast path (``fastpath.py``): once a verified decision has run the normal way for a call on
a graph, the dispatcher keeps a ``FastRun`` for it, under the call's guard (``call_guard``:
grad mode, threads, deterministic algorithms, the layer's training flag, each argument's type,
shape, dtype, device and ``requires_grad``) and the mode the guard does not fix (training,
features repeated). A later call with that guard on that graph checks with one generated
function (``_BindWriter``) that each configuration attribute the variant assumed is the same
object, that each parameter has its shape, and runs the checks that read more than the graph;
then it calls the plan on the operands read live. Anything it cannot prove sends the call
through the normal path, which makes a new run.

Everything a plan reads at run time (parameters, activations, dropout, ``apply_func``) is looked
up on the instance that runs it, so copies, pickles and two models in one process each use
their own. Anything the offline stage cannot handle, for any reason, runs the original forward
and the reason is kept for ``explain``.

Imports run one way: ``state`` <- ``variants`` <- ``bind`` <- ``tiebreak``/``decide`` <-
``fastpath`` <- ``reuse`` <- ``dispatch``.
"""
from .bind import prepare
from .dispatch import Dispatcher, dispatcher_of, inspecting, layer_states
from .state import ORIGINAL, Options, Ran, new_state
from .variants import compile_layer, run_plan

__all__ = ["Dispatcher", "ORIGINAL", "Options", "Ran", "compile_layer", "dispatcher_of",
           "inspecting", "layer_states", "new_state", "prepare", "run_plan"]
