"""Lowering: a promoted association tree -> a ``Plan`` of primitive calls, and its Python code.

A plan is the ordered list of ``Step``s that computes the layer, each a primitive call on earlier
results. A step is run

    every call      when it reads a weight (its result changes whenever the weights do),
    once per graph  when it reads only the graph (degree powers, a normalised adjacency ``D A D``),
    once per input  when it reads only the graph and the input features/edge values: when these do
                    not require grad (the first layer of a model on fixed features), ``A H`` is
                    computed once and reused while the same tensor (same version) comes back.

Once-per-graph and once-per-input values live in the graph's ``GraphInfo.cache`` under the text of
their sub-expression, so two layers on the same graph share them and a new graph never sees them.

``plan_code(plan, impls)`` generates the function that runs a plan with one kernel implementation
per step: plain Python a person can read (``explain`` prints it), compiled once per choice.
"""
import functools
import re
import weakref
from dataclasses import dataclass, field, replace

import torch

from . import diskcache, ir, kernels
from .kernels.scalars import is_one, scalar  # noqa: F401 (the generated code's)
from .enumerate import Node, steps as tree_steps, tree_calls  # noqa: F401 (re-exported)
from .prune import signature

EVERY, GRAPH, INPUT = "every call", "once per graph", "once per input"
# written out in the generated code
INLINE = ("add", "cat", "apply", "store", "row_slice", "edge_scale", "alias", "edge_mask",
          "gemm_pack", "columns")
COMPUTED = ("degree", "scalar", "headdiag", "wdegree")   # leaves the generated code computes


@dataclass
class Step:
    var: str
    prim: str            # kernel primitive; "add" and "apply" run inline
    args: tuple          # argument expressions in the generated code (variable names or None)
    when: str            # EVERY, GRAPH or INPUT
    key: str             # text of the sub-expression: the cache key of once-per-graph/input values
    sig: tuple = None    # (primitive, once, symbolic sizes) for cost models
    inputs: tuple = ()   # input variables a once-per-input step depends on


@dataclass
class Plan:
    index: int
    choice: dict                     # {product: association tree}
    scenarios: tuple
    steps: list
    leaves: dict                     # variable name -> Leaf (arguments, parameters, degrees)
    out: str
    applies: dict = field(default_factory=dict)   # variable name -> ``ref`` of an Apply barrier
    heads: tuple = None                           # (H, F) of a multi-head output

    def composition(self):
        """The primitives in execution order, e.g. ``sddmm_scale -> spmm_weighted -> gemm``."""
        return " -> ".join(s.prim for s in self.steps if s.prim not in INLINE)

    def trees(self):
        """Each distinct tree once, a computed operand (another product's result, a sum, a
        function) shown as ``(..)``: a k-hop chain reads as its one step, not k nested copies."""
        return "; ".join(dict.fromkeys(_short(t) for t in self.choice.values()))


def _short(tree):
    if isinstance(tree, Node):
        return f"{tree.prim}[{' . '.join(_short(p) for p in tree.parts)}]"
    if isinstance(tree, ir.Leaf):
        return str(tree)
    return "A[..]" if isinstance(tree, ir.SparseEdges) else "(..)"


@functools.lru_cache(maxsize=None)
def _ident(text):
    return re.sub(r"\W", "_", text.replace("^-", "_m").replace(".", "_")).strip("_")


def leaf_var(leaf):
    if leaf.source[0] == "degree":
        _, side, p, _, shift = leaf.source
        return _ident(f"D_{side}_p{p:g}" + (f"_s{shift:g}" if shift else ""))
    if leaf.source[0] == "wdegree":
        _, side, p, _, _ = leaf.source
        return _ident(f"Dw_{side}_p{p:g}")
    if leaf.source[0] in ("scalar", "headdiag"):
        return _ident(f"{leaf.source[0]}_{leaf.source[1]}")
    if leaf.source[0] in ("arg", "edge", "arg_dst"):
        return _ident(leaf.source[1].replace(":", "_") +
                      ("_dst" if leaf.source[0] == "arg_dst" else ""))
    if leaf.source[0] == "param_block":
        return _ident(f"{leaf.source[1]}_T_block{leaf.source[2]}")
    return _ident(leaf.name)


