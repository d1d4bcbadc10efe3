"""Relational layers: ``RelGraphConv`` re-associated over index spaces (``HeteroGraphConv``:
``hetero_conv``; its typed products: ``hetero_flat``; ``HGTConv``: ``hetero_hgt``).

RelGraphConv
------------
The layer computes (DGL's ``message``/``sum``, then its epilogue)::

    Y = sum_r A_r X W_r,      h = drop(act(LN(Y) + b + X[:N_dst] W_0))

with ``A_r`` the ``(N_dst, N_src)`` adjacency of relation ``r`` carrying the edge norm ``n_e``, and
``W_r`` a free weight (``regularizer=None``), ``W_r = sum_b a_rb V_b`` (``"basis"``) or a
block-diagonal weight (``"bdd"``). Every edge ``e = (u, v, r)`` factors ``A_r`` along a chain of
*index spaces* (the IR of the layer, ``SPACES``)::

    N_src  ->  (u, r) pairs  ->  edges (sorted by r)  ->  (v, r) pairs  ->  N_dst
      0            1                    2                      3              4

    A_r = S_{4<-3} S_{3<-2} diag(n) S_{2<-1} S_{1<-0}      (S: 0/1 selection or scatter maps)

plus ``0R`` (every node under every relation, ``N_src R`` rows). The linear factors of the
weight commute with the maps, so each factor can be applied in any space where it is defined:
a typed factor (``W_r``, or the coefficient ``a_rb``) needs a space whose rows carry a relation
(``0R``, 1, 2, 3); an untyped one (the bases ``V_b``, applied as one dense GEMM over the stacked
bases) any space. A *composition* is a placement of the factors (``enumerate_plans``); the maps
between consecutive placements fuse into one sparse *move* (a gather, a scatter-add, or an SpMM
that crosses the edge space and carries the norm as its values). So

    W_r at 2   per-edge typed linear, then aggregate (what DGL does: E x k_out messages)
    W_r at 1   transform once per distinct (u, r) pair that occurs, then aggregate
               (compact materialisation: |P_src| x k_out)
    W_r at 3   aggregate per (v, r) pair at k_in first (one SpMM over the relation-expanded
               destination index), then one segment GEMM
    W_r at 0R  transform every node under every relation (one GEMM, N R x k_out)
    basis: V at p, a at q   bases applied before (p < q: the combine with a_rb reduces the B
               transformed copies) or after (p > q: it expands to B copies at k_in) the
               aggregation; a combine at the edge space is folded into the move's values.

Input-obliviously dominated compositions are pruned (``prune``: a composition whose count of
every kind of work is at least another's at every corner of the admissible sizes, e.g. ``W_r at
2`` is never better than ``W_r at 1``: |P_src| <= E); the rest are priced per input by
``plan_cost`` from the sizes (N_src, N_dst, E, |P_src|, |P_dst|, R, k_in, k_out, B) with this
machine's rates at these widths (``rates``), and a measured tie-break settles the rest: in
inference the dispatcher's ``Trial`` times the two best and DGL's forward on the first calls; in
training the two best are timed forward + backward on the first call (``training_times``). A composition whose
intermediate results or folded index would not fit the machine is not run (``not_runnable``). Every move, GEMM and combine is one kernel call,
whatever the number of relations.
"""
import copy
import inspect
import math
import time
import weakref

import torch

from .runtime.dispatch import Dispatcher
from .runtime.state import AUTOCAST, ORIGINAL, autocast_on, original_forward
from .runtime.tiebreak import Trial
from .select import TRIAL_MARGIN
from .graph import _physical_memory, graph_info
from .kernels import pool, typed

SPACES = ("0", "0R", "1", "2", "3", "4")
ORDER = {s: i for i, s in enumerate(SPACES)}          # position along the chain
EDGE = "2"
TYPED_SPACES = ("0R", "1", "2", "3")                 # rows carry a relation
SPACE_NAMES = {"0": "N_src", "0R": "N_src x R", "1": "(src, rel) pairs", "2": "edges",
               "3": "(dst, rel) pairs", "4": "N_dst"}


