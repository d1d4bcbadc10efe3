"""Deciding one call: rank the promoted plans with the cost model (within the memory limit),
compile the winner, or start a measured tie-break among the close ones."""
import torch

from ..device import free_memory, gpu_cost_model
from ..memory import fmt_bytes, plan_memory
from ..plan import compile_plan
from ..select import rank, trial_candidates
from .state import ORIGINAL
from .tiebreak import Trial
from .variants import leaf_vals_order

ORIGINAL_MEMORY_FACTOR = 4       # the layer's own forward takes no tie-break turn when it needs
ORIGINAL_MEMORY_FLOOR = 1 << 30  # this many times the chosen plan's memory, and these bytes


def decision_key(call):
    """What a saved decision is looked up by: signature, sizes and mode (no object identities)."""
    present, is_block, config = call.key[1:]
    key = (sorted(present), is_block, config, sorted(call.symbols.items()), call.training,
           call.input_grad, call.input_repeats)
    return repr(key + (call.gi.device.type,) if call.gi.gpu else key)


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
    model = gpu_cost_model(str(call.gi.device)) if call.gi.gpu else options.model()
    state.ranked += 1
    calls = 1 if call.gi.is_block else options.expected_calls
    ranking = rank(call.compiled.plans, call.gi, call.symbols, model, call.training,
                   call.input_grad, calls, call.input_repeats, call.module)
    limit = options.memory_limit
    if limit is None and call.gi.gpu:
        limit = free_memory(call.gi.device)
    if limit is not None:
        ranking = within_memory(ranking, call.symbols, limit)
    best = ranking[0]
    fn, code = compile_plan(best.plan, best.impls)
    state.last = (call.symbols, ranking, best, code, call.training,
                  getattr(model, "name", type(model).__name__))
    chosen = (f"[{best.plan.index}]", fn, leaf_vals_order(best.plan), best.impls)
    state.original_turn = None
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
        state.original_turn = original_turn_refused(call, best, limit)
        if state.original_turn is None:
            cands.append((ORIGINAL, None, None))
    if len(cands) == 1:
        return chosen
    # each sampled block is new, so a candidate's first call on one is like its later calls;
    # but not on the GPU, where a plan's first call compiles its kernels
    warm = 0 if call.gi.is_block and not call.gi.gpu else 1
    return Trial(cands, warm=warm)


def original_turn_refused(call, best, limit):
    """Why the layer's own forward takes no turn in the tie-break (a string), or ``None``.

    A turn runs that forward whole, to time it. Where the frontend knows the least it writes
    (``Call.original_bytes``: PyG's messages, one row per edge of each unfused propagate), it
    takes no turn when that alone exceeds the memory limit (``memory_limit``, on a GPU its free
    memory), or exceeds both ``ORIGINAL_MEMORY_FACTOR`` times the chosen plan's predicted peak
    extra memory (``memory.plan_memory``) and ``ORIGINAL_MEMORY_FLOOR``: a measurement must not
    raise the process's peak memory several times over what the plans it checks need. Seen on
    an H200, 2M nodes and 42M edges (``results/gpu/run6``): with PyG's GATConv turn the first
    training calls peaked 88 GiB above what the process held before, where granii's settled
    calls took 6.5 GiB, and GCNConv's first inference calls 48 GiB above it; a forward that
    writes that many bytes more is not the fastest on memory-bound hardware either (PyG eager
    took 9-17 times granii's settled calls there)."""
    need = call.original_bytes
    if not need:
        return None
    peak = sum(plan_memory(best.plan, call.symbols))
    if limit is not None and need > limit:
        over = f"over the memory limit of {fmt_bytes(limit)}"
    elif need > ORIGINAL_MEMORY_FACTOR * peak and need > ORIGINAL_MEMORY_FLOOR:
        over = (f"over {ORIGINAL_MEMORY_FACTOR} times the chosen plan's predicted "
                f"{fmt_bytes(peak)}")
    else:
        return None
    return (f"its messages alone take {fmt_bytes(need)} (one row per edge), {over}: it takes no "
            "turn in the measured tie-break")


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