def _when(leaf_set):
    """When a result computed from ``leaf_set`` runs: once per graph if it reads only the graph,
    once per input if it reads only the graph and arguments through pure functions, else at
    every call (parameters, buffers, anything behind an impure function: ``BARRIER``)."""
    sources = {l.source[0] for l in leaf_set}
    if sources <= {"graph", "degree", "select"}:
        return GRAPH
    if sources & {"param", "param_block", "scalar", "attr", "barrier"} or any(
            l.sub == ir.WEIGHT for l in leaf_set):
        return EVERY
    return INPUT


def lower(index, root, choice, scenarios=(), heads=None):
    """The plan of one layer tree: IR variant ``root`` with association tree ``choice[p]`` for
    each of its products ``p``. ``heads`` = (H, F): the output is returned as (N, H, F)."""
    plan = Plan(index, choice, scenarios, [], {}, out="", heads=heads)
    names = {}

    def value(n):
        if n in names:
            return names[n]
        if isinstance(n, ir.Leaf):
            if n.source == ("graph",) or n.sub == ir.SELECTION:
                names[n] = None
                return None
            var = leaf_var(n)
            plan.leaves[var] = n
            names[n] = var
            return var
        if isinstance(n, ir.MatMul):
            names[n] = value(choice[n])
            return names[n]
        if isinstance(n, Node):
            return node_step(n)
        if isinstance(n, ir.Add):
            a, b = value(n.a), value(n.b)
            lv = ir_leaves(n)
            return emit(n, "add", (a, b), _when(lv), str(n), signature(n), _inputs(lv))
        if isinstance(n, ir.Cat):
            parts = tuple(value(p) for p in n.parts)
            lv = ir_leaves(n)
            return emit(n, "cat", parts, _when(lv), str(n), signature(n), _inputs(lv))
        if isinstance(n, ir.Apply):
            x = value(n.x)
            lv = ir_leaves(n)
            var = emit(n, "apply", (x,), _when(lv) if n.pure else EVERY, str(n), None,
                       _inputs(lv))
            plan.applies[var] = n.ref
            return var
        if isinstance(n, ir.SparseEdges):
            names[n] = value(n.e)
            return names[n]
        if isinstance(n, ir.EdgeScore):
            a, b = value(n.a), value(n.b)
            return emit(n, "sddmm_add", (a, b), _when(ir_leaves(n)), str(n), signature(n))
        if isinstance(n, ir.EdgeSoftmax):
            e = value(n.e)
            return emit(n, "edge_softmax", (e,), _when(ir_leaves(n)), str(n), signature(n))
        if isinstance(n, ir.EdgeSum) and isinstance(n.m, ir.EdgeMessage):
            return edge_message(n, "edge_message_sum", n.m)
        if isinstance(n, ir.EdgeMessage):
            return edge_message(n, "edge_message", n)
        if isinstance(n, ir.EdgeScale):
            e, w = value(n.e), value(n.w)
            return emit(n, "edge_scale", (e, w), EVERY, str(n))
        if isinstance(n, ir.Store):
            x = value(n.x)
            return emit(n, "store", (x,), EVERY, str(n))
        if isinstance(n, ir.Aggregate):
            x = value(n.x)
            lv = ir_leaves(n)
            # a readout reads the batch's node counts, which change without the structure
            # (``set_batch_num_nodes``): no once-per-graph or once-per-input key holds them
            when = EVERY if n.out_rows is not None else _when(lv)
            return emit(n, n.prim, (x,), when, str(n), signature(n), _inputs(lv))
        raise TypeError(f"cannot lower {n!r}")

    def node_step(n):
        for p in n.parts:
            value(p)
        lv = ir_leaves(n)
        when = _when(lv)
        if n.prim == "sddmm_scale":
            parts = list(n.parts)
            d_dst = parts.pop(0) if parts[0].sub == ir.DIAGONAL else None
            d_src = parts.pop() if parts[-1].sub == ir.DIAGONAL else None
            (adj,) = parts
            args = (names.get(d_dst), edge_values(adj), names.get(d_src))
        elif n.prim in ("spmm", "row_slice"):
            args = (names[n.parts[1]],)
        elif n.prim in ("spmm_weighted", "spmm_heads"):
            args = (edge_values(n.parts[0]), names[n.parts[1]])
        else:
            args = (names[n.parts[0]], names[n.parts[1]])
        sig = signature(n)
        return emit(n, sig[0] if sig else n.prim, args, when, str(n), sig, _inputs(lv))

    def edge_message(n, prim, m):
        """``prim(gi, src, dst, edge, act, slope)`` of the messages ``m`` (``ir.EdgeMessage``):
        the operand read at each side (``None`` where none is), the activation by name and
        the leaky ReLU's slope as constants of the generated code."""
        operands = tuple(value(m.operand(side)) if m.operand(side) is not None else None
                         for side in ("src", "dst", "edge"))
        act, slope = m.act if isinstance(m.act, tuple) else (m.act, 0.0)
        lv = ir_leaves(n)
        return emit(n, prim, operands + (repr(act), repr(float(slope))), _when(lv), str(n),
                    signature(n), _inputs(lv))

    def edge_values(adj):
        """The edge-value argument of a sparse operand: ``None`` for ``A``, else a variable."""
        if isinstance(adj, ir.Leaf):
            return value(adj) if adj.sub == ir.WEIGHTED else None
        return names[adj]

    def emit(n, prim, args, when, key, sig=None, inputs=()):
        var = f"t{len(plan.steps)}"
        plan.steps.append(Step(var, prim, args, when, key, sig, inputs))
        names[n] = var
        return var

    # random draws (dropout) happen in the order of the source, as in the original forward
    for n in sorted(_impure_applies(root, choice), key=lambda a: a.site):
        value(n)
    plan.out = value(root)
    return plan


