"""Association trees: every legal way to parenthesise each product of the IR (paper, Algorithm 1).

A product ``M_1 M_2 ... M_n`` is re-associated by repeatedly merging adjacent operands into an
intermediate result. Which merges are legal, and which primitive computes them, is decided by rules
on the operands' attributes (``merge_rule``):

    diagonal . diagonal            -> diag_mul     (product of two degree vectors)
    diagonal . sparse [. diagonal] -> sddmm_scale  (edge values d_v w_e d_u: an SDDMM with rank 1)
    sparse . diagonal              -> sddmm_scale
    diagonal . dense               -> row_scale    (row-broadcast)
    sparse (unweighted) . dense    -> spmm
    sparse (weighted) . dense      -> spmm_weighted
    dense . dense                  -> gemm
    sparse (H heads) . dense X     -> spmm_heads   (X not split in heads: [A_1 X | .. | A_H X])
    headed . dense W               -> head_gemm    (block h times W's block of head h)
    anything else (sparse . sparse, dense . sparse) has no primitive: the merge is not a candidate.

With H attention heads, ``A_alpha X W`` means ``[A_1 X W_1 | .. | A_H X W_H]`` (``W_h``: the
columns of head h). ``A_alpha (X W)`` is one weighted SpMM over the heads' blocks; ``(A_alpha X) W``
aggregates X once per head and then multiplies each head's sum by its own block: fewer
multiply-adds where X has fewer columns than the heads' total, or where the result has fewer
rows than X (a sampled block: W then runs on the destination rows only).

Algorithm 1 explores merges depth-first and collects each finished tree; the same tree is reached
through many merge orders. ``association_trees`` enumerates the same forest directly (each tree once)
by splitting every interval of the product in every place. A tree is canonical: nested SDDMMs are
flattened, so ``(D A) D``, ``D (A D)`` and the three-operand ``D A D`` are one tree with one SDDMM.

The layer's forest (``enumerate_layer``): every form of the layer (stacked hops split by weight
blocks, products distributed over sums, common factors taken out of sums) with the trees of its
products, found once per sub-expression of the IR (memoised by structure) and pruned per
sub-expression, so its size and the time to find it are polynomial in the layer's size: linear
in the hops of APPNP and SGC, quadratic for TAGConv (see ``enumerate_layer``). A budget of CPU
time (``budget_seconds``) bounds it all the same; when it is spent the layer is associated as
written.
"""
import itertools
import math
import time
from dataclasses import dataclass
from functools import lru_cache

from . import ir


@ir.cached_hash
@dataclass(frozen=True)
class Node:
    """An intermediate result: ``prim`` applied to ``parts`` (leaves or other nodes)."""
    prim: str
    parts: tuple
    rows: str
    cols: str
    kind: str
    sub: str

    @property
    def graph_only(self):
        return all(p.graph_only for p in self.parts)

    def __str__(self):
        sep = " . "
        return f"{self.prim}[{sep.join(str(p) for p in self.parts)}]"


def merge_rule(a, b):
    """``(primitive, kind, sub)`` of the product ``a . b``, or ``None`` if no primitive computes it."""
    if a.sub == ir.HEADED:
        wide = a.parts[0].head_cols
        ok = b.kind == ir.DENSE and b.sub == ir.WEIGHT and b.cols == wide
        return ("head_gemm", ir.DENSE, ir.DATA) if ok else None
    if b.sub == ir.HEADED:
        return None
    if a.sub == ir.SELECTION:
        return ("row_slice", b.kind, b.sub) if b.kind == ir.DENSE else None
    if a.sub == ir.SCALAR:
        return ("row_scale", ir.DENSE, b.sub) if b.kind == ir.DENSE else None
    if b.sub in (ir.SCALAR, ir.SELECTION):
        return None
    if getattr(a, "heads", 1) > 1 and b.cols != a.head_cols:
        # features not split into the heads: each head sums them with its own edge values
        return ("spmm_heads", ir.DENSE, ir.HEADED) if b.kind == ir.DENSE else None
    da, db = a.sub == ir.DIAGONAL, b.sub == ir.DIAGONAL
    if da and db:
        return "diag_mul", ir.SPARSE, ir.DIAGONAL
    if a.kind == ir.SPARSE and b.kind == ir.SPARSE and (da or db):
        return "sddmm_scale", ir.SPARSE, ir.WEIGHTED
    if da and b.kind == ir.DENSE:
        return "row_scale", ir.DENSE, b.sub
    if a.kind == ir.SPARSE and b.kind == ir.DENSE:
        prim = "spmm" if a.sub == ir.UNWEIGHTED else "spmm_weighted"
        return prim, ir.DENSE, ir.DATA
    if a.kind == ir.DENSE and b.kind == ir.DENSE:
        sub = ir.WEIGHT if a.sub == ir.WEIGHT and b.sub == ir.WEIGHT else ir.DATA
        return "gemm", ir.DENSE, sub
    return None


