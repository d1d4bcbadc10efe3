"""Selection: the cheapest promoted plan, and the kernel implementation of each of its steps.

    cost(plan) = sum over steps s of  min over implementations i of  c(s, i)
    c(s, i)    = predicted forward time (+ backward when training) of s run by i,
                 divided by ``expected_calls`` when s runs once per graph or once per input.

Plans promoted only for the other embedding-size scenario are skipped first (the paper's
"conditions using embedding sizes"), so the cost models see the rest only; except where the
scenarios' assumption (every step of the forward runs on every call) fails: when the input features
need no gradient and the same tensor came back (``input_repeats``: the first layer of a model on
fixed features), work on the features alone runs once per input (``A H``); in training the backward
adds calls of other sizes. Then every promoted plan is priced.
Training (gradients needed) prices each every-call step whose operands need a gradient by the
measured forward and backward of its implementation (``step_seconds``):

    c = f + (b - f) * g / G + f * g'

with ``f`` the predicted forward, ``b`` the predicted forward + backward computing the ``G``
gradients the profiler measured (``learned.TRAIN_GRADS``: features, weights, edge values,
attention terms), ``g`` of those needed here, and ``g'`` needed gradients of other operands
(priced as one call of the forward each), except that a bias row's gradient is a column sum (one
pass over the result) and an addend (``add``, ``C`` of ``X W + C``) gets the result's gradient for
free. Without a training-phase model (the analytical model,
older model folders) ``c = f (1 + g + g')``: one more call of the same size per gradient
(``dX = A^T dY`` is an SpMM, ``dW = X^T dY`` a GEMM).
"""
from dataclasses import dataclass

from .costmodel import concrete_dims
from .device import runs_on
from .fuse import is_dropout
from .kernels import sparse_rows
from .learned import TRAIN_GRADS
from .plan import EVERY, GRAPH, INPUT, skipped_when_one, step_impls, unit_scalars
from .prune import GE, LT

EXPECTED_CALLS = 100
# Steps with no cost model of their own, each one pass over a matrix like a row scaling of the
# same size (read it, write it): primitive -> (the size naming its rows, passes). An addition
# reads two operands; GAT's per-head scores read X and write a narrow result (priced so only
# where the models have no ``head_dot`` of their own: older model folders).
PASSES = {"add": ("n", 1.5), "cat": ("n", 1.0), "head_dot": ("m", 1.0)}
# per-head primitives priced from a one-head one (``_per_head``), operands in the same places
ONE_HEAD = {"spmm_heads": "spmm_weighted", "head_gemm": "gemm"}
TRIAL_MARGIN = 1.3       # plans predicted within this factor of the best are timed too
TRIAL_PLANS = 2          # at most this many plans take turns (with the layer's own forward)
TRIAL_WIDE = 2.0         # ... and the best plan whose graph kernels are another library's, within
                         # this factor


# argument positions of addends: GEMM's C in X W + C, spmm_norm's residual R
ADDENDS = {"gemm": (2,), "spmm_norm": (5,)}


@dataclass
class Choice:
    plan: object
    impls: tuple
    cost: float
    step_costs: list          # (step, impl, seconds as counted)
    # (position, implementation, seconds more than the chosen one) of a graph step's other
    # implementations
    alternatives: tuple = ()


def scenario(symbols):
    """The size scenario of a call, or ``None`` when every promoted plan competes: without both
    widths, and at ``k_in == k_out``, where the two orders of a product and an aggregation are
    symbolic duplicates (``prune`` keeps one per scenario) that run at different speeds (which
    side a bias or self term fuses into, which result is fresh in cache)."""
    if "k_in" in symbols and "k_out" in symbols and symbols["k_in"] != symbols["k_out"]:
        return GE if symbols["k_in"] > symbols["k_out"] else LT
    return None


def rank(plans, gi, symbols, model, training=False, input_grad=False,
         expected_calls=EXPECTED_CALLS, input_repeats=False, module=None):
    """All candidate plans for this input as ``Choice``s, cheapest first. With the layer
    ``module``, a row scaling by a scalar that is exactly one there (GIN's ``1 + eps`` with
    ``eps = 0``), which the plan skips, costs nothing."""
    scen = scenario(symbols)
    cacheable = (input_repeats and not input_grad
                 and any(s.when == INPUT for p in plans for s in p.steps))
    # The size scenarios assumed a forward whose every step runs on every call. With features
    # that need no gradient, work on them alone is done once (once_per_input); in training the
    # backward adds calls of other sizes (dW = X^T dY skips A^T dY when X needs no gradient):
    # in both cases every promoted plan competes.
    candidates = [p for p in plans
                  if cacheable or training or scen is None or scen in p.scenarios]
    candidates = candidates or list(plans)
    ranked = [price(p, gi, symbols, model, training, input_grad, expected_calls, cacheable,
                    unit_scalars(p, module)) for p in candidates]
    return sorted(ranked, key=lambda c: c.cost)