def _impure_applies(root, choice):
    found, seen = [], set()

    def visit(n):
        if n in seen or isinstance(n, ir.Leaf):
            return
        seen.add(n)
        if isinstance(n, ir.Apply) and not n.pure:
            found.append(n)
        for c in ir.children(n):
            visit(c)
    visit(root)
    return found


def _inputs(leaf_set):
    """The arguments a once-per-input result reads (a weighted degree reads its edge values)."""
    return tuple(sorted({leaf_var(l) for l in leaf_set if l.source[0] in ("arg", "edge")} |
                        {_edge_var(l.source[4]) for l in leaf_set if l.source[0] == "wdegree"}))


def _edge_var(arg):
    return _ident(arg.replace(":", "_"))


# what an impure function (a module call, dropout, anything unknown) adds to the leaves of a
# result: a value that may differ at every call, so nothing computed from it is reused
BARRIER = ir.Leaf("barrier", "1", "1", ir.DENSE, ir.WEIGHT, ("barrier",))


@functools.lru_cache(maxsize=1 << 16)
def ir_leaves(n):
    """The leaves under ``n`` (memoised: the trees of one layer share their subtrees), and
    ``BARRIER`` under an impure ``Apply``."""
    if isinstance(n, ir.Leaf):
        return frozenset((n,))
    parts = n.parts if isinstance(n, Node) else ir.children(n)
    out = frozenset().union(*(ir_leaves(p) for p in parts))
    return out | {BARRIER} if isinstance(n, ir.Apply) and not n.pure else out


def _call(step, impl):
    fn = f"{step.prim}_{impl}"
    graph_first = step.prim not in ("gemm", "head_gemm", "head_dot", "row_scale", "diag_mul")
    args = (["gi"] if graph_first else []) + [a if a is not None else "None" for a in step.args]
    return f"{fn}({', '.join(args)})"