def merge(a, b):
    """The node for ``a . b``, or ``None`` if illegal.

    Nested SDDMMs flatten while the result still has the form ``[D] A [D]`` (one diagonal on each
    side at most), so the same scaling reached in different orders is one tree.
    """
    rule = merge_rule(a, b)
    if rule is None:
        return None
    prim, kind, sub = rule
    parts = (a, b)
    if prim == "sddmm_scale":
        flat = []
        for x in (a, b):
            nested = isinstance(x, Node) and x.prim == "sddmm_scale"
            flat.extend(x.parts if nested else (x,))
        if _is_scaling(flat):
            parts = tuple(flat)
    return Node(prim, tuple(parts), a.rows, b.cols, kind, sub)


def _is_scaling(parts):
    """``parts`` is ``[D] S [D]``: at most one diagonal each side of one sparse matrix."""
    inner = [p for p in parts if p.sub != ir.DIAGONAL]
    if len(inner) != 1:
        return False
    i = parts.index(inner[0])
    return i <= 1 and len(parts) - i - 1 <= 1


INTERVAL_LIMIT = 24


@lru_cache(maxsize=1024)
def association_trees(factors):
    """All association trees of the product of ``factors`` (a tuple of IR nodes), each once.

    Long products (TAGConv with several hops) have thousands of trees: when one interval of the
    product has more than ``INTERVAL_LIMIT`` sub-trees, those dominated in both embedding-size
    scenarios by another sub-tree of the same interval are dropped early. The same rules as the
    final pruning, applied to a sub-product: a tree containing a dominated sub-tree is dominated.
    """
    factors = tuple(factors)

    @lru_cache(maxsize=None)
    def trees(i, j):
        if i == j:
            return (factors[i],)
        found = {}
        for k in range(i, j):
            for left, right in itertools.product(trees(i, k), trees(k + 1, j)):
                node = merge(left, right)
                if node is not None:
                    found.setdefault(node, None)
        found = list(found)
        if len(found) > INTERVAL_LIMIT:
            found = _drop_dominated(found)
        return tuple(found)

    return trees(0, len(factors) - 1)


def steps(tree):
    """The primitive calls of ``tree`` in execution order, each distinct sub-result once (CSE)."""
    out = {}

    def visit(n):
        if isinstance(n, Node):
            for p in n.parts:
                visit(p)
            out.setdefault(n, None)
    visit(tree)
    return list(out)


def products(root):
    """The product nodes of an IR tree that the enumerator re-associates (outermost first)."""
    found = []

    def visit(n):
        if isinstance(n, ir.MatMul):
            found.append(n)
        for c in ir.children(n):
            if not isinstance(n, ir.MatMul):
                visit(c)
            elif not isinstance(c, ir.Leaf):
                visit(c)
    visit(root)
    return found


# -- the layer's forest: forms and trees of every sub-expression, once each ---------------------
PRUNE_AT = 8          # a sub-expression with more candidates keeps only the undominated ones
FRONTIER = 8          # ... and at most this many of those (fewest calls at an embedding width first)
BUDGET_S = 0.5        # seconds one layer's enumeration, pruning and lowering may take


def clock():
    """The clock budgets are counted on: CPU seconds of the calling thread. Enumeration is
    single-threaded Python, so this is its wall time on an idle machine, and on a loaded one
    (other processes on the cores) the decision stays the same instead of shrinking."""
    return time.thread_time()