def trial_candidates(ranking, margin=TRIAL_MARGIN, most=TRIAL_PLANS, wide=TRIAL_WIDE):
    """The choices a measured tie-break times on the first calls (besides the layer's own
    forward): the best predicted, then the next ones predicted within ``margin`` of it whose work
    on the graph differs (``graph_work``), at most ``most`` in all; then the best plan with
    another implementation of one of its graph kernels (``variants``), the cheapest predicted
    within ``margin``: on small graphs two SpMM kernels are often predicted within a few percent
    of each other; last, when none of those runs its graph kernels with another library's
    implementations, the best plan that does, predicted within ``wide``: the graph kernels are
    what a model transferred from another machine misprices most (on graphs the project never
    saw, with the models of another processor, the fastest plan of GCN and SAGE inference ran
    DGL's SpMM where every candidate ran granii's, 1.08x geomean regret against 1.00x for a
    fixed rule).

    Plans that run the same graph kernels on the same sizes differ only in dense products,
    which the models predict well; their graph kernels, irregular, are where predictions miss.
    Timing two variants of one aggregation (say, the attention scores taken from ``X`` or from
    ``X W``) would spend the trial on a difference the model already settles."""
    best = ranking[0]
    picked, seen = [best], {graph_work(best)}
    for c in ranking[1:]:
        if c.cost > margin * best.cost or len(picked) >= most:
            break
        what = graph_work(c)
        if what not in seen:
            seen.add(what)
            picked.append(c)
    for c in sorted(variants(best), key=lambda c: c.cost):
        if c.cost <= margin * best.cost and graph_work(c) not in seen:
            picked.append(c)
            seen.add(graph_work(c))
            break
    libraries = {graph_impls(c) for c in picked}
    other = [v for c in ranking if c.cost <= wide * best.cost for v in [c] + variants(c)
             if v.cost <= wide * best.cost and graph_impls(v) not in libraries
             and graph_work(v) not in seen]
    if other:
        picked.append(min(other, key=lambda c: c.cost))
    return picked


def graph_impls(choice):
    """The implementations of a priced plan's graph kernels, as a set."""
    return frozenset(impl for _, impl, _ in graph_work(choice))


def variants(choice):
    """``choice`` with one graph step run by another implementation, priced by the difference."""
    out = []
    for pos, impl, extra in choice.alternatives:
        impls = list(choice.impls)
        impls[pos] = impl
        step = choice.plan.steps[pos]
        rows = [(s, impl, t + extra) if s is step else (s, i, t) for s, i, t in choice.step_costs]
        out.append(Choice(choice.plan, tuple(impls), choice.cost + extra, rows))
    return out


def graph_work(choice):
    """The graph kernels of a priced plan: ``(primitive, implementation, sizes)`` of each step
    whose sizes involve the edges, sorted."""
    return tuple(sorted((s.prim, impl, s.sig[2]) for s, impl in zip(choice.plan.steps,
                                                                     choice.impls)
                        if s.sig is not None and "E" in s.sig[2]))