def plan_code(plan, impls, name="plan"):
    """Python source of ``plan`` run with kernel implementation ``impls[i]`` for step ``i``.

    A chain of once-per-input steps becomes one nested function cached under the key of its last
    step: only the value the weights then use is kept, not every intermediate.
    """
    leaf_args = [v for v, l in plan.leaves.items() if l.source[0] not in COMPUTED]
    lines = [f"def {name}_{plan.index}(gi, module, {', '.join(leaf_args)}):",
             f"    # {plan.composition()}",
             f"    # tree: {plan.trees()}"]
    for var, leaf in plan.leaves.items():
        if leaf.source[0] == "degree":
            _, side, p, clamp, shift = leaf.source
            lines.append(f"    {var} = degree_power(gi, {side!r}, {p!r}, {clamp!r}"
                         + (f", {shift!r})" if shift else ")"))
        elif leaf.source[0] == "scalar":
            _, attr, offset, factor = leaf.source
            lines.append(f"    {var} = scalar(module, {attr!r}, {offset!r}, {factor!r})")
        elif leaf.source[0] == "headdiag":
            lines.append(f"    {var} = head_diag(module, {leaf.source[1]!r})")
        elif leaf.source[0] == "wdegree":
            _, side, p, eps, arg = leaf.source
            lines.append(f"    {var} = weighted_degree_power(gi, {_edge_var(arg)}, {side!r}, "
                         f"{p!r}, {eps!r})")
    impl_of = {s.var: impl for s, impl in zip(plan.steps, impls)}
    by_var = {s.var: s for s in plan.steps}
    inner = _inner_input_steps(plan)
    for step in plan.steps:
        if step.var in inner:
            continue
        expr = _step_expr(plan, step, impl_of[step.var])
        if step.when == GRAPH:
            expr = f"once_per_graph(gi, {step.key!r}, lambda: {expr})"
        elif step.when == INPUT:
            chain = [by_var[v] for v in _chain(step, by_var, inner)]
            if chain:
                lines.append(f"    def {step.var}_compute():")
                lines += [f"        {c.var} = {_step_expr(plan, c, impl_of[c.var])}" for c in chain]
                lines.append(f"        return {expr}")
                expr = f"{step.var}_compute"
            else:
                expr = f"lambda: {expr}"
            expr = f"once_per_input(gi, {step.key!r}, ({', '.join(step.inputs)},), {expr})"
        lines.append(f"    {step.var} = {expr}")
    if plan.heads:
        lines.append(f"    return {plan.out}.view({plan.out}.shape[0], {plan.heads[0]}, -1)")
    else:
        lines.append(f"    return {plan.out}")
    return "\n".join(lines) + "\n"


def _step_expr(plan, step, impl):
    """``_expr`` of a step of ``plan``; a scaling by a run-time scalar (GIN's ``1 + eps``) is
    skipped when the scalar is exactly one and needs no gradient (an intermediate only); a GEMM
    that adds a fresh product (``X_2 W_2 + X_1 W_1``) accumulates into it (``_accumulates``)."""
    expr = _expr(step, impl, plan.applies.get(step.var))
    if _accumulates(plan, step):
        expr = expr[:-1] + ", into=True)"
    if skipped_when_one(plan, step):
        expr = f"{step.args[1]} if is_one({step.args[0]}) else {expr}"
    return expr


def skipped_when_one(plan, step):
    """``step`` scales by a scalar leaf and makes an intermediate: the generated code skips it
    when the scalar is exactly one (``is_one``)."""
    leaf = plan.leaves.get(step.args[0]) if step.prim == "row_scale" else None
    return leaf is not None and leaf.source[0] == "scalar" and step.var != plan.out


def _accumulates(plan, step):
    """``step`` is ``gemm(X, W, C)`` with ``C`` the product of an earlier GEMM of this call that
    nothing else reads: adding into ``C`` in place is safe (no one sees it change, a product's
    backward does not keep its output, nothing caches it across calls)."""
    if step.prim != "gemm" or len(step.args) != 3 or step.when != EVERY:
        return False
    c = step.args[2]
    made = [st for st in plan.steps if st.var == c]
    readers = [st for st in plan.steps if c in st.args]
    return (len(made) == 1 and made[0].prim == "gemm" and made[0].when == EVERY
            and len(readers) == 1 and readers[0] is step and c != plan.out)


def unit_scalars(plan, module):
    """The scalar leaves of ``plan`` (GIN's ``1 + eps``) that are exactly one on ``module`` now
    and need no gradient: the generated code skips their row scalings (``_step_expr``), so
    selection prices those as free."""
    out = set()
    if module is None:
        return out
    for var, leaf in plan.leaves.items():
        if leaf.source[0] == "scalar":
            _, attr, offset, factor = leaf.source
            try:
                one = is_one(scalar(module, attr, offset, factor))
            except (AttributeError, TypeError, RuntimeError):
                continue
            if one:
                out.add(var)
    return out