def budget_seconds():
    """The decision budget of one layer: ``GRANII_DECISION_BUDGET`` (seconds) if set, else
    ``BUDGET_S``; ``0`` or less means no budget."""
    import os
    text = os.environ.get("GRANII_DECISION_BUDGET", "").strip()
    try:
        return float(text) if text else BUDGET_S
    except ValueError:
        return BUDGET_S


@dataclass
class Forest:
    """What ``enumerate_layer`` found.

    ``forest``: ``[(ir_root, {MatMul: tree})]``, the layer trees to prune and lower;
    ``n_trees``: association trees enumerated (a product's tree counts once per distinct form of
    that product); ``n_forms``: distinct sub-expressions enumerated; ``n_candidates``: (form,
    trees) candidates made over all sub-expressions, before any was dropped; ``budget_hit``:
    the budget ran out (``forest`` then holds what was found, always the layer as written)."""
    forest: list
    n_trees: int
    n_forms: int
    n_candidates: int
    budget_hit: bool = False
    seconds: float = 0.0


class _OutOfTime(Exception):
    pass


@dataclass(frozen=True)
class _Cand:
    """A way to compute one sub-expression: an equal IR ``form`` and a tree for each product in
    it (``choice``: ``((MatMul, tree), ...)``)."""
    form: object
    choice: tuple
    hops: tuple = ()     # ((step, shape), ...): the tree shape chosen for each repeated step


def layer_forest(root, deadline=None, exhaustive=False):
    """``(forest, n_trees)`` of ``enumerate_layer`` (without a budget unless ``deadline``)."""
    found = enumerate_layer(root, deadline=deadline, exhaustive=exhaustive)
    return found.forest, found.n_trees


def enumerate_layer(root, deadline=None, exhaustive=False):
    """Every useful form of the layer (split, distributed, factored) with the association trees
    of its products, as a memoised dynamic programme over the IR's sub-expressions.

    Each sub-expression (a node of the IR, compared by structure, so a node shared by two parents
    is one entry) gets its list of candidates ``(form, trees)`` once:

      leaf       itself;
      product    one candidate of each inner operand, flattened (a factored operand ``P (X+Y)``
                 joins the product), times each association tree of the flat product
                 (``product_trees``), and, for a sum operand with factors to its right,
                 ``L (X + Y) R = L X R + L Y R`` (one level: its terms are not distributed
                 again, see below), and ``cat(X_i) W = sum_i X_i W_i`` for a stacked operand;
      sum        one candidate of each side, and ``P X + P Y = P (X + Y)`` for the longest common
                 left factor ``P`` of two product forms (Horner's rule, applied level by level:
                 TAGConv's ``H W_0 + N (H W_1 + N (H W_2 + ...))``);
      otherwise  one candidate of each operand.

    Which rewrites are tried is decided by counting the work they can save:

      * ``L (X + Y) = L X + L Y`` (no factor right of the sum) runs every call of ``L`` twice at
        the same widths: never better, not tried. With factors ``R`` on the right it can move a
        width-changing product (``W``) inside, ahead of an aggregation (GIN's ``A (H W)``); its
        terms are not distributed further, since expanding a nested chain ``c_1 P (c_2 P (...)
        + Y) R`` into its polynomial doubles the calls per level and never wins against the
        nested form, whose calls grow linearly.
      * of the factorings of ``P X + P Y`` only the longest common prefix is tried: a shorter
        cut leaves a common factor in both terms, which flattens to the same product anyway.

    A repeated step is associated once (``_step_of``, ``product_trees``): the step ``D A D []``
    gets one tree shape for every hop of a flat product and every level of a nested chain, and
    the adjacency one normalisation route for the whole layer (``_route``: edge values scaled
    once, or row scalings around the SpMM). Each hop costs what its shape costs at its width
    whatever the other hops do, and what one hop makes once (the scaled edge values) serves
    every hop, so a mix of shapes is never cheaper than the best shape used everywhere; without
    this rule APPNP's k levels would keep k + 1 incomparable mixes each.

    When a sub-expression has more than ``PRUNE_AT`` candidates, those dominated in both
    size scenarios by another (``prune``'s rule, on their distinct calls) are dropped, and at most
    ``FRONTIER`` stay (the fewest calls at an embedding width first). So every sub-expression
    keeps O(1) candidates, each parent combines O(1) candidates per operand, and a product of
    ``n`` factors has O(n^3) interval merges (``association_trees``) or, when it repeats a step
    (``product_trees``), O(n) trees: the work is polynomial in the size of the IR. A k-hop
    propagation (APPNP, SGC, TAGConv) is O(k) sub-expressions with O(k) calls each, O(k^2) in all.
    ``exhaustive`` keeps every candidate (for tests measuring what pruning removed).

    ``deadline`` (a ``clock()`` value): when passed, the forms enumerated so far
    are dropped and the layer is associated as written (each product in every way, or, when
    even that runs out of time, right to left as the source computes it); ``budget_hit`` is set.
    """
    start = clock()
    full = _Forms(deadline, exhaustive, rewrite=True)
    try:
        cands = full.of(root)
        hit = False
    except _OutOfTime:
        hit, cands = True, None
    stats = full
    if cands is None:
        written = _Forms(None if deadline is None else deadline + 0.25 * (deadline - start),
                         exhaustive, rewrite=False)
        try:
            cands = written.of(root)
            stats = written
        except _OutOfTime:
            cands = (_as_written(root),)
    forest = [(c.form, _reachable(c.form, dict(c.choice))) for c in cands]
    return Forest(forest, stats.n_trees, len(stats.memo), stats.n_candidates, hit,
                  clock() - start)