def price(plan, gi, symbols, model, training, input_grad, expected_calls, cacheable=False,
          ones=()):
    grad_vars = _needs_grad(plan, training, input_grad)
    impls, rows, total, alts = [], [], 0.0, []
    runs = getattr(gi.g, "runs", None)      # an index graph (granii/pyg) runs no DGL kernel
    for step in plan.steps:
        if step.sig is None:
            impls.append("inline")
            continue
        if step.args[0] in ones and skipped_when_one(plan, step):
            impl = step_impls(step)[0]
            impls.append(impl)
            rows.append((step, impl, 0.0))
            continue
        dims = concrete_dims(step.sig, symbols)
        options = []
        needed = tuple(i for i, a in enumerate(step.args) if _base(a) in grad_vars)
        bias = tuple(i for i in needed if _is_row(plan, step.args[i]))
        # an addend's gradient is the result's, a concatenation's the column blocks of it
        # (views): nothing to compute
        needed = () if step.prim in ("add", "cat") else tuple(
            i for i in needed if i not in bias and i not in ADDENDS.get(step.prim, ()))
        extra = len(bias) * _column_sum_seconds(model, step.prim, gi, dims) if bias else 0.0
        # a bias add reads one matrix, not two: a row scaling's pass, not PASSES["add"]'s
        scale = 1 / PASSES["add"][1] if step.prim == "add" and any(
            _is_row(plan, a) for a in step.args) else 1.0
        for impl in step_impls(step):
            if not runs_on(impl, gi.gpu) or runs is not None and not runs(impl):
                continue
            prim, need = _priced_as(step, impl, needed)
            t = scale * step_seconds(model, prim, impl, gi, dims, _heads(plan), need) + extra
            if (step.prim, impl) == ("gemm", "native"):       # reads X's nonzeros only
                t = (t * sparse_rows.time_ratio(_density(plan, symbols, step.args[0]))
                     + sparse_rows.SAMPLE_SECONDS)
            amortised = step.when == GRAPH or (step.when == INPUT and cacheable)
            options.append((t / expected_calls if amortised else t, impl))
        if not options:          # no kernel runs it on this graph: never preferred
            options.append((float("inf"), step_impls(step)[0]))
        t, impl = min(options)
        if "E" in step.sig[2]:
            alts += [(len(impls), other, u - t) for u, other in options if other != impl]
        impls.append(impl)
        rows.append((step, impl, t))
        total += t
    return Choice(plan, tuple(impls), total, rows, tuple(alts))


def _priced_as(step, impl, needed):
    """``(primitive, needed)`` whose model prices ``step`` run by ``impl``. The native
    normalised SpMM without a source scale (SAGE's mean, GIN's sum with its residual) runs the
    unweighted SpMM's loop, the destination scale and the adds applied as each row is written:
    an SpMM's cost. ``spmm_norm``'s own models were profiled with both scales, whose source
    factor, read per nonzero, made them price it at up to 1.7x the SpMM and its row scaling
    (measured: 0.45-0.8x of those on GitHub and PubMed blocks, k = 128 and 256)."""
    if step.prim == "spmm_norm" and impl == "native" and step.args[1] is None:
        return "spmm", tuple(0 for i in needed if i == 2)      # x: spmm's operand 0
    return step.prim, needed


def step_seconds(model, prim, impl, gi, dims, heads=1, needed=()):
    """Predicted seconds of one call, with the backward of the operands at positions ``needed``
    (see the module docstring)."""
    f = _predict(model, prim, impl, gi, dims, heads)
    if not needed:
        return f
    if prim == "spmm_heads" and not _learned(model, prim, impl, "train"):
        return f + _heads_backward(model, impl, gi, dims, heads, f, needed)
    measured = TRAIN_GRADS.get(ONE_HEAD.get(prim, prim), ())
    inside = sum(1 for i in needed if i in measured)
    outside = len(needed) - inside
    b = _predict(model, prim, impl, gi, dims, heads, "train") if inside else None
    if b is None:
        return f * (1 + len(needed))
    return f + max(b - f, 0.0) * inside / len(measured) + f * outside


def _heads(plan):
    return int(plan.heads[0]) if plan.heads else 1


def _predict(model, prim, impl, gi, dims, heads, phase="forward"):
    """Predicted seconds of one call. With several attention heads, edge scores and softmax
    carry ``heads`` values per edge (the fused GAT aggregation too, over ``k`` columns); a weighted SpMM over heads is one call of the full width
    ``k`` in both implementations (DGL's native heads; torch's interleaved CSR product with
    ``heads`` values per edge on rows of ``k / heads``: the same multiply-adds)."""
    if heads > 1 and prim in ("sddmm_add", "edge_softmax", "gat_aggregate"):
        dims = dict(dims, heads=heads)
    if prim in ("spmm_heads", "head_gemm"):
        return _per_head(model, prim, impl, gi, dims, max(heads, 1), phase)
    if prim in PASSES and not _learned(model, prim, impl, phase):
        # one pass over a matrix: priced as a row scaling of its size
        rows, scale = PASSES[prim]
        t = _predict(model, "row_scale", "torch", gi, {"n": dims[rows], "k": dims["k"]}, 1)
        return t * scale if phase == "forward" else None
    if phase == "forward":
        return model.predict(prim, impl, gi, dims)
    train = getattr(model, "predict_train", None)
    return train(prim, impl, gi, dims) if train is not None else None


