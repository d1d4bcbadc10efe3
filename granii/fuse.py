"""Fusion passes: a lowered plan -> the same plan with chains of steps replaced by one fused primitive.

Each pass is a plain function from a ``Plan`` to a new ``Plan`` (or ``None`` when nothing fused),
like a peephole pass of a compiler. A fused plan is an extra candidate beside the plan it came
from: selection prices both, and every fused primitive also has implementations that run the
unfused sequence, so fusing never removes a choice.

    normalised SpMM   row_scale(d_dst, spmm(row_scale(d_src, X)))       -> spmm_norm(d_dst, d_src, X)
                      spmm_weighted(sddmm_scale(d_dst, 1, d_src), X)    -> spmm_norm(d_dst, d_src, X)
                      (either scale may be absent; ``+ bias``, ``+ R`` (a matrix: SAGE's self term,
                      GIN's (1 + eps) X) and a ReLU that follow are applied as each output row is
                      written; a constant scale applied to the result first, APPNP's
                      ``(1 - alpha) * ...``, joins ``d_dst`` as a vector made once per graph)
    shared GEMM       X W_1 [+ b_1], X W_2 [+ b_2]                      -> X [W_1 W_2] [+ [b_1 b_2]], split
                      (one split, so the backward writes [dY_1 dY_2] once instead of zero-filling
                      the packed width for each block)
    GAT aggregation   spmm_weighted(dropout(softmax(leaky_relu(el_u + er_v))) [* w_e], Theta)
                          -> mask = dropout(ones); gat_aggregate(el, er, Theta, slope, mask [* w])
                      (``+ bias`` that follows is added as each output row is written)
    edge scores       head_dot(edge_message(a, b, c, act), blockdiag(att))
                          -> edge_message_score(a, b, c, act, att)
                      (GATv2's per-head scores without the E x K messages)

A chain fuses only when its inner results have no other use and run when the fused step runs.
"""
from dataclasses import replace

import torch

from .frontend.udf import leaky_relu_slope
from .plan import EVERY, GRAPH, Step

_RELUS = (torch.relu, torch.nn.functional.relu)


def fused_variants(plan):
    """The plans the fusion passes make from ``plan`` (possibly none)."""
    out = []
    norm = fuse_normalised_spmm(plan)
    if norm is not None:
        out.append(norm)
    gat = fuse_gat(norm or plan)
    if gat is not None:
        out.append(gat)
    scores = fuse_edge_scores(gat or norm or plan)
    if scores is not None:
        out.append(scores)
    shared = fuse_shared_gemm(scores or gat or norm or plan)
    if shared is not None:
        out.append(shared)
    return out


def fuse_shared_gemm(plan):
    """Two GEMMs of one left operand, ``X W_1 [+ b_1]`` and ``X W_2 [+ b_2]`` (SAGE's self and
    neighbour products), as one ``X [W_1 W_2] [+ [b_1 b_2]]`` whose column blocks are the two
    results: ``X`` is read once in the forward, and once in the backward
    (``[dW_1 dW_2] = X^T [dY_1 dY_2]``). Weights and biases must be parameters."""
    if any(ref[:1] == ("detach",) for ref in plan.applies.values()):
        return None      # a weight behind .detach() must get no gradient, not a zero one
    gemms = [st for st in plan.steps if st.prim == "gemm" and st.when == EVERY]

    def param(var, row=False):
        leaf = plan.leaves.get(var)
        return leaf is not None and leaf.sub == "weight" and (not row or leaf.rows == "1")

    for i, a in enumerate(gemms):
        for b in gemms[i + 1:]:
            if a.args[0] != b.args[0] or not (param(a.args[1]) and param(b.args[1])):
                continue
            ba, bb = (st.args[2] if len(st.args) == 3 else None for st in (a, b))
            if any(c is not None and not param(c, row=True) for c in (ba, bb)):
                continue
            pack, both = f"{a.var}_w", f"{a.var}_{b.var}"
            parts = f"{both}_parts"
            x, (m, k, n1), n2 = a.args[0], a.sig[2], b.sig[2][2]
            new = [Step(pack, "gemm_pack", (a.args[1], b.args[1], ba, bb), EVERY, a.key),
                   Step(both, "gemm", (x, f"{pack}[0]", f"{pack}[1]"), EVERY,
                        f"{a.key} | {b.key}", ("gemm", False, (m, k, f"{n1}+{n2}")), a.inputs),
                   Step(parts, "columns", (both, a.args[1]), EVERY, f"{a.key} | {b.key}"),
                   Step(a.var, "alias", (f"{parts}[0]",), EVERY, a.key),
                   Step(b.var, "alias", (f"{parts}[1]",), EVERY, b.key)]
            steps = []
            for st in plan.steps:
                if st is a:
                    steps += new
                elif st is not b:
                    steps.append(st)
            return _rebuild(plan, steps, "h")
    return None