def _as_written(root):
    """The layer as its source computes it: each product right to left (``X W`` first, then each
    factor on the left of it), where each merge has a primitive; any tree otherwise."""
    choice = {}
    for p in dict.fromkeys(products(root)):
        x = p.args[-1]
        for f in reversed(p.args[:-1]):
            x = merge(f, x) if x is not None else None
        choice[p] = x if x is not None else association_trees(p.args)[0]
    return _Cand(root, tuple(choice.items()))


def _reachable(form, choice):
    """``choice`` restricted to the products of ``form`` (a factored operand merged into a
    larger product leaves its own tree behind)."""
    return {p: choice[p] for p in dict.fromkeys(products(form))}


class _Forms:
    """The memo of ``enumerate_layer``: sub-expression -> its candidates."""

    def __init__(self, deadline, exhaustive, rewrite):
        self.deadline = deadline
        self.exhaustive = exhaustive
        self.rewrite = rewrite
        self.memo = {}
        self.n_trees = 0
        self.n_candidates = 0

    def tick(self):
        if self.deadline is not None and clock() > self.deadline:
            raise _OutOfTime()

    def of(self, node, distribute=True):
        key = (node, distribute)
        found = self.memo.get(key)
        if found is not None:
            return found
        self.tick()
        if isinstance(node, ir.Leaf):
            cands = [_Cand(node, ())]
        elif isinstance(node, ir.MatMul):
            cands = self.product(node, distribute)
        elif isinstance(node, ir.Add):
            cands = self.sum(node)
        else:
            cands = self.combined(node, ir.children(node),
                                  lambda forms: ir.with_children(node, list(forms)))
        self.n_candidates += len(cands)
        found = self.frontier(cands)
        self.memo[key] = found
        return found

    def combined(self, node, operands, build, distribute=True):
        """One candidate of each operand in every way, each built into a form by
        ``build(forms)``. Operands are added one at a time and the partial choices pruned
        (``frontier``) after each; a pair whose candidates associate a repeated step
        differently (``_agree``) is not made while a pair that agrees exists."""
        partial = [_Cand((), (), ())]
        for x in operands:
            options = self.of(x, distribute)
            both = [(p, c) for p in partial for c in options if _agree(p.hops, c.hops)]
            if not both:        # no pair chose alike: keep every pair (never an empty list)
                both = [(p, c) for p in partial for c in options]
            partial = [_Cand(p.form + (c.form,), p.choice + c.choice, _join(p.hops, c.hops))
                       for p, c in both]
            partial = self.frontier(partial, as_tuple=True)
        return [_Cand(build(p.form), p.choice, p.hops) for p in partial]

    def product(self, node, distribute):
        out = []
        for cand in self.combined(node, node.args, lambda forms: ir.matmul(*forms)):
            flat = cand.form
            if not isinstance(flat, ir.MatMul):
                out.append(cand)
                continue
            step = _step_of(flat)
            chosen = dict(cand.hops)
            for t, hop in self.trees(flat.args):
                if hop is None and step is not None:
                    hop = (step, _shape(t))
                if hop is not None and chosen.get(hop[0], hop[1]) != hop[1]:
                    continue            # this step is associated otherwise elsewhere
                hops = cand.hops if hop is None or hop[0] in chosen else cand.hops + (hop,)
                route = _route(steps(t))
                if route is not None and chosen.get(_ROUTE, route) != route:
                    continue
                if route is not None and _ROUTE not in chosen:
                    hops += ((_ROUTE, route),)
                out.append(_Cand(flat, cand.choice + ((flat, t),), hops))
            self.tick()
        if not self.rewrite:
            return out
        args = node.args
        for i, a in enumerate(args):
            if distribute and i < len(args) - 1 and isinstance(a, ir.Add) and \
                    a.a.rows != "1" and a.b.rows != "1":
                left, right = args[:i], args[i + 1:]
                terms = (ir.matmul(*left, a.a, *right), ir.matmul(*left, a.b, *right))
                out += self.combined(None, terms, lambda forms: ir.Add(*forms), distribute=False)
        split = ir.split_cat(node)
        if split is not None:
            out += self.of(split)
        return out

    def sum(self, node):
        out = self.combined(node, (node.a, node.b), lambda forms: ir.Add(*forms))
        if not self.rewrite:
            return out
        pairs = dict.fromkeys((c.form.a, c.form.b) for c in out)
        for a, b in pairs:
            factored = ir.factor_common_prefix(a, b)
            if factored is not None:
                out += self.of(factored)
        return out

    def trees(self, factors):
        found = _trees_and_steps(tuple(factors))
        self.n_trees += len(found)
        return found

    def frontier(self, cands, as_tuple=False):
        """``cands`` without duplicates; above ``PRUNE_AT``, only the undominated ones, at most
        ``FRONTIER``."""
        cands = list(dict.fromkeys(cands))
        if self.exhaustive or len(cands) <= PRUNE_AT:
            return cands
        from .prune import SCENARIOS, Calls, signature, survivors
        calls, mixed = [], []
        for c in cands:
            forms = c.form if as_tuple else (c.form,)
            seen = _computed(forms, dict(c.choice))
            calls.append(Calls.of(s for s in map(signature, seen) if s is not None))
            mixed.append(_mixed(seen))
        self.tick()
        if not all(mixed):
            cands = [c for c, m in zip(cands, mixed) if not m]
            calls = [c for c, m in zip(calls, mixed) if not m]
        first = {}
        for i in sorted(range(len(cands)), key=lambda i: (len(calls[i].sigs), i)):
            first.setdefault(tuple(sorted(calls[i].sigs)), i)
        uniq = sorted(first.values())
        sub = [calls[i] for i in uniq]
        keep = set().union(*(survivors(sub, sc) for sc in SCENARIOS))
        kept = [uniq[j] for j in sorted(keep)]
        if len(kept) > FRONTIER:
            kept = sorted(kept, key=lambda i: (_wide(calls[i]), len(calls[i].sigs), i))[:FRONTIER]
        self.tick()
        return [cands[i] for i in sorted(kept)]