def _expr(step, impl, ref=None):
    if step.prim == "store":
        attr = step.key.split("self.", 1)[1].split("]", 1)[0]
        return f"store(module, {attr!r}, {step.args[0]})"
    if step.prim == "row_slice":
        return f"{step.args[0]}[:gi.num_dst]"
    if step.prim == "edge_scale":
        return f"{step.args[0]} * {step.args[1]}.reshape(-1, 1)"
    if step.prim == "spmm_weighted":
        return f"by_heads(spmm_weighted_{impl}, gi, {step.args[0]}, {step.args[1]})"
    if step.prim == "gat_aggregate":
        return f"gat_heads(gat_aggregate_{impl}, gi, {', '.join(map(str, step.args))})"
    if step.prim == "add":
        return f"{step.args[0]} + {step.args[1]}"
    if step.prim == "cat":
        return f"torch.cat(({', '.join(step.args)}), 1)"
    if step.prim == "alias":
        return step.args[0]
    if step.prim == "apply":
        return _apply_expr(step, ref)
    if step.prim == "gemm_pack":
        return f"gemm_pack({', '.join(a if a is not None else 'None' for a in step.args)})"
    if step.prim == "columns":
        both, first_w = step.args
        return f"{both}.split(({first_w}.shape[1], {both}.shape[1] - {first_w}.shape[1]), 1)"
    if step.prim == "edge_mask":
        return _apply_expr(replace(step, args=(f"edge_ones(gi, {step.args[0]})",)), ref)
    return _call(step, impl)


def _apply_expr(step, ref):
    """The call of an ``Apply``'s function, looked up on the running layer (``module``)."""
    x = step.args[0]
    kind = ref[0]
    if kind == "module":
        path = ref[1]
        if all(p.isidentifier() for p in path.split(".")):
            return f"module.{path}({x})"
        return f"module.get_submodule({path!r})({x})"
    if kind == "attr":
        return f"module.{ref[1]}({x})" if ref[1].isidentifier() else \
            f"getattr(module, {ref[1]!r})({x})"
    if kind == "dropout":
        return f"torch.nn.functional.dropout({x}, {ref[1]!r}, True)"
    if kind == "scale":
        return f"{x} * {ref[1]!r}"
    if kind == "detach":
        return f"{x}.detach()"
    return f"f_{step.var}({x})"


def _inner_input_steps(plan):
    """Once-per-input steps whose every consumer is another once-per-input step."""
    users = {s.var: [] for s in plan.steps}
    for s in plan.steps:
        for a in s.args:
            if a in users:
                users[a].append(s)
    return {s.var for s in plan.steps
            if s.when == INPUT and s.var != plan.out and users[s.var]
            and all(u.when == INPUT for u in users[s.var])}


def _chain(step, by_var, inner):
    """The inner steps ``step`` depends on, in execution order."""
    need = []

    def visit(var):
        if var in inner and var not in need:
            for a in by_var[var].args:
                visit(a)
            need.append(var)
    for a in step.args:
        visit(a)
    return need


def compile_plan(plan, impls):
    """The function of ``plan_code(plan, impls)`` and its source."""
    src = plan_code(plan, impls)
    ns = dict(RUNTIME)
    for step, impl in zip(plan.steps, impls):
        if step.prim not in INLINE and f"{step.prim}_{impl}" not in ns:
            ns[f"{step.prim}_{impl}"] = kernels.get(step.prim, impl)
    ns.update({f"f_{var}": ref[1] for var, ref in plan.applies.items() if ref[0] == "function"})
    exec(diskcache.compiled(src, f"<granii plan {plan.index}>"), ns)
    fn = ns[f"plan_{plan.index}"]
    # whether it may draw random numbers: only the applied modules and functions (dropout) do
    fn.draws = any(step.prim == "apply" for step in plan.steps)
    return fn, src


def default_impls(plan):
    return tuple(step_impls(s)[0] for s in plan.steps)


