"""``HGTConv``: its two per-edge typed products placed on the chain of index spaces.

Per head ``h`` DGL's HGTConv computes, on every edge ``e = (u, v, r)``::

    a_e = <k_u W^att_{h,r}, q_v> pri_{h,r} / sqrt(d)        alpha = edge_softmax(a)
    y_v = sum_e alpha_e  v_u W^msg_{h,r}

with ``k, q, v`` the node-typed projections (DGL's own modules, called as DGL calls them) and then
DGL's epilogue (``linear_a``, dropout, the typed skip, residual, layer norm) on the layer's own
modules. The two typed products each have a placement on the chain of ``granii.hetero``:

    att at 1   K'_p = k_u W^att_r once per distinct (u, r) pair, then a_e = <K'_{p(e)}, q_v>
    att at 3   Q'_p = q_v (W^att_r)^T once per distinct (v, r) pair, then a_e = <k_u, Q'_{p(e)}>
    att at 2   per edge (DGL's)
    msg at 1   M_p = v_u W^msg_r per (u, r) pair, then one weighted SpMM (values alpha) to N_dst
    msg at 3   Z_p = sum alpha_e v_u per (v, r) pair (one weighted SpMM), then the typed GEMM,
               then a scatter to N_dst
    msg at 2   per edge (DGL's)

Placements at the edge space are pruned by the same corner domination as RelGraphConv's (a pair
space is never larger than the edge space), the rest priced per input, and the measured
tie-break keeps the fastest of the two best and DGL's forward. Each typed product is one segment
GEMM per head (heads are few and fixed; nothing loops over relations).
"""
import inspect
import time

import torch

from . import hetero
from .runtime.state import ORIGINAL
from .runtime.tiebreak import Trial
from .select import TRIAL_MARGIN
from .kernels import typed

PLACES = ("1", "2", "3")


def enumerate_plans():
    return [(("att", a), ("msg", m)) for a in PLACES for m in PLACES]


def plan_name(plan):
    return ", ".join(f"{f}@{hetero.SPACE_NAMES[s]}" for f, s in plan)


def work(plan, sz, H, d):
    """Work by kind (as ``hetero.step_work``) of one plan."""
    w = {"gemm": 0.0, "seg": 0.0, "bdd": 0.0, "sparse": 0.0, "stream": 0.0, "calls": 0.0}
    hd, E = H * d, sz["E"]
    (_, a), (_, m) = plan
    w["seg"] += sz[a] * H * d * d + sz[m] * H * d * d
    w["calls"] += 2 * H + 6
    w["sparse"] += 2 * E * hd                     # the score's two operands, per edge
    w["stream"] += sz[a] * hd                     # gather to the attention's space
    if m == "3":
        w["sparse"] += E * hd + sz["3"] * hd      # SpMM to (v, r) pairs, scatter to N_dst
    else:
        w["stream"] += sz[m] * hd                 # gather to the message's space
        w["sparse"] += E * hd                     # weighted SpMM to N_dst
    return w


def _prune(plans):
    table = {}
    for p in plans:
        costs = []
        for sizes, k_in, _, B in hetero._corners():
            sz = hetero.space_sizes(sizes)
            wk = work(p, sz, B, k_in)
            costs += [sum(rate[k] * wk[k] for k in rate) for rate in hetero._NOMINAL]
        table[p] = costs
    kept, pruned = [], {}
    for p in plans:
        by = next((q for q in plans if q != p and all(a <= b for a, b in zip(table[q], table[p]))
                   and any(a < b for a, b in zip(table[q], table[p]))), None)
        (kept.append(p) if by is None else pruned.__setitem__(p, by))
    return kept, pruned


_PLANS = []


def plans():
    if not _PLANS:
        _PLANS.append(_prune(enumerate_plans()))
    return _PLANS[0]


def plan_cost(plan, sizes, H, d, training):
    wk = work(plan, hetero.space_sizes(sizes), H, d)
    r = hetero.rates()
    return sum(r[k] * wk[k] * (hetero.TRAIN_FACTOR[k] if training else 1.0) for k in r)


# -- running ----------------------------------------------------------------------------------------
def _typed_heads(x, weights, seglen, transpose=False):
    """``out[:, h] = x[:, h] W_{h, r}`` per segment ``r`` (rows sorted by relation)."""
    outs = []
    for h, lin in enumerate(weights):
        w = lin.W.transpose(1, 2).contiguous() if transpose else lin.W
        outs.append(typed.segment_gemm(x[:, h].contiguous(), w, seglen))
    return torch.stack(outs, 1)