def _agree(a, b):
    """Two candidates chose the same shape for every repeated step both use."""
    if not a or not b:
        return True
    have = dict(a)
    return all(have.get(k, v) == v for k, v in b)


def _join(a, b):
    """The repeated steps' shapes of two operands together (the first one's where both chose)."""
    if not b:
        return a
    have = dict(a)
    return a + tuple((k, v) for k, v in b if k not in have)


def _step_of(prod):
    """The step a product applies to a computed operand: its factors with each operand that is
    not a leaf replaced by that operand's shape, or ``None`` when every factor is a leaf.

    APPNP's hop ``c (D A D h_i) + a h_0`` applies the step ``D A D []`` to each level's result:
    a tree shape chosen for the step at one level is used at every level (``_Forms.product``).
    Each hop costs the same at a width whatever the others do, and a once-per-graph value one
    hop computes (``D A D`` as edge values) serves them all, so mixed choices are never better,
    and the candidates stay O(trees of one step) instead of growing with the number of levels."""
    if all(isinstance(a, ir.Leaf) for a in prod.args) or not _propagates(prod.args):
        return None
    return tuple(a if isinstance(a, ir.Leaf) else _HOLE_KEY for a in prod.args)


_HOLE_KEY = ("[]",)


def _propagates(factors):
    """A product with a sparse leaf of the graph (``A``, a degree power): a propagation step."""
    return any(isinstance(f, ir.Leaf) and f.kind == ir.SPARSE and f.sub != ir.SCALAR
               for f in factors)