def _per_head(model, prim, impl, gi, dims, heads, phase):
    """Seconds of a per-head primitive: by its own model where the machine's models have one
    (profiled by the full and ``--graph-stride`` runs, not by ``--quick``) or the models they
    fall back to do, else from one-head ones:

        head_gemm  (m, k, H F)    = H gemm (m, k, F)
        spmm_heads (E, k), native = spmm_weighted (E, k) + (H - 1) / 2 row_scale (n, k)
        spmm_heads (E, k), dgl    = H spmm_weighted (E, k)

    The native kernel walks each row's edges once for all heads: the gathered rows come from
    memory for the first head and from cache for the others, which add their result block (a
    write, half a row scaling's read and write). DGL's broadcasting kernel does the same E H k
    multiply-adds as a weighted product per head, and is priced as that."""
    if _learned(model, prim, impl, phase):
        d = dict(dims, heads=heads)
        return (model.predict(prim, impl, gi, d) if phase == "forward"
                else model.predict_train(prim, impl, gi, d))
    if prim == "head_gemm":
        one = dict(dims, n=max(1, dims["n"] // heads))
        t = _predict(model, ONE_HEAD[prim], impl, gi, one, 1, phase)
        return None if t is None else heads * t
    if phase != "forward":           # spmm_heads' backward is priced by _heads_backward
        return None
    t = _predict(model, ONE_HEAD[prim], impl, gi, dims, 1)
    if t is None or impl != "native":
        return None if t is None else heads * t
    return t + (heads - 1) / 2 * _predict(model, "row_scale", "torch", gi, dims, 1)


def _learned(model, prim, impl, phase):
    """Whether ``model``, or a learned model it falls back to for pairs it lacks (another
    machine's models transferred), has a model for ``(prim, impl)`` in ``phase``: a
    ``--quick`` init has no per-head models, and those of the shipped models price the per-head
    plans better than one-head derivations, which underpriced them up to 3x. Models of a full
    profile that ran to its end stand alone: a pair they lack (an addition, a concatenation)
    no profile measures."""
    while model is not None:
        has = getattr(model, "has_model", None)
        if has is None:
            return False
        if has(prim, impl, phase):
            return True
        if getattr(model, "complete", False):
            return False     # no other folder's manifests read (milliseconds of a first call)
        learned_fallback = getattr(model, "learned_fallback", None)
        model = learned_fallback() if learned_fallback else getattr(model, "fallback", None)
    return False


def _heads_backward(model, impl, gi, dims, heads, f, needed):
    """Backward of ``spmm_heads(w, X)``: ``dw[e, h] = <dY[v, h], X[u]>`` walks the edges as the
    forward does (``f``); ``dX[u] = sum_h sum_e w[e, h] dY[v, h]`` gathers H k values per edge
    (H one-head weighted products on the transpose)."""
    t = f if 0 in needed else 0.0
    if 1 in needed:
        t += heads * _predict(model, ONE_HEAD["spmm_heads"], impl, gi, dims, 1)
    return t


def _needs_grad(plan, training, input_grad):
    """Variables whose gradient the backward pass computes."""
    if not training:
        return set()
    grad = {v for v, l in plan.leaves.items()
            if l.sub == "weight" or (input_grad and l.source[0] in ("arg", "edge"))}
    for step in plan.steps:
        if any(_base(a) in grad for a in step.args):
            grad.add(step.var)
    return grad


def _is_row(plan, arg):
    """``arg`` is a leaf of one row broadcast over the result (a bias): its gradient is the
    column sum of the result's gradient, one pass over it."""
    leaf = plan.leaves.get(arg) if isinstance(arg, str) else None
    return leaf is not None and leaf.rows == "1"


def _column_sum_seconds(model, prim, gi, dims):
    """One pass over a step's (rows x cols) result, priced as a row scaling of that size."""
    rows, cols = (dims["m"], dims["n"]) if prim == "gemm" else (dims.get("n"), dims.get("k"))
    if rows is None or cols is None:
        return 0.0
    return _predict(model, "row_scale", "torch", gi, {"n": rows, "k": cols}, 1)


def _density(plan, symbols, var):
    """The density the dispatcher sampled from the features that ``var`` holds, read through
    the dropout modules applied to them on the way (they keep zeros zero); ``None`` if none was
    recorded."""
    by_var = {st.var: st for st in plan.steps}
    while var in by_var:
        st = by_var[var]
        if st.prim != "apply" or len(st.args) != 1 or not is_dropout(plan, st):
            return None
        var = st.args[0]
    return symbols.get(sparse_rows.density_symbol(var))


def _base(arg):
    """The variable an argument reads: ``pack`` for ``pack[0]`` (a part of a step's tuple)."""
    return arg.split("[", 1)[0] if isinstance(arg, str) else arg


__all__ = ["rank", "price", "trial_candidates", "TRIAL_MARGIN", "step_seconds", "Choice",
           "EXPECTED_CALLS", "EVERY"]
