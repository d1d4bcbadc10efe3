"""Input-oblivious pruning of association trees (paper, section IV-C).

Each tree is a multiset of primitive calls; a call's *signature* is its primitive, whether it runs
once per graph, and the symbolic sizes of its operands:

    gemm / head_gemm (m, k, n)   spmm / spmm_weighted / spmm_heads (E, k)   row_scale (n, k)
    sddmm_scale (E,)   diag_mul (n,)   edge_message / edge_message_sum (E, k)

Two embedding-size scenarios are considered, ``k_in >= k_out`` and ``k_in < k_out``; in both
``N_dst <= N_src`` (a block's destinations are a prefix of its sources). Tree ``T`` is pruned in a
scenario when another tree ``S`` *dominates* it: every call of ``S`` matches a distinct call of
``T`` of the same primitive on operands no larger. That covers both rules of the paper: a superset
of another tree's primitives (``T`` has extra calls), and the same primitives on larger matrices.
Two trees that dominate each other are duplicates: the one with fewer calls (then the first) is kept. A tree pruned in both
scenarios is dropped; the others are promoted, annotated with the scenarios they survive.
"""
import functools
import itertools
from dataclasses import dataclass

from . import ir


GE, LT = ">=", "<"          # k_in >= k_out, k_in < k_out
SCENARIOS = (GE, LT)
_ORDER = {GE: {("k_out", "k_in"), ("N_dst", "N_src")},
          LT: {("k_in", "k_out"), ("N_dst", "N_src")}}


@functools.lru_cache(maxsize=1 << 16)
def signature(node):
    """``(primitive, once_per_graph, sizes)`` of the call that computes ``node`` (an inner node
    of an association tree or of the IR), or ``None`` for what is not priced (inline steps)."""
    if isinstance(node, ir.Add):      # a bias too: broadcast over the rows, it is a pass over them
        return "add", False, (node.rows, node.cols)
    if isinstance(node, ir.Cat):
        return "cat", False, (node.rows, node.cols)
    if isinstance(node, ir.EdgeScore):
        return "sddmm_add", False, ("E",)
    if isinstance(node, ir.EdgeSoftmax):
        return "edge_softmax", False, ("E",)
    if isinstance(node, ir.Aggregate):
        return node.prim, False, ("E", node.cols)
    if isinstance(node, ir.EdgeSum):
        return "edge_message_sum", False, ("E", node.cols)
    if isinstance(node, ir.EdgeMessage):
        return "edge_message", False, ("E", node.cols)
    if not hasattr(node, "parts"):
        return None
    if node.prim in ("gemm", "head_gemm"):
        left = node.parts[0]
        dims = (left.rows, left.cols, node.cols)
        if node.prim == "gemm" and is_head_diag(node.parts[1]):
            return "head_dot", node.graph_only, dims
    elif node.prim in ("spmm", "spmm_weighted", "spmm_heads"):
        dims = ("E", node.cols)
    elif node.prim in ("row_scale", "row_slice"):
        dims = (node.rows, node.cols)
    elif node.prim == "sddmm_scale":
        dims = ("E",)
    else:
        dims = (node.rows,)
    return node.prim, node.graph_only, dims


def is_head_diag(n):
    """``n`` is the ``blockdiag(a_1 .. a_H)`` of an attention parameter: a product with it is a
    dot product per head (``head_dot``), H times fewer multiply-adds than the dense GEMM."""
    return isinstance(n, ir.Leaf) and n.source[0] == "headdiag"


def size_le(a, b, scenario):
    return a == b or (a, b) in _ORDER[scenario]


@functools.lru_cache(maxsize=None)
def dims_le(a, b, scenario):
    """Some ordering of ``a``'s sizes is element-wise no larger than ``b``'s (cost is a product)."""
    if len(a) != len(b):
        return False
    return any(all(size_le(x, y, scenario) for x, y in zip(perm, b))
               for perm in itertools.permutations(a))


def _counts(sigs):
    out = {}
    for p, once, _ in sigs:
        out[(p, once)] = out.get((p, once), 0) + 1
    return out


@dataclass(frozen=True)
class Calls:
    """A tree's call signatures, with what ``covered_by`` reads of them computed once."""
    sigs: tuple
    counts: dict          # (primitive, once) -> number of calls
    needed: tuple         # the calls another tree must match to dominate it
    needed_counts: dict

    @classmethod
    def of(cls, sigs):
        sigs = tuple(sigs)
        needed = tuple(s for s in sigs if _needs_match(s))
        return cls(sigs, _counts(sigs), needed, _counts(needed))