def _shape(tree):
    """``tree`` with its computed (non-leaf) operands forgotten: how it associates the step."""
    if isinstance(tree, Node):
        return (tree.prim,) + tuple(_shape(p) for p in tree.parts)
    return tree if isinstance(tree, ir.Leaf) else _HOLE_KEY


def _wide(calls):
    """Calls at an embedding width (what grows with ``k``): the work a candidate is ranked by
    when more than ``FRONTIER`` are undominated."""
    return sum(1 for _, _, dims in calls.needed if any(d.startswith("k") for d in dims))


def tree_calls(root, choice, many=False):
    """The signatures of the priced calls ``plan.lower(i, root, choice)`` makes, each distinct
    sub-result once, without lowering: what pruning compares. ``many``: ``root`` is a tuple of
    roots computed together (their shared sub-results once)."""
    from .prune import signature
    seen = _computed(root if many else (root,), choice)
    return [s for s in map(signature, seen) if s is not None]


_ROUTE = ("normalisation",)


def _route(computed):
    """``"edges"`` when the adjacency is used as degree-scaled edge values (``sddmm_scale``),
    ``"rows"`` when as the plain pattern between row scalings (``spmm``), ``"both"``, or
    ``None`` (no adjacency of the graph used)."""
    plain = weighted = False
    for n in computed:
        if isinstance(n, Node):
            if n.prim == "spmm" and isinstance(n.parts[0], ir.Leaf):
                plain = True
            elif n.prim == "sddmm_scale" and any(
                    isinstance(p, ir.Leaf) and p.source == ("graph",) for p in n.parts):
                weighted = True
    if plain and weighted:
        return "both"
    return "rows" if plain else "edges" if weighted else None


def _mixed(computed):
    """The same adjacency is used both as edge values scaled by degrees (``sddmm_scale``, once
    per graph, then weighted SpMMs) and as the plain pattern between row scalings (``spmm``).

    Choosing the normalisation once per layer: each hop costs what its route costs at its
    width, the edge values are made once for every hop that uses them, so a candidate using
    both routes costs at least what the cheaper route costs used everywhere (both also fuse to
    the same ``spmm_norm``). ``frontier`` drops such candidates when a candidate using one
    route remains."""
    return _route(computed) == "both"


def _computed(roots, choice):
    """The distinct computed sub-results (``Node``s and IR inner nodes) of ``roots`` under
    ``choice``, in the order ``plan.lower`` visits them."""
    seen = {}

    def visit(n):
        if isinstance(n, ir.MatMul):
            visit(choice[n])
        elif not isinstance(n, ir.Leaf) and n not in seen:
            seen[n] = None
            for c in (n.parts if isinstance(n, Node) else ir.children(n)):
                visit(c)
    for r in roots:
        visit(r)
    return seen


def product_trees(factors):
    """The association trees of ``_trees_and_steps``."""
    return tuple(t for t, _ in _trees_and_steps(tuple(factors)))