def _at_space(idx, x, space):
    """Rows of node features ``x`` (source or destination side) for the rows of ``space``."""
    if space == "2":
        return x.index_select(0, idx.u[idx.order])
    return x.index_select(0, idx.node[space])


def _per_edge(idx, y, space):
    """Rows of ``y`` (rows of ``space``) for every edge, in edge-id order."""
    return y.index_select(0, idx.at[space])


def run_plan(plan, idx, layer, g, k, q, v):
    """``h`` of shape ``(N_dst, H, d)`` before DGL's epilogue."""
    (_, pa), (_, pm) = plan
    r = idx.r
    if pa == "3":
        qp = _typed_heads(_at_space(idx, q, "3"), layer.relation_att, idx.seglen["3"],
                          transpose=True)
        a = (k.index_select(0, idx.u) * _per_edge(idx, qp, "3")).sum(-1)
    else:
        kp = _typed_heads(_at_space(idx, k, pa), layer.relation_att, idx.seglen[pa])
        a = (_per_edge(idx, kp, pa) * q.index_select(0, idx.v)).sum(-1)
    pri = torch.stack(list(layer.relation_pri), 1)                  # (R, H)
    a = a * pri.index_select(0, r) / layer.sqrt_d
    from dgl.ops import edge_softmax
    alpha = edge_softmax(g, a)                                      # (E, H)
    if pm == "3":
        z = typed.move(idx.move("0", "3"), v, alpha)
        z = _typed_heads(z, layer.relation_msg, idx.seglen["3"])
        return typed.move(idx.move("3", "4"), z)
    mp = _typed_heads(_at_space(idx, v, pm), layer.relation_msg, idx.seglen[pm])
    return typed.move(idx.move(pm, "4"), mp, alpha)


def run(plan, idx, layer, g, x, ntype, presorted):
    """DGL's HGTConv forward with the edge part by ``plan`` (same modules, same order)."""
    layer.presorted = presorted
    H, d = layer.num_heads, layer.head_size
    nd = g.num_dst_nodes()
    x_dst, dstntype = (x[:nd], ntype[:nd]) if g.is_block else (x, ntype)
    k = layer.linear_k(x, ntype, presorted).view(-1, H, d)
    q = layer.linear_q(x_dst, dstntype, presorted).view(-1, H, d)
    v = layer.linear_v(x, ntype, presorted).view(-1, H, d)
    h = run_plan(plan, idx, layer, g, k, q, v).reshape(-1, H * d)
    h = layer.drop(layer.linear_a(h, dstntype, presorted))
    alpha = torch.sigmoid(layer.skip[dstntype]).unsqueeze(-1)
    if x_dst.shape != h.shape:
        h = h * alpha + (x_dst @ layer.residual_w) * (1 - alpha)
    else:
        h = h * alpha + x_dst * (1 - alpha)
    if layer.use_norm:
        h = layer.norm(h)
    return h


# -- dispatching ------------------------------------------------------------------------------------
class HGTState(hetero.RelState):
    def explain(self, p):
        m = self.module
        p(f"== layer '{self.name}' ({type(m).__name__}) " + "=" * 40)
        p("  IR: per head, a_e = <k_u W^att_r, q_v> and y_v = sum_e softmax(a)_e v_u W^msg_r over "
          "the chain of index spaces; " f"H = {m.num_heads}, d = {m.head_size}")
        kept, pruned = plans()
        p(f"  compositions: {len(kept) + len(pruned)} enumerated, {len(pruned)} pruned "
          f"input-obliviously, {len(kept)} priced per input")
        for q, by in pruned.items():
            p(f"    pruned  {plan_name(q)}  (dominated by {plan_name(by)})")
        self._explain_decision(p, plan_name)


def _explain_decision(self, p, name):
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
        p(f"    {c * 1e3:9.3f} ms  {name(q)}" + ("  <- chosen" if q == chosen else ""))
    if chosen == ORIGINAL:
        p("  kept DGL's forward (measured fastest)")
    if self.tuned:
        times, kept_label = self.tuned
        p("  measured on the first calls (fastest call): " + ", ".join(
            f"{label} {t * 1e3:.3f} ms" for label, t in times) + f"; kept {kept_label}")
    p("")