def _uses(plan):
    uses = {}
    for st in plan.steps:
        for a in st.args:
            if isinstance(a, str):
                uses.setdefault(a, []).append(st)
    uses.setdefault(plan.out, []).append(None)
    return uses


def _is_degree(plan, var):
    """``var`` holds a diagonal: a degree power, or a product of diagonals (``diag_mul``)."""
    leaf = plan.leaves.get(var)
    if leaf is not None:
        return leaf.source[0] == "degree"
    return any(st.var == var and st.prim == "diag_mul" for st in plan.steps)


def _rebuild(plan, steps, suffix):
    """A copy of ``plan`` with ``steps``, its index marked as derived (``3n``)."""
    used = {a for st in steps for a in st.args} | {plan.out}
    leaves = {v: l for v, l in plan.leaves.items() if v in used}
    return replace(plan, index=f"{plan.index}{suffix}", steps=steps, leaves=leaves,
                   applies={v: r for v, r in plan.applies.items()
                            if any(st.var == v for st in steps)})


def fuse_normalised_spmm(plan):
    """Every unweighted SpMM with the degree scales around it, and every weighted SpMM whose edge
    values are the once-per-graph ``d_dst[v] d_src[u]``, as one ``spmm_norm`` step; then the
    adds and the ReLU that follow it as its epilogue (``_epilogue``), when nothing else uses the
    intermediate. A plain SpMM followed by an add becomes an ``spmm_norm`` without scales."""
    plan = replace(plan, applies=dict(plan.applies))     # _epilogue may add a scaled vector
    by_var = {st.var: st for st in plan.steps}
    uses = _uses(plan)

    def only_user(var):
        users = uses.get(var, ())
        return users[0] if len(users) == 1 else None

    def degree_scale(st, var, when):
        """``st`` is ``row_scale(d, var)`` by a degree vector, run when ``when`` is."""
        return (st is not None and st.prim == "row_scale" and st.args[1] == var
                and _is_degree(plan, st.args[0]) and st.when == when)

    gone, replaced = set(), {}
    for st in plan.steps:
        if st.prim == "spmm":
            x, d_src, d_dst, last = st.args[0], None, None, st
            prod = by_var.get(x)
            if only_user(x) is st and x not in replaced and prod is not None and \
                    degree_scale(prod, prod.args[-1], st.when):
                d_src, x = prod.args
                gone.add(prod.var)
            user = only_user(st.var)
            if degree_scale(user, st.var, st.when):
                d_dst, last = user.args[0], user
                gone.add(st.var)
            if d_src is None and d_dst is None and getattr(only_user(st.var), "prim", None) != "add":
                continue        # a plain SpMM fuses only to take an add as its epilogue
        elif st.prim == "spmm_weighted":
            w = by_var.get(st.args[0])
            if w is None or w.prim != "sddmm_scale" or w.args[1] is not None:
                continue
            d_dst, _, d_src = w.args
            x, last = st.args[1], st
        else:
            continue
        replaced[last.var] = Step(last.var, "spmm_norm", (d_dst, d_src, x), last.when, last.key,
                                  ("spmm_norm",) + tuple(st.sig[1:]), st.inputs)
    if not replaced:
        return None
    steps = [replaced.get(st.var, st) for st in plan.steps if st.var not in gone]
    steps = _epilogue(plan, _drop_unused(steps, plan.out))
    return _rebuild(plan, steps, "n")


# Fused steps that apply what follows them as each output row is written: the argument position
# of each epilogue term they take. spmm_norm: act(D_dst A D_src X + bias + R); gat_aggregate:
# + bias.
_EPILOGUES = {"spmm_norm": {"bias": 3, "act": 4, "res": 5}, "gat_aggregate": {"bias": 5}}