def fuse_gemm_add(plan):
    """Peephole pass: ``t = gemm(x, w)`` whose only use is ``s = t + c`` becomes
    ``s = gemm(x, w, c)`` (``torch.addmm(c, x, w)``: the sum is written while the product is,
    one pass over the output instead of three). ``c`` is a bias row or another term of a sum of
    products (GIN's and TAGConv's). Both steps must run every call; the fused step takes the
    add's place, where its operands all exist. When ``t`` already accumulates a chain of such
    products and ``c`` is a parameter (a bias), ``c`` goes to the first product of the chain and
    the add becomes an alias. Returns ``plan``."""
    uses = {}
    for st in plan.steps:
        for a in st.args:
            uses[a] = uses.get(a, 0) + 1
    uses[plan.out] = uses.get(plan.out, 0) + 1

    def single_gemm(var):
        g = by_var.get(var)
        ok = g is not None and g.prim == "gemm" and g.when == EVERY and uses.get(var) == 1
        return g if ok else None

    by_var = {st.var: st for st in plan.steps}
    fused, steps = set(), []
    for st in plan.steps:
        if st.prim == "add" and st.when == EVERY:
            for mine, other in ((st.args[1], st.args[0]), (st.args[0], st.args[1])):
                g = single_gemm(mine)
                if g is None or mine in fused:
                    continue
                if len(g.args) == 2:
                    fused.add(mine)
                    st = replace(g, var=st.var, args=g.args + (other,))
                    break
                first = g
                while len(first.args) == 3 and single_gemm(first.args[2]) is not None:
                    first = by_var[first.args[2]]
                if len(first.args) == 2 and other in plan.leaves:
                    i = steps.index(first)
                    steps[i] = by_var[first.var] = replace(first, args=first.args + (other,))
                    st = Step(st.var, "alias", (mine,), EVERY, st.key)
                    break
        by_var[st.var] = st
        steps.append(st)
    plan.steps = [st for st in steps if st.var not in fused]
    return plan


def step_impls(step):
    """The kernel implementations that can run ``step``."""
    if step.prim in kernels.REGISTRY:
        return kernels.implementations(step.prim)
    return ("torch",) if step.prim == "diag_mul" else ("inline",)


def signatures(plan):
    """The priced calls of a plan: ``(primitive, once_per_graph, symbolic sizes)`` per step."""
    return [s.sig for s in plan.steps if s.sig is not None]


# -- runtime helpers the generated code calls ------------------------------------------------------
def degree_power(gi, side, power, clamp, shift=0.0):
    """``(max(deg + shift, clamp))^power`` of the in- (destination) or out- (source) degrees."""
    def make():
        d = gi.in_degrees() if side == "in" else gi.out_degrees()
        if shift:
            d = d + shift
        if clamp is not None:
            d = d.clamp(min=clamp)
        return d if power == 1 else torch.pow(d, power)
    return gi.memo(("degree", side, power, clamp, shift), make)


def weighted_degree_power(gi, w, side, power, eps):
    """``(d + eps)^power`` of the weighted degrees: the sums of the edge values ``w`` into each
    destination (``"in"``) or out of each source (``"out"``), as DGL's ``EdgeWeightNorm("both")``
    computes them, with its errors for weights that are not one scalar per edge or not positive.
    A node without edges on that side (``d + eps = 0``) gets 0, not DGL's infinity: its value
    scales no edge, and 0 keeps a row scaling of the empty row (and its gradient) at 0."""
    from dgl import DGLError
    if w.dim() > 1:
        raise DGLError("Currently the normalization is only defined on scalar edge weight. "
                       "Please customize the normalization for your high-dimensional weights.")
    if bool((w <= 0).any()):
        raise DGLError('Non-positive edge weight detected with `norm="both"`. '
                       "This leads to square root of zero or negative values.")
    src, dst = gi.edges()
    ids, n = (dst, gi.num_dst) if side == "in" else (src, gi.num_src)
    d = torch.zeros(n, dtype=w.dtype, device=w.device).index_add_(
        0, ids, w.detach() if not w.requires_grad else w) + eps
    out = torch.pow(d, power)
    return torch.where(d == 0, torch.zeros_like(out), out)