HGTState._explain_decision = _explain_decision


class HGTDispatcher(hetero.TypedDispatcher):
    """``forward`` of an optimized ``HGTConv``."""


def _unsupported(layer, g, x, ntype, etype):
    if not hasattr(g, "canonical_etypes") or len(g.canonical_etypes) != 1 \
            or len(g.srctypes) != 1 or len(g.dsttypes) != 1:
        return "HGTConv on a graph with several node or edge types (it takes a homogeneous " \
               "graph with type tensors)"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 \
            or x.device.type != "cpu":
        return "features that are not a float32 CPU matrix"
    if x.shape != (g.num_src_nodes(), layer.in_size):
        return f"features of shape {tuple(x.shape)}"
    for t, n, what in ((ntype, g.num_src_nodes(), "ntype"), (etype, g.num_edges(), "etype")):
        if not isinstance(t, torch.Tensor) or t.shape != (n,) or t.is_floating_point():
            return f"a {what} that is not an integer tensor of one entry per node or edge"
    if any(lin.regularizer is not None for lin in list(layer.relation_att) +
           list(layer.relation_msg)):
        return "relation weights with a regularizer"
    return None


def dispatch(state, options, layer, args, kwargs):
    from dgl.nn.pytorch import HGTConv
    try:
        if type(layer).forward is not HGTConv.forward:
            raise TypeError("a subclass of HGTConv with its own forward")
        b = inspect.signature(HGTConv.forward).bind(layer, *args, **kwargs)
        b.apply_defaults()
        g, x, ntype, etype, presorted = (b.arguments[n] for n in
                                         ("g", "x", "ntype", "etype", "presorted"))
        reason = _unsupported(layer, g, x, ntype, etype)
        if reason is None:
            R = layer.relation_att[0].num_types
            idx = hetero.relational_index(g, etype, R)
            if bool(presorted) not in idx.checks:
                idx.checks[bool(presorted)] = hetero._types_check(idx, presorted)
            reason = idx.checks[bool(presorted)]
    except Exception as e:          # noqa: BLE001
        reason = f"binding the call failed ({type(e).__name__}: {e})"
    if reason is not None:
        state.fallback = reason
        return type(layer).forward(layer, *args, **kwargs)
    state.fallback = None
    grad = torch.is_grad_enabled()
    training = grad and any(p.requires_grad for p in layer.parameters())
    mode = (training, grad and x.requires_grad, torch.get_num_threads())
    per_idx = idx.decisions.setdefault(state, {})
    key = (layer.num_heads, layer.head_size, layer.in_size) + mode
    decision = per_idx.get(key)
    if decision is None:
        decision = per_idx[key] = _decide(state, options, idx, layer, mode, g.is_block)

    def go(plan):
        if plan == ORIGINAL:
            return type(layer).forward(layer, *args, **kwargs)
        state.calls += 1
        return run(plan, idx, layer, g, x, ntype, presorted)

    if isinstance(decision, Trial):
        label, plan = decision.next()[:2]
        t0 = time.perf_counter()
        out = go(plan)
        decision.record(label, time.perf_counter() - t0)
        if decision.settled():
            per_idx[key] = decision.winner()
            state.tuned = (decision.report(), per_idx[key][0])
            state.last = state.last[:3] + (per_idx[key][1],)
        return out
    return go(decision[1])


def _decide(state, options, idx, layer, mode, is_block):
    kept, _ = plans()
    sizes = idx.sizes()
    ranking = sorted(((p, plan_cost(p, sizes, layer.num_heads, layer.head_size, mode[0]))
                      for p in kept), key=lambda t: t[1])
    best = ranking[0]
    state.last = (sizes, mode, ranking, best[0])
    cands = [(plan_name(best[0]), best[0])]
    if len(ranking) > 1 and ranking[1][1] <= TRIAL_MARGIN * best[1]:
        cands.append((plan_name(ranking[1][0]), ranking[1][0]))
    if not (options.tune and not is_block and options.expected_calls > 1
            and not torch.are_deterministic_algorithms_enabled()):
        return cands[0]
    return hetero.FastestTrial(cands + hetero.trial_original(mode))


HGTDispatcher.state_type = HGTState
HGTDispatcher.run = staticmethod(dispatch)