def _epilogue(plan, steps):
    """Fold into each fused step (``_EPILOGUES``) the adds and the ReLU that follow it, when
    nothing else reads what they add to: a bias row (a parameter of one row), a residual (a
    dense matrix of the result's shape: SAGE's self term, GIN's ``(1 + eps) X``), then a ReLU.
    Adds commute, so the bias and the residual fold in either order, both before the ReLU.
    A residual computed every call folded into a once-per-input aggregation makes it run on
    every call: another candidate, priced as such (a once-per-input residual, APPNP's
    ``alpha h_0`` on features without gradient, keeps it once per input)."""
    while True:
        uses = _uses(replace(plan, steps=steps))
        for st in steps:
            slots = _EPILOGUES.get(st.prim)
            users = uses.get(st.var, ())
            if slots is None or len(users) != 1 or users[0] is None:
                continue
            user = users[0]
            scaled = _fold_scale(plan, st, user, steps)
            if scaled is not None:
                steps = [x for y in steps if y is not st for x in (scaled if y is user else [y])]
                break
            args = list(st.args) + [None] * (max(slots.values()) + 1 - len(st.args))
            if "act" in slots and args[slots["act"]] is not None:
                continue
            slot, value = _epilogue_term(plan, st, user)
            if slot not in slots or args[slots[slot]] is not None or \
                    (st.when != EVERY and slot != "res"):
                continue
            args[slots[slot]] = value
            while args and args[-1] is None:
                args.pop()
            # at the user's place: what it adds may be computed after the fused step
            new = replace(st, var=user.var, args=tuple(args), when=user.when, key=user.key,
                          inputs=user.inputs if user.when != EVERY else st.inputs)
            steps = [new if x is user else x for x in steps if x is not st]
            break
        else:
            return steps


def _fold_scale(plan, st, user, steps):
    """``c * spmm_norm(d_dst, d_src, X)`` (a constant scale applied to the result, before any
    epilogue term: APPNP's ``(1 - alpha) D^-1/2 A D^-1/2 h``) as ``spmm_norm(c d_dst, d_src,
    X)``: the scale joins the destination degrees, a vector made once per graph, and the pass
    over the result goes. Returns the two steps (vector, product) or ``None``."""
    if st.prim != "spmm_norm" or len(st.args) != 3 or st.args[0] is None or \
            user.prim != "apply":
        return None
    ref = plan.applies.get(user.var, ())
    if ref[:1] != ("scale",) or not isinstance(ref[1], (int, float)):
        return None
    d_dst = st.args[0]
    key = f"{ref[1]!r} * {d_dst}"
    made = [x for x in steps if x.prim == "apply" and x.when == GRAPH and x.key == key]
    fused = replace(st, var=user.var, key=user.key)
    if made:                    # every hop scales by the same vector: made once
        return [replace(fused, args=(made[0].var,) + st.args[1:])]
    var = f"{user.var}_d"
    plan.applies[var] = ref
    vec = Step(var, "apply", (d_dst,), GRAPH, key)
    return [vec, replace(fused, args=(var,) + st.args[1:])]


def _epilogue_term(plan, st, user):
    """``(slot, argument)`` of what ``user`` does to the result of ``st``, or ``(None, None)``."""
    if user.when != EVERY and user.when != st.when:
        return None, None
    if user.prim == "apply":
        ref = plan.applies.get(user.var, ())
        fn = ref[1] if ref and ref[0] == "function" else (ref[2] if len(ref) > 2 else None)
        return ("act", "'relu'") if any(fn is r for r in _RELUS) else (None, None)
    if user.prim != "add" or user.args[0] == user.args[1]:
        return None, None
    other = user.args[1] if user.args[0] == st.var else user.args[0]
    leaf = plan.leaves.get(other)
    if leaf is not None and leaf.rows == "1" and leaf.cols != "1" and leaf.source[0] == "param":
        return "bias", other
    if leaf is None or (leaf.kind == "dense" and "1" not in (leaf.rows, leaf.cols)):
        return "res", other
    return None, None


def _drop_unused(steps, out_var):
    while True:
        used = {a for st in steps for a in st.args} | {out_var}
        keep = [st for st in steps if st.var in used or st.prim == "store"]
        if len(keep) == len(steps):
            return keep
        steps = keep