def once_per_graph(gi, key, compute):
    """``compute()`` once per graph: its value depends on the graph alone."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return gi.memo(("once", key), compute)
    return gi.memo(("once", key), compute)


REUSE = {"inputs": True}     # set per call by the dispatcher (``granii(..., reuse_inputs=...)``)


def once_per_input(gi, key, tensors, compute):
    """``compute()`` once per (graph, input tensors) while the inputs need no gradient.

    The entry remembers each input by weak reference, storage address and version counter:
    another tensor, or the same one changed in place, computes again. Inputs that require grad,
    tensors made under ``torch.inference_mode`` (no version counter) and calls with reuse turned
    off always compute; so does a call under ``torch.inference_mode`` (its results could not be
    used by a later call that needs gradients).
    """
    if not REUSE["inputs"] or torch.is_inference_mode_enabled() or (
            torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return compute()
    ident = [(t.data_ptr(), t._version) for t in tensors]
    entry = gi.cache.get(("input", key))
    if entry is not None:
        refs, idents, value = entry
        if idents == ident and all(r() is t for r, t in zip(refs, tensors)):
            return value
    value = compute()
    gi.cache[("input", key)] = ([weakref.ref(t) for t in tensors], ident, value)
    return value


def head_diag(module, attr):
    """``blockdiag(a_1, ..., a_H)`` of an attention parameter of shape (1, H, F): (H F) x H, as
    one broadcast product. Its blocks ride along as the attribute ``heads`` (H, F), which
    ``head_dot`` reads instead of summing them back out of the matrix: a few operator calls
    fewer on every call, which is what a GAT layer on a small graph spends its time on."""
    a = getattr(module, attr)
    heads = a.shape[-2]
    blocks = a.reshape(heads, -1)
    d = (blocks.unsqueeze(-1) * _eye(heads, a.dtype, a.device).unsqueeze(1)).reshape(-1, heads)
    d.heads = blocks
    return d


@functools.lru_cache(maxsize=None)
def _eye(n, dtype, device):
    return torch.eye(n, dtype=dtype, device=device)


def by_heads(kernel, gi, w, x):
    """A weighted SpMM with ``w`` of shape (E,) or (E, H) on ``x`` of shape (n, H F) or (n, k):
    per head ``h``, ``Y_h = A[w_h] X_h`` (with one head, ``X`` is used whole)."""
    if w.dim() == 1 or w.shape[1] == 1:
        return kernel(gi, w.reshape(-1), x)
    heads = w.shape[1]
    return kernel(gi, w, x.view(x.shape[0], heads, -1)).reshape(-1, x.shape[1])


def gemm_pack(w1, w2, b1, b2):
    """``([W_1 W_2], [b_1 b_2])`` for one GEMM in place of two on the same operand (a missing
    bias is zeros; ``None`` when both are)."""
    w = torch.cat((w1, w2), 1)
    if b1 is None and b2 is None:
        return w, None
    b1 = w1.new_zeros(w1.shape[1]) if b1 is None else b1.reshape(-1)
    b2 = w2.new_zeros(w2.shape[1]) if b2 is None else b2.reshape(-1)
    return w, torch.cat((b1, b2))


def edge_ones(gi, el):
    """Ones with one value per edge and head (heads: the columns of the scores ``el``): what an
    attention dropout module is applied to, to draw its mask."""
    return torch.ones(gi.num_edges, el.shape[-1] if el.dim() > 1 else 1, dtype=el.dtype,
                      device=el.device)


def gat_heads(kernel, gi, el, er, x, slope, w, bias=None):
    """GAT's aggregation with ``x`` of shape (n, H F) and scores ``el``, ``er`` of shape (n, H)
    [and a bias row of H F added by the kernel]: its (n_dst, H, F) output as (n_dst, H F)."""
    heads = el.shape[-1] if el.dim() > 1 else 1
    out = kernel(gi, el, er, x.view(x.shape[0], heads, -1), slope, w, bias)
    return out.reshape(out.shape[0], -1)


def store(module, attr, value):
    """``module.<attr> = value``; returns ``value``."""
    setattr(module, attr, value)
    return value


def diag_mul_torch(a, b):
    """``diag(a) diag(b) = diag(a * b)``."""
    return a * b


RUNTIME = {"torch": torch, "degree_power": degree_power, "once_per_graph": once_per_graph,
           "weighted_degree_power": weighted_degree_power,
           "once_per_input": once_per_input, "diag_mul_torch": diag_mul_torch, "store": store,
           "scalar": scalar, "is_one": is_one, "head_diag": head_diag, "by_heads": by_heads,
           "gat_heads": gat_heads, "edge_ones": edge_ones, "gemm_pack": gemm_pack}


def all_steps(choice):
    """Distinct primitive calls of a layer tree (CSE across its products)."""
    seen = {}
    for tree in choice.values():
        for s in tree_steps(tree):
            seen.setdefault(s, None)
    return list(seen)