@lru_cache(maxsize=1024)
def _trees_and_steps(factors):
    """``(tree, (step, shape) or None)``: the association trees of the product of ``factors``
    that can win, each with the shape it gives a repeated step.

    A product without a repeated step: every tree (``association_trees``). A k-hop
    propagation ``L B^r Y``, with a step ``B`` of sparse factors (``D A D``, ``A``) repeated
    ``r >= 2`` times: Each hop costs the same whatever the others do, and a once-per-graph
    value (``D A D`` as edge values) computed for one hop serves all, so a tree whose hops
    differ is never better than the one applying the cheapest hop every time: the step's form
    is chosen once, among the trees of ``B . X`` (``X`` a dense operand), and applied ``r``
    times. ``Y`` (what the hops run on, e.g. ``H W``) is associated first, or only its first
    factor, the rest after the hops (``(B^r H) W``: hops at the input width); ``L`` after.
    That is O(trees(B X) x trees(Y)) trees: linear in ``r``. Long products without a repeated
    step are associated by ``association_trees`` (O(n^3) merges of pruned intervals).
    """
    plain = lambda: tuple((t, None) for t in association_trees(factors))
    run = _repeated_step(factors)
    if run is None:
        return plain()
    s, width, reps = run
    prefix, step = factors[:s], factors[s:s + width]
    rest = factors[s + width * reps:]
    out = {}
    heads = [(association_trees(rest) if len(rest) > 1 else rest, ())]
    if len(rest) > 1:
        heads.append(((rest[0],), rest[1:]))
    for ys, after in heads:
        for y in ys:
            hole = _Hole(y.rows, y.cols, y.kind, y.sub)
            for pattern in association_trees(step + (hole,)):
                x = y
                for _ in range(reps):
                    x = _fill(pattern, hole, x)
                    if x is None:
                        break
                if x is None:
                    continue
                tail = (x,) + after
                hop = (step + (_HOLE_KEY,), _shape(pattern))
                for t in (association_trees(prefix + tail) if len(prefix + tail) > 1 else tail):
                    out.setdefault(t, hop)
    return tuple(out.items()) if out else plain()


@ir.cached_hash
@dataclass(frozen=True)
class _Hole:
    """The operand a repeated step is applied to, while its trees are enumerated."""
    rows: str
    cols: str
    kind: str
    sub: str
    graph_only = False


def _fill(tree, hole, value):
    """``tree`` with ``hole`` replaced by ``value`` (merged again, so primitives follow the
    value's attributes), or ``None`` when a merge has no primitive."""
    if tree == hole:
        return value
    if not isinstance(tree, Node) or not _contains(tree, hole):
        return tree
    parts = [_fill(p, hole, value) for p in tree.parts]
    if any(p is None for p in parts) or len(parts) != 2:
        return None
    return merge(*parts)


def _contains(tree, hole):
    return tree == hole or (isinstance(tree, Node) and any(_contains(p, hole) for p in tree.parts))


def _repeated_step(factors):
    """``(start, width, repeats)`` of the longest run of one step of non-dense factors repeated
    consecutively (at least twice), most factors covered first; ``None`` if there is none."""
    n, best = len(factors), None
    for width in range(1, n // 2 + 1):
        for s in range(0, n - 2 * width + 1):
            step = factors[s:s + width]
            if any(f.kind == ir.DENSE for f in step):
                continue
            reps = 1
            while factors[s + reps * width:s + (reps + 1) * width] == step:
                reps += 1
            if reps >= 2 and (best is None or reps * width > best[1] * best[2]):
                best = (s, width, reps)
    return best


def binary_orders(root):
    """How many ways there are to parenthesise every product of the layer as written: the
    product over its products of Catalan(n - 1) for n factors (the size of the search space of
    Algorithm 1; ``enumerate_layer`` visits polynomially many of them). ``explain`` reports it
    beside the trees enumerated."""
    return math.prod(math.comb(2 * (len(p.args) - 1), len(p.args) - 1) // len(p.args)
                     for p in dict.fromkeys(products(root)))


class TooManyTrees(Exception):
    """The layer's forest is too large to lower at run time; the original forward runs. (No
    longer raised: the enumeration is polynomial and bounded by a budget; kept for callers.)"""


def _drop_dominated(trees):
    keep = _undominated([steps(t) for t in trees])
    return [t for i, t in enumerate(trees) if i in keep]


def _undominated(call_lists):
    """Indices of the lists of calls (``Node``s) not dominated in both size scenarios."""
    from .prune import SCENARIOS, Calls, signature, survivors
    calls = [Calls.of(signature(n) for n in c) for c in call_lists]
    return set().union(*(survivors(calls, sc) for sc in SCENARIOS))
