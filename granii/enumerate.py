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
"""
import itertools
import math
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


TREE_LIMIT = 100_000
LONG_PRODUCT = 14
COMBINE_LIMIT = 100
PARTIAL_LIMIT = 30


def layer_forest(root):
    """Every way to associate every product in every split, distributed or factored form of the
    layer.

    Returns ``(forest, n_enumerated)``: ``forest`` a list of ``(ir_root, {MatMul: tree})``, the
    IR variant and one tree per product in it; ``n_enumerated`` counts every combination.
    When a variant has more than ``COMBINE_LIMIT`` combinations (TAGConv with 3 hops has 16,754
    in all), the trees dominated in both size scenarios are dropped (``prune``'s rule), first
    those of each product, then while the products are combined one at a time, those of the
    partial combinations (on their distinct calls: a sub-result shared by two products counts
    once). A layer with more than ``TREE_LIMIT`` trees in all (TAGConv with 4 hops has two
    million) is associated only as written (TAGConv: the stacked hops, each hop's product in
    every way), not in its split, distributed and factored forms; so is a layer with a product
    of more than ``LONG_PRODUCT`` factors (TAGConv with 5 hops or more), whose forms alone take
    long to list. If the layer as written has more trees, it raises ``TooManyTrees``: pruning
    them would take longer than the layer saves.
    """
    if max((len(p.args) for p in products(root)), default=0) > LONG_PRODUCT:
        variants = [root]                   # TAGConv with 5 or more hops: even the forms are many
    else:
        variants = [f for c in ir.split_cat_variants(root) for d in ir.distribute_variants(c)
                    for f in ir.factor_variants(d)]
    per_variant = []
    for variant in dict.fromkeys(variants):
        prods = list(dict.fromkeys(products(variant)))
        options = [association_trees(p.args) for p in prods]
        per_variant.append((variant, prods, options, math.prod(len(o) for o in options)))
    total = sum(n for *_, n in per_variant)
    if total > TREE_LIMIT:
        per_variant = [v for v in per_variant if v[0] == root]      # the layer as written
        if per_variant[0][3] > TREE_LIMIT:
            raise TooManyTrees(f"{total} association trees: too many to prune at run time "
                               f"(limit {TREE_LIMIT})")
    forest = []
    for variant, prods, options, n in per_variant:
        large = n > COMBINE_LIMIT
        if large:
            options = [_drop_dominated(o) for o in options]
        forest += [(variant, dict(zip(prods, c)))
                   for c in _combine(options, PARTIAL_LIMIT if large else math.inf)]
    return forest, total


def binary_orders(root):
    """How many ways there are to parenthesise every product of the layer, in every split,
    distributed and factored form, before any tree is merged, deduplicated or dropped: the sum
    over forms of the product over its products of Catalan(n - 1) for n factors. ``layer_forest``
    enumerates fewer (merged n-ary steps, dominated sub-products of long products dropped early);
    ``explain`` reports both."""
    if max((len(p.args) for p in products(root)), default=0) > LONG_PRODUCT:
        variants = [root]
    else:
        variants = [f for c in ir.split_cat_variants(root) for d in ir.distribute_variants(c)
                    for f in ir.factor_variants(d)]
    return sum(math.prod(math.comb(2 * (len(p.args) - 1), len(p.args) - 1) // len(p.args)
                         for p in dict.fromkeys(products(v)))
               for v in dict.fromkeys(variants))


def _combine(options, limit):
    """One tree from each of ``options`` in every way; dominated partial choices are dropped
    whenever there are more than ``limit``."""
    partial = [((), {})]
    for trees in options:
        partial = [(chosen + (t,), {**calls, **dict.fromkeys(steps(t))})
                   for chosen, calls in partial for t in trees]
        if len(partial) > limit:
            keep = _undominated([calls for _, calls in partial])
            partial = [p for i, p in enumerate(partial) if i in keep]
    return [chosen for chosen, _ in partial]


class TooManyTrees(Exception):
    """The layer's forest is too large to lower at run time; the original forward runs."""


def _drop_dominated(trees):
    keep = _undominated([steps(t) for t in trees])
    return [t for i, t in enumerate(trees) if i in keep]


def _undominated(call_lists):
    """Indices of the lists of calls (``Node``s) not dominated in both size scenarios."""
    from .prune import SCENARIOS, Calls, signature, survivors
    calls = [Calls.of(signature(n) for n in c) for c in call_lists]
    return set().union(*(survivors(calls, sc) for sc in SCENARIOS))