def fuse_gat(plan):
    """GAT's scores, leaky ReLU, softmax over in-edges [, attention dropout] [, edge weight] and
    weighted aggregation as one ``gat_aggregate`` step, when the attention values are used by
    nothing else (no ``get_attention``).

    Attention dropout (an ``nn.Dropout`` module, or ``F.dropout``, between the softmax and the
    aggregation) becomes a mask drawn at the same place in the plan: the same call on ones of
    the attention's size, which draws exactly the random numbers it would have drawn on the
    attention and gives ``bernoulli(1 - p) / (1 - p)``. The mask multiplies the attention per
    edge and head inside the kernel (with the edge weight, when there is one)."""
    by_var = {st.var: st for st in plan.steps}
    uses = _uses(plan)
    single = lambda var: len(uses.get(var, ())) == 1
    for st in plan.steps:
        if st.prim != "spmm_weighted":
            continue
        chain, a, w = [], st.args[0], None
        step = by_var.get(a)
        if step is not None and step.prim == "edge_scale" and single(a):
            chain.append(step)
            a, w = step.args
            step = by_var.get(a)
        drop = None
        if step is not None and step.prim == "apply" and single(a) and is_dropout(plan, step):
            drop = step
            a = step.args[0]
            step = by_var.get(a)
        if step is None or step.prim != "edge_softmax" or not single(a):
            continue
        chain.append(step)
        step = by_var.get(step.args[0])
        if step is None or step.prim != "apply" or not single(step.var):
            continue
        slope = _leaky_relu_slope(plan.applies.get(step.var, ()), step)
        if slope is None:
            continue
        chain.append(step)
        score = by_var.get(step.args[0])
        if score is None or score.prim != "sddmm_add" or not single(score.var):
            continue
        chain.append(score)
        if any(c.when != EVERY for c in chain) or st.when != EVERY:
            continue
        el, er = score.args
        replaced = {}
        if drop is not None:
            mask = [Step(drop.var, "edge_mask", (el,), EVERY, drop.key)]
            if w is not None:
                mask.append(Step(f"{drop.var}_w", "edge_scale", (drop.var, w), EVERY, drop.key))
            replaced[drop.var] = mask
            w = mask[-1].var
        fused = Step(st.var, "gat_aggregate", (el, er, st.args[1], slope, w), EVERY, st.key,
                     ("gat_aggregate", False, st.sig[2]), st.inputs)
        replaced[st.var] = [fused]
        gone = {c.var for c in chain}
        steps = [r for s in plan.steps if s.var not in gone for r in replaced.get(s.var, [s])]
        return _rebuild(plan, _epilogue(plan, steps), "g")
    return None


def fuse_edge_scores(plan):
    """Every per-head score of edge messages, ``head_dot(edge_message(a, b, c, act, slope),
    blockdiag(att))`` whose messages nothing else reads, as one ``edge_message_score`` step
    (GATv2's scores: the E x K messages are never stored)."""
    by_var = {st.var: st for st in plan.steps}
    uses = _uses(plan)
    replaced, gone = {}, set()
    for st in plan.steps:
        msg = by_var.get(st.args[0]) if st.prim == "head_dot" and st.args else None
        if msg is None or msg.prim != "edge_message" or len(uses.get(msg.var, ())) != 1 or \
                msg.when != st.when:
            continue
        replaced[st.var] = replace(st, prim="edge_message_score", args=msg.args + (st.args[1],),
                                   sig=("edge_message_score", False, msg.sig[2]))
        gone.add(msg.var)
    if not replaced:
        return None
    steps = [replaced.get(st.var, st) for st in plan.steps if st.var not in gone]
    return _rebuild(plan, steps, "e")


def _leaky_relu_slope(ref, step):
    """The code that reads the negative slope of the leaky ReLU applied by ``step``: the
    module's attribute (GATConv's ``nn.LeakyReLU``), or the constant of ``F.leaky_relu`` written
    in a message function; ``None`` when ``step`` applies anything else."""
    if ref[:1] == ("module",) and step.key.startswith(f"{ref[1]}:LeakyReLU("):
        if ref[1].isidentifier():
            return f"module.{ref[1]}.negative_slope"
        return f"module.get_submodule({ref[1]!r}).negative_slope"
    slope = leaky_relu_slope(ref)
    return None if slope is None else repr(slope)


def is_dropout(plan, step):
    """``step`` applies one of the layer's ``nn.Dropout`` modules, or ``F.dropout(x, p, True)``
    (PyG's GATConv drops its attention values so)."""
    ref = plan.applies.get(step.var, ())
    return (ref[:1] == ("module",) and step.key.startswith(f"{ref[1]}:Dropout(")
            or ref[:1] == ("dropout",))