@functools.lru_cache(maxsize=None)
def _needs_match(sig):
    """Not a once-per-graph call on vectors (sizes without an embedding width)."""
    return not (sig[1] and not any(d.startswith("k") for d in sig[2]))


def covered_by(small, big, scenario):
    """Each call of ``small`` matches a distinct call of ``big`` (both ``Calls``), same
    primitive, no larger.

    Once-per-graph calls on vectors (sizes without an embedding width: degree products, edge
    scaling) are amortised to nothing and need no match.
    """
    if len(small.needed) > len(big.sigs):
        return False
    if any(big.counts.get(k, 0) < n for k, n in small.needed_counts.items()):
        return False
    return _matching(small.needed, big.sigs, scenario) == len(small.needed)


def _matching(small, big, scenario):
    """Size of a maximum matching of ``small``'s calls to distinct ``big`` calls of the same
    primitive and no larger sizes.

    Calls with the same signature are interchangeable, so this is a flow between the distinct
    signatures (capacities: how many calls have each) found by augmenting paths: polynomial in
    the number of distinct signatures, where a matching call by call (Kuhn) costs the square of
    the calls, and backtracking over the assignments is exponential (the long hop chains of
    TAGConv, APPNP: ten spmm calls of one signature are one node of capacity ten)."""
    need, have = _counts_of(small), _counts_of(big)
    kinds, slots = list(need), list(have)
    cap = [have[t] for t in slots]
    fits = [[j for j, (q, once_q, dims_q) in enumerate(slots)
             if p == q and once == once_q and dims_le(dims, dims_q, scenario)]
            for p, once, dims in kinds]
    used = [0] * len(slots)
    flow = [dict() for _ in kinds]      # flow[i][j]: calls of kinds[i] matched to slots[j]

    def augment(i, seen):
        for j in fits[i]:
            if j in seen:
                continue
            seen.add(j)
            if used[j] < cap[j]:
                used[j] += 1
            else:
                for i2 in range(len(kinds)):
                    if flow[i2].get(j) and augment(i2, seen):
                        flow[i2][j] -= 1
                        break
                else:
                    continue
            flow[i][j] = flow[i].get(j, 0) + 1
            return True
        return False

    total = 0
    for i, kind in enumerate(kinds):
        for _ in range(need[kind]):
            if not augment(i, set()):
                break
            total += 1
    return total


def _counts_of(sigs):
    out = {}
    for s in sigs:
        out[s] = out.get(s, 0) + 1
    return out


def survivors(sigs, scenario):
    """Indices of the trees (lists of call signatures, or ``Calls``) not dominated by another
    in ``scenario``.

    A skyline pass: trees are visited fewest calls first, each either dominated by one already
    kept (dropped), or kept, dropping those it dominates. Domination is transitive, so this is
    the all-pairs answer in O(trees x kept); among duplicates the first visited stays.
    """
    calls = [c if isinstance(c, Calls) else Calls.of(c) for c in sigs]
    order = sorted(range(len(calls)), key=lambda i: (len(calls[i].sigs), i))
    kept = []
    for i in order:
        if any(covered_by(calls[j], calls[i], scenario) for j in kept):
            continue
        kept = [j for j in kept if not covered_by(calls[i], calls[j], scenario)]
        kept.append(i)
    return sorted(kept)


def prune(call_lists):
    """``{index: scenarios}`` of the promoted trees, given each tree's priced calls (signatures);
    the trees not listed are dominated in both scenarios.

    Trees with the same multiset of signatures are duplicates: only the one with the fewest
    calls (then the first) takes part."""
    first = {}
    for i in sorted(range(len(call_lists)), key=lambda i: (len(call_lists[i]), i)):
        first.setdefault(tuple(sorted(call_lists[i])), i)
    uniq = sorted(first.values())
    calls = [Calls.of(call_lists[i]) for i in uniq]
    alive = {s: set(survivors(calls, s)) for s in SCENARIOS}
    promoted = {}
    for j, i in enumerate(uniq):
        scenarios = tuple(s for s in SCENARIOS if j in alive[s])
        if scenarios:
            promoted[i] = scenarios
    return promoted