# -- the per-graph relational index --------------------------------------------------------------
class RelIndex:
    """Index spaces of one graph under one edge-type vector (built once per graph and types).

    ``size[s]``: rows of space ``s``; ``at[s]``: per edge (edge-id order), its row in space ``s``;
    ``rel[s]``/``seglen[s]`` for the spaces whose rows are sorted by relation (1, 2, 3; the rows
    of ``0R``, node-major, are made by one GEMM and never segmented: no ``N R`` index is kept)."""

    def __init__(self, g, etypes, num_rels):
        u, v = g.edges(order="eid")
        u, v, r = u.long(), v.long(), etypes.long()
        ns, nd, e, R = g.num_src_nodes(), g.num_dst_nodes(), g.num_edges(), num_rels
        self.N_src, self.N_dst, self.E, self.R = ns, nd, e, R
        self.etypes = etypes.detach().clone()
        order = torch.argsort(r, stable=True)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(e)
        ps, inv_s = torch.unique(r * max(ns, 1) + u, return_inverse=True)
        pd, inv_d = torch.unique(r * max(nd, 1) + v, return_inverse=True)
        self.size = {"0": ns, "0R": ns * R, "1": ps.numel(), "2": e, "3": pd.numel(), "4": nd}
        self.at = {"0": u, "0R": u * R + r, "1": inv_s, "2": pos, "3": inv_d, "4": v}
        self.rel = {"1": ps // max(ns, 1), "2": r[order], "3": pd // max(nd, 1)}
        self.seglen = {s: torch.bincount(t, minlength=R)[:R].long() for s, t in self.rel.items()}
        self.r = r
        self.u, self.v, self.order = u, v, order
        self.node = {"1": ps % max(ns, 1), "3": pd % max(nd, 1)}   # the node of each pair
        self._moves = {}
        self.checks = {}
        self.decisions = weakref.WeakKeyDictionary()          # layer state -> {call key: ...}

    def sizes(self):
        return {"N_src": self.N_src, "N_dst": self.N_dst, "E": self.E, "P_src": self.size["1"],
                "P_dst": self.size["3"], "R": self.R}

    def move(self, a, b, expand=None, blocks=1):
        """The map from space ``a`` to space ``b`` (``ORDER[a] < ORDER[b]``) as a ``Move``.
        Maps that touch or cross the edge space have one entry per edge (value index: the edge
        id); others are deduplicated selections. ``expand="rows"``: rows ``(i, b)`` for
        ``blocks`` copies (values ``e * blocks + b``); ``"cols"``: columns ``(j, b)``."""
        key = (a, b, expand, blocks)
        m = self._moves.get(key)
        if m is None:
            ia, ib = self.at[a], self.at[b]
            per_edge = ORDER[a] <= ORDER[EDGE] <= ORDER[b]
            if per_edge:
                row, col, vid = ib, ia, torch.arange(self.E)
            else:
                span = max(self.size[a], 1)
                pair = torch.unique(ib * span + ia)         # one scalar sort, not unique(dim=1)
                row, col, vid = pair // span, pair % span, None
            rows, cols = self.size[b], self.size[a]
            if expand is not None:
                h = torch.arange(blocks)
                vid = (vid.reshape(-1, 1) * blocks + h).reshape(-1)
                if expand == "rows":
                    row, col = (row.reshape(-1, 1) * blocks + h).reshape(-1), col.repeat_interleave(blocks)
                    rows *= blocks
                else:
                    row, col = row.repeat_interleave(blocks), (col.reshape(-1, 1) * blocks + h).reshape(-1)
                    cols *= blocks
            m = self._moves[key] = typed.Move(row, col, rows, cols, vid)
        return m


def relational_index(g, etypes, num_rels):
    """The ``RelIndex`` of ``g`` under ``etypes``, kept in the graph's per-graph cache and
    reused while the same types come back (the same tensor unchanged, or equal values)."""
    gi = graph_info(g)
    key = ("granii_rel_index", num_rels)
    hit = gi.cache.get(key)
    if hit is not None:
        ref, version, idx = hit
        if (ref() is etypes and version == etypes._version) or (
                idx.etypes.shape == etypes.shape and idx.etypes.dtype == etypes.dtype
                and torch.equal(idx.etypes, etypes)):
            gi.cache[key] = (weakref.ref(etypes), etypes._version, idx)
            return idx
    idx = RelIndex(g, etypes, num_rels)
    gi.cache[key] = (weakref.ref(etypes), etypes._version, idx)
    return idx


# -- compositions ------------------------------------------------------------------------------------
def enumerate_plans(regularizer):
    """Every placement of the weight's factors on the chain of spaces (see the module docstring).

    A plan is a tuple of ``(factor, space)`` in dataflow order: ``("W", s)`` the typed weight
    (materialised from the bases for ``"basis"``); ``("V", s)`` the stacked bases and
    ``("a", s)`` the basis coefficients."""
    plans = [(("W", s),) for s in TYPED_SPACES]
    if regularizer == "basis":
        for pv in SPACES:
            for pa in ("1", "2", "3"):
                first = ORDER[pv] <= ORDER[pa]
                if pv == "0R":
                    continue                  # the bases are untyped: 0R is 0 repeated R times
                plans.append((("V", pv), ("a", pa)) if first else (("a", pa), ("V", pv)))
    return plans


def plan_name(plan):
    return " -> ".join(f"{f}@{SPACE_NAMES[s]}" for f, s in plan)


def lower(plan):
    """Steps of a plan: moves between consecutive placements, a final move to ``N_dst``.

    A coefficient placed at the edge space, with no other factor there, is folded into the move
    that crosses it (its values become ``n_e a_{r_e b}``, over expanded rows or columns)."""
    factors = list(plan)
    fold = None
    at_edge = [f for f, s in factors if s == EDGE]
    if at_edge == ["a"]:
        i = next(i for i, (f, s) in enumerate(factors) if f == "a")
        fold = "cols" if i > 0 else "rows"          # after V: reduce B copies; before: expand
        factors.pop(i)
    steps, cur = [], "0"
    for f, s in factors:
        if f == "W" and s == "0R":
            steps.append(("Wall", "0"))
            cur = "0R"
            continue
        if s != cur:
            steps.append(("move", cur, s, _crosses(cur, s) and fold))
            cur = s
        steps.append((f, s))
    if cur != "4":
        steps.append(("move", cur, "4", _crosses(cur, "4") and fold))
    return steps


def _crosses(a, b):
    return ORDER[a] <= ORDER[EDGE] < ORDER[b]


def step_work(steps, sz, k_in, k_out, B, reg):
    """Work of each step by kind, in element counts: ``{"gemm": multiply-adds, "seg": typed
    multiply-adds, "sparse": gathered elements, "stream": elements written, "calls": kernel
    calls}``, and ``"held"``: the elements of every step's result (what a training step keeps
    for its backward; an upper bound of what inference holds at once)."""
    w = {"gemm": 0.0, "seg": 0.0, "sparse": 0.0, "stream": 0.0, "calls": 0.0, "bdd": 0.0,
         "held": 0.0}
    width, heads = k_in, 1
    for st in steps:
        kind = st[0]
        w["calls"] += 1
        if kind == "move":
            _, a, b, fold = st
            if ORDER[a] <= ORDER[EDGE] <= ORDER[b]:
                nnz = sz["E"]                   # one entry per edge
            else:
                nnz = sz[b] if ORDER[b] < ORDER[EDGE] else sz[a]   # a gather or a scatter
            if fold == "rows":
                heads = B
                w["sparse"] += nnz * B * width
            elif fold == "cols":
                w["sparse"] += nnz * B * width
                heads = 1
            else:
                w["sparse"] += nnz * heads * width
            w["stream"] += sz[b] * heads * width
            w["held"] += sz[b] * heads * width
        elif kind == "W":
            rows = sz[st[1]]
            if reg == "bdd":
                w["bdd"] += rows * k_in * k_out / B
            else:
                w["seg"] += rows * k_in * k_out
            w["stream"] += rows * k_out
            w["held"] += rows * k_out
            width = k_out
        elif kind == "Wall":
            rows = sz["0"]
            w["gemm"] += rows * k_in * k_out * sz["R"] / (B if reg == "bdd" else 1)
            w["stream"] += rows * k_out * sz["R"]
            w["held"] += rows * k_out * sz["R"]
            width = k_out
        elif kind == "V":
            rows = sz[st[1]]
            w["gemm"] += rows * k_in * k_out * B
            if heads == B:          # after an expanding combine: B k_in -> k_out
                heads, width = 1, k_out
            else:
                heads, width = B, k_out
            w["stream"] += rows * heads * width
            w["held"] += rows * heads * width
        elif kind == "a":
            rows = sz[st[1]]
            w["stream"] += rows * B * width * 2
            heads = 1 if heads == B else B
            w["held"] += rows * heads * width
    if reg == "basis" and any(st[0] in ("W", "Wall") for st in steps):
        w["gemm"] += sz["R"] * B * k_in * k_out
        w["calls"] += 1
    return w


def space_sizes(sizes):
    return {"0": sizes["N_src"], "0R": sizes["N_src"] * sizes["R"], "1": sizes["P_src"],
            "2": sizes["E"], "3": sizes["P_dst"], "4": sizes["N_dst"], "E": sizes["E"],
            "R": sizes["R"]}


def _corners():
    """Admissible size assignments at the corners: E fixed, pairs between E/64 and E (and at most
    N R), nodes between E/256 and E; embedding sizes either way round; few and many relations."""
    e = 1 << 20
    for p_src in (e >> 6, e):
        for p_dst in (e >> 6, e):
            for n_src in (e >> 8, e):
                for n_dst in (e >> 8, e):
                    for R in (2, 256):
                        if p_src > n_src * R or p_dst > n_dst * R:
                            continue
                        for k_in, k_out in ((16, 16), (256, 16), (16, 256)):
                            for B in (2, 32):
                                yield ({"N_src": n_src, "N_dst": n_dst, "E": e, "P_src": p_src,
                                        "P_dst": p_dst, "R": R}, k_in, k_out, B)


# nominal relative costs per unit of work, two machines: compute-bound and memory-bound
_NOMINAL = ({"gemm": 1.0, "seg": 2.0, "bdd": 4.0, "sparse": 2.0, "stream": 1.0, "calls": 0.0},
            {"gemm": 0.2, "seg": 0.5, "bdd": 1.0, "sparse": 8.0, "stream": 4.0, "calls": 0.0})


def prune(plans, regularizer):
    """``(kept, pruned)``: a plan is pruned when another costs at most as much at every corner of
    the admissible sizes (``_corners``) on both nominal machines, and less at one."""
    lowered = {p: lower(p) for p in plans}
    table = {}
    for p in plans:
        costs = []
        for sizes, k_in, k_out, B in _corners():
            w = step_work(lowered[p], space_sizes(sizes), k_in, k_out, B, regularizer)
            costs += [sum(rate[k] * w[k] for k in rate) for rate in _NOMINAL]
        table[p] = costs
    kept, pruned = [], {}
    for p in plans:
        by = next((q for q in plans if q != p and all(a <= b for a, b in zip(table[q], table[p]))
                   and any(a < b for a, b in zip(table[q], table[p]))), None)
        if by is None:
            kept.append(p)
        else:
            pruned[p] = by
    return kept, pruned


_PLANS = {}


def plans_for(regularizer):
    """``(kept, pruned)`` plans of a regularizer, enumerated and pruned once per process."""
    if regularizer not in _PLANS:
        _PLANS[regularizer] = prune(enumerate_plans(regularizer), regularizer)
    return _PLANS[regularizer]


# -- pricing -------------------------------------------------------------------------------------------
_RATES = {}


def _width(k):
    """``k`` rounded to a power of two in [8, 256]: rates are measured once per bucket."""
    return min(max(1 << max(int(k) - 1, 1).bit_length(), 8), 256)


def rates(k_in=64, k_out=64):
    """Seconds per unit of work on this machine at the current thread count and these widths
    (rounded by ``_width``), measured once (a few small calls, ~0.1 s): dense GEMM, segment GEMM
    over 32 relations, sparse gather, streaming writes, and the fixed cost of a kernel call.
    Narrow GEMMs reach a fraction of the wide ones' rate, so the widths are measured, not
    assumed."""
    threads, a, b = torch.get_num_threads(), _width(k_in), _width(k_out)
    key = (threads, a, b)
    if key in _RATES:
        return _RATES[key]
    gen = torch.Generator().manual_seed(0)
    n = max((1 << 20) // max(a, b), 1 << 12)
    x = torch.randn(n, a, generator=gen)
    w = torch.randn(32, a, b, generator=gen)
    seg = torch.full((32,), n // 32, dtype=torch.long)
    col = torch.randint(0, n, (4 * n,), generator=gen)
    row = torch.arange(4 * n) // 4
    m = typed.Move(row, col, n, n)

    tiny = torch.randn(4, 4)
    call = _fastest(lambda: tiny @ tiny, 20)
    r = {"gemm": _fastest(lambda: x @ w[0]) / (n * a * b),
         "seg": _fastest(lambda: typed.segment_gemm(x, w, seg)) / (n * a * b),
         "sparse": _fastest(lambda: typed.move(m, x)) / (4 * n * a),
         "stream": _fastest(lambda: x * 2.0) / (n * a),
         "calls": call * 5}
    r["bdd"] = r["seg"] * 4
    _RATES[key] = r
    return r


TRAIN_FACTOR = {"gemm": 3.0, "seg": 3.0, "bdd": 3.0, "sparse": 2.0, "stream": 2.0, "calls": 2.0}


def plan_cost(plan, sizes, k_in, k_out, B, reg, training):
    w = step_work(lower(plan), space_sizes(sizes), k_in, k_out, B, reg)
    r = rates(k_in, k_out)
    return sum(r[k] * w[k] * (TRAIN_FACTOR[k] if training else 1.0) for k in r)


# -- running a plan --------------------------------------------------------------------------------------
def typed_weight(lin):
    """``W_r`` of a TypedLinear as ``(R, k_in, k_out)`` (bdd: its ``(R, B s_in s_out)`` blocks)."""
    return lin.get_weight()


def run_plan(plan, idx, lin, x, norm):
    """``Y = sum_r A_r X W_r`` by the composition ``plan`` (``lin``: the layer's TypedLinear)."""
    reg = lin.regularizer
    B = getattr(lin, "num_bases", 1)
    k_in, k_out = lin.in_size, lin.out_size
    n = None if norm is None else norm.reshape(idx.E)
    cur, h = "0", x
    for st in lower(plan):
        kind = st[0]
        if kind == "move":
            _, a, b, fold = st
            vals = n if _crosses(a, b) else None
            if fold:
                coeff = lin.coeff.index_select(0, idx.r)                  # (E, B)
                vals = coeff if vals is None else coeff * vals.reshape(-1, 1)
                m = idx.move(a, b, fold, B)
                if fold == "rows":          # (rows B, k) -> (rows, B k)
                    h = typed.move(m, h, vals.reshape(-1, 1)).reshape(idx.size[b], B * k_in)
                else:                       # (cols, B, k) -> (cols B, k) -> (rows, k)
                    h = typed.move(m, h.reshape(idx.size[a] * B, k_out), vals.reshape(-1, 1))
            else:
                h = typed.move(idx.move(a, b), h, None if vals is None else vals.reshape(-1, 1))
            cur = b
        elif kind == "Wall":
            if reg == "bdd":
                w = lin.W.view(idx.R, B, k_in // B, k_out // B)
                h = torch.einsum("nbi,rbio->nrbo", h.view(-1, B, k_in // B), w)
            else:
                w = typed_weight(lin)                                       # (R, k_in, k_out)
                h = (h @ w.permute(1, 0, 2).reshape(k_in, -1))
            h = h.reshape(-1, k_out)
            cur = "0R"
        elif kind == "W":
            if reg == "bdd":
                h = typed.rowwise_bdd(h, lin.W, idx.rel[cur], B)
            else:
                h = typed.segment_gemm(h, typed_weight(lin), idx.seglen[cur])
        elif kind == "V":
            V = lin.W                                                       # (B, k_in, k_out)
            if _expanded_before(plan):      # rows hold a_rb X: one GEMM over the stacked bases
                h = h @ V.reshape(B * k_in, k_out)
            else:                           # B transformed copies side by side
                h = h @ V.permute(1, 0, 2).reshape(k_in, B * k_out)
        elif kind == "a":
            coeff = lin.coeff.index_select(0, idx.rel[cur])                 # (rows, B)
            rows = h.shape[0]
            if _expanded_before(plan):
                h = (coeff.unsqueeze(2) * h.unsqueeze(1)).reshape(rows, B * k_in)
            else:
                h = torch.bmm(coeff.unsqueeze(1), h.reshape(rows, B, k_out)).reshape(rows, k_out)
    return h


def _expanded_before(plan):
    return plan[0][0] == "a"


# -- RelGraphConv ----------------------------------------------------------------------------------------
class FastestTrial(Trial):
    """The dispatcher's measured tie-break, keeping the candidate with the fastest *single* timed
    call instead of the fastest median: on a machine shared with other work a call is slowed by
    bursts of load, never sped up, so the minimum is the steadier estimate (the relational
    candidates differ by factors, not percents)."""

    def medians(self):
        return {label: min(ts[1:] or ts) for label, ts in self.times.items() if ts}


def trial_original(mode):
    """DGL's forward takes part in the tie-break in inference only: the trial times forward
    calls, and in training DGL's per-edge composition (pruned as dominated) spends most of its
    time in the backward (its segment product's weight gradient), which a forward time hides."""
    return [] if mode[0] else [(ORIGINAL, ORIGINAL)]


class RelState:
    """What the dispatcher of one RelGraphConv knows (``explain`` prints it)."""

    def __init__(self, name, module):
        self.name, self.module = name, module
        self.fallback = None
        self.calls = 0
        self.last = None           # (sizes, mode, [(plan, cost)], chosen, pruned)
        self.tuned = None
        self.chosen = {}
        self.failed = {}

    def explain(self, p):
        m = self.module
        lin = m.linear_r
        p(f"== layer '{self.name}' ({type(m).__name__}) " + "=" * 40)
        reg = lin.regularizer
        p("  IR: Y = sum_r A_r X W_r over the chain of index spaces "
          + " -> ".join(SPACE_NAMES[s] for s in SPACES if s != "0R")
          + f"; W_r: {'free' if reg is None else reg}"
          + (f" (B = {lin.num_bases})" if reg else "")
          + f"; R = {lin.num_types}, k_in = {lin.in_size}, k_out = {lin.out_size}")
        kept, pruned = plans_for(reg)
        p(f"  compositions: {len(kept) + len(pruned)} enumerated, {len(pruned)} pruned "
          f"input-obliviously, {len(kept)} priced per input")
        for q, by in pruned.items():
            p(f"    pruned  {plan_name(q)}  (dominated by {plan_name(by)})")
        if self.fallback:
            p(f"  last call ran the original forward: {self.fallback}")
        if self.last is None:
            if not self.fallback:
                p("  no decision yet (the layer has not run on an input)")
            p("")
            return
        sizes, mode, ranking, chosen = self.last
        p("  last input: " + " ".join(f"{k}={v}" for k, v in sizes.items())
          + f"  mode: {'training' if mode[0] else 'inference'}")
        for q, c in ranking:
            mark = "  <- chosen" if q == chosen else ""
            p(f"    {c * 1e3:9.3f} ms  {plan_name(q)}{mark}")
        for q in kept:
            why = not_runnable(q, sizes, lin.in_size, lin.out_size,
                               getattr(lin, "num_bases", 1), reg)
            if why:
                p(f"    not run: {plan_name(q)} ({why})")
        if chosen == ORIGINAL:
            p("  kept DGL's forward (measured fastest)" if ranking else
              "  no composition can run on this input: DGL's forward runs")
        if self.tuned:
            times, kept_label = self.tuned[:2]
            how = self.tuned[2] if len(self.tuned) > 2 else "forward, on the first calls"
            p(f"  measured ({how}; fastest run): " + ", ".join(
                f"{label} {t * 1e3:.3f} ms" for label, t in times) + f"; kept {kept_label}")
        p("")


class TypedDispatcher(Dispatcher):
    """``forward`` of an optimized relational layer: its own state type (``state_type``) and
    dispatch function (``run``); copies and unpickled dispatchers make a fresh state."""
    state_type = None
    run = None

    def __init__(self, layer, name, options):
        self.layer, self.options = layer, options
        self.state = self.state_type(name, layer)

    def __call__(self, *args, **kwargs):
        if self.state is None:
            self.state = self.state_type(getattr(self, "_name", type(self.layer).__name__),
                                         self.layer)
        if autocast_on():
            self.state.fallback = AUTOCAST
            return original_forward(self.layer, args, kwargs)
        return pool.run(args, type(self).run, self.state, self.options, self.layer, args, kwargs)

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(self.layer, memo), self.state.name, self.options)


class RelDispatcher(TypedDispatcher):
    """``forward`` of an optimized ``RelGraphConv`` (see the module docstring)."""


_REL_SIG = None


def _rel_args(layer, args, kwargs):
    global _REL_SIG
    if _REL_SIG is None:
        _REL_SIG = inspect.signature(type(layer).forward)
    b = _REL_SIG.bind(layer, *args, **kwargs)
    b.apply_defaults()
    a = b.arguments
    return a["g"], a["feat"], a["etypes"], a["norm"], a["presorted"]


def rel_unsupported(layer, g, feat, etypes, norm, presorted):
    """Why this call runs DGL's forward, or ``None``."""
    lin = getattr(layer, "linear_r", None)
    if lin is None or lin.regularizer not in (None, "basis", "bdd"):
        return "a linear_r that is not DGL's TypedLinear"
    if not hasattr(g, "canonical_etypes") or len(g.canonical_etypes) != 1 \
            or len(g.srctypes) != 1 or len(g.dsttypes) != 1:
        return "RelGraphConv on a graph with several node or edge types (it takes a " \
               "homogeneous graph with an edge-type tensor)"
    if not isinstance(feat, torch.Tensor) or feat.dim() != 2 or feat.dtype != torch.float32 \
            or feat.device.type != "cpu":
        return "features that are not a float32 CPU matrix"
    if feat.shape != (g.num_src_nodes(), lin.in_size):
        return f"features of shape {tuple(feat.shape)} (DGL's forward raises or broadcasts)"
    if not isinstance(etypes, torch.Tensor) or etypes.shape != (g.num_edges(),) \
            or etypes.is_floating_point() or etypes.device.type != "cpu":
        return "etypes that are not an integer tensor of one entry per edge"
    if norm is not None and (not isinstance(norm, torch.Tensor) or norm.shape != (g.num_edges(), 1)
                             or norm.dtype != torch.float32):
        return "a norm that is not a float32 (E, 1) tensor"
    if lin.regularizer == "bdd" and (lin.in_size % lin.num_bases or lin.out_size % lin.num_bases):
        return "bdd sizes not divisible by the number of bases"
    return None


_REL_FORWARD = []


def _rel_forward():
    if not _REL_FORWARD:
        from dgl.nn.pytorch import RelGraphConv
        _REL_FORWARD.append(RelGraphConv.forward)
    return _REL_FORWARD[0]


def _types_check(idx, presorted):
    """Checks on the edge types, once per index: range, and order when ``presorted``."""
    r = idx.r
    if r.numel() and (int(r.min()) < 0 or int(r.max()) >= idx.R):
        return f"edge types outside [0, {idx.R})"
    if presorted and r.numel() > 1 and bool((r[1:] < r[:-1]).any()):
        return ("presorted=True with edge types that are not sorted: DGL's segment product "
                "then mixes relations, and granii does not reproduce that")
    return None


def rel_dispatch(state, options, layer, args, kwargs):
    try:
        if type(layer).forward is not _rel_forward():
            raise TypeError("a subclass of RelGraphConv with its own forward")
        g, feat, etypes, norm, presorted = _rel_args(layer, args, kwargs)
        reason = rel_unsupported(layer, g, feat, etypes, norm, presorted)
        if reason is None:
            idx = relational_index(g, etypes, layer.linear_r.num_types)
            if bool(presorted) not in idx.checks:
                idx.checks[bool(presorted)] = _types_check(idx, presorted)
            reason = idx.checks[bool(presorted)]
    except Exception as e:          # noqa: BLE001 - binding failed: DGL's forward decides
        reason = f"binding the call failed ({type(e).__name__}: {e})"
    if reason is not None:
        state.fallback = reason
        return type(layer).forward(layer, *args, **kwargs)
    state.fallback = None
    lin = layer.linear_r
    grad = torch.is_grad_enabled()
    training = grad and any(p.requires_grad for p in layer.parameters())
    mode = (training, grad and feat.requires_grad, torch.get_num_threads())
    per_idx = idx.decisions.get(state)
    if per_idx is None:
        per_idx = idx.decisions[state] = {}
    key = (lin.regularizer, getattr(lin, "num_bases", 1), lin.in_size, lin.out_size) + mode
    decision = per_idx.get(key)
    if decision is None:
        decision = per_idx[key] = _rel_decide(state, options, idx, lin, mode, g.is_block,
                                              feat, norm)
    if isinstance(decision, Trial):
        label, plan = decision.next()[:2]
        t0 = time.perf_counter()
        out = _rel_run(state, plan, idx, layer, g, feat, etypes, norm, presorted, args, kwargs)
        decision.record(label, time.perf_counter() - t0)
        if decision.settled():
            per_idx[key] = decision.winner()
            state.tuned = (decision.report(), per_idx[key][0])
            state.last = state.last[:3] + (per_idx[key][1],)
        return out
    return _rel_run(state, decision[1], idx, layer, g, feat, etypes, norm, presorted, args, kwargs)


INDEX_ENTRIES_LIMIT = 1 << 24
INTERMEDIATE_BYTES_LIMIT = _physical_memory() // 4


def index_entries(plan, sizes, B):
    """Index entries a plan's moves keep per graph beyond one per edge: a coefficient folded into
    the edge-crossing move expands it to E B entries (indices, value ids, the transpose)."""
    return sizes["E"] * B if any(st[0] == "move" and st[3] for st in lower(plan)) else 0


def intermediate_bytes(plan, sizes, k_in, k_out, B, reg):
    """Bytes of the float32 results of every step of ``plan`` (``step_work``'s ``held``)."""
    return 4 * step_work(lower(plan), space_sizes(sizes), k_in, k_out, B, reg)["held"]


def not_runnable(plan, sizes, k_in, k_out, B, reg):
    """Why ``plan`` is not run on these sizes, or ``None``: its folded coefficients would keep
    more than ``INDEX_ENTRIES_LIMIT`` index entries per graph (BGS-sized graphs with 40 bases:
    several GB), or its intermediate results would take more than ``INTERMEDIATE_BYTES_LIMIT``
    (a quarter of the machine's memory; e.g. every node under every relation on AM-sized
    graphs)."""
    n = index_entries(plan, sizes, B)
    if n > INDEX_ENTRIES_LIMIT:
        return f"its folded coefficients would keep E x B = {n:,} index entries per graph"
    nb = intermediate_bytes(plan, sizes, k_in, k_out, B, reg)
    if nb > INTERMEDIATE_BYTES_LIMIT:
        return (f"its intermediate results would take {nb / 2**30:.1f} GiB (limit "
                f"{INTERMEDIATE_BYTES_LIMIT / 2**30:.1f} GiB, a quarter of this machine's memory)")
    return None


def runnable(plans, sizes, k_in, k_out, B, reg):
    """The plans ``not_runnable`` lets run."""
    return [p for p in plans if not_runnable(p, sizes, k_in, k_out, B, reg) is None]


TRAINING_TRIAL_REPS = 2


def training_times(cands, idx, lin, feat, norm, reps=TRAINING_TRIAL_REPS):
    """``[(label, seconds)]``: forward + backward of each candidate plan on this call's input
    (one untimed run, then the fastest of ``reps``). The gradients are taken by
    ``torch.autograd.grad`` and dropped: nothing accumulates in ``.grad``, no random number is
    drawn (dropout is in the epilogue, outside the plan)."""
    wrt = [t for t in (feat, norm, *lin.parameters()) if t is not None and t.requires_grad]
    out = []
    for label, plan in cands:
        def step():
            y = run_plan(plan, idx, lin, feat, norm)
            if y.requires_grad:
                torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)
        out.append((label, _fastest(step, reps)))
    return out


def _fastest(f, reps=5):
    """Seconds of the fastest of ``reps`` timed calls of ``f``, after one untimed call."""
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def rank_plans(lin, sizes, training):
    """``[(plan, predicted seconds)]`` of the runnable kept plans of ``lin``'s regularizer on
    these sizes, cheapest first (empty when none can run)."""
    B = getattr(lin, "num_bases", 1)
    kept = runnable(plans_for(lin.regularizer)[0], sizes, lin.in_size, lin.out_size, B,
                    lin.regularizer)
    return sorted(((p, plan_cost(p, sizes, lin.in_size, lin.out_size, B, lin.regularizer,
                                 training)) for p in kept), key=lambda t: t[1])


def _rel_decide(state, options, idx, lin, mode, is_block, feat=None, norm=None):
    sizes = idx.sizes()
    ranking = rank_plans(lin, sizes, mode[0])
    if not ranking:
        state.last = (sizes, mode, [], ORIGINAL)
        return (ORIGINAL, ORIGINAL)
    best = ranking[0]
    state.last = (sizes, mode, ranking, best[0])
    cands = [(plan_name(best[0]), best[0])]
    if len(ranking) > 1 and ranking[1][1] <= TRIAL_MARGIN * best[1]:
        cands.append((plan_name(ranking[1][0]), ranking[1][0]))
    tune = (options.tune and not is_block and options.expected_calls > 1
            and not torch.are_deterministic_algorithms_enabled())
    if not tune or (mode[0] and len(cands) == 1):
        return cands[0]
    if mode[0]:
        # a trial over calls would time forwards only: the backward is most of a training step
        times = training_times(cands, idx, lin, feat, norm)
        label = min(times, key=lambda t: t[1])[0]
        winner = next(c for c in cands if c[0] == label)
        state.tuned = (times, label, "forward + backward, on the first call")
        state.last = state.last[:3] + (winner[1],)
        return winner
    return FastestTrial(cands + trial_original(mode))


def _rel_run(state, plan, idx, layer, g, feat, etypes, norm, presorted, args, kwargs):
    if plan == ORIGINAL:
        return type(layer).forward(layer, *args, **kwargs)
    layer.presorted = presorted               # DGL's forward leaves this attribute set
    state.calls += 1
    h = run_plan(plan, idx, layer.linear_r, feat, norm)
    # DGL's epilogue, in its order, on the layer's own modules
    if layer.layer_norm:
        h = layer.layer_norm_weight(h)
    if layer.bias:
        h = h + layer.h_bias
    if layer.self_loop:
        h = h + feat[: g.num_dst_nodes()] @ layer.loop_weight
    if layer.activation:
        h = layer.activation(h)
    return layer.dropout(h)


RelDispatcher.state_type = RelState
RelDispatcher.run = staticmethod(rel_dispatch)
