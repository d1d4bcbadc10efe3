"""``HeteroGraphConv`` of ``GraphConv``, mean ``SAGEConv`` or ``GATConv`` relations as one typed
product per destination type.

DGL's relational GCN over a heterograph (its ``rgcn-hetero`` example, and the tutorial's RGCN)
is a ``HeteroGraphConv`` with one ``GraphConv`` per relation, the weights passed per relation
(``mod_kwargs={rel: {"weight": W_r}}``) or held by the modules. For a destination type ``d``,
each relation ``r = (s, e, d)`` whose source features are given contributes::

    Y_r = D_dst,r^-a A_r D_src,r^-b X_s W_r + b_r

(``norm``: ``"none"`` a = b = 0, ``"right"`` a = 1, ``"left"`` b = 1, ``"both"`` a = b = 1/2,
degrees counted in relation ``r`` and clamped at 1), and the container returns ``sum_r Y_r``
(``aggregate="sum"``) or that sum over the number of relations (``"mean"``). DGL runs every
relation as its own layer: kernel calls grow with the relations.

Stack the source types' features in one ``X`` (the rows of type ``s`` at offset ``o_s``) and the
relations' edges in one graph whose edge ``(u, v)`` of relation ``r`` runs from ``o_s + u`` to
``v``, with type ``r`` and value ``n_e = deg_dst,r(v)^-a deg_src,r(u)^-b``. Then::

    Y = sum_r A'_r X W_r + sum_r b_r

is ``RelGraphConv``'s product (``hetero.run_plan``) on that graph with the ``W_r`` stacked: the
same compositions (``W_r`` per distinct (source, relation) pair, per (destination, relation)
pair after aggregating at ``k_in``, or every node under every relation), priced per input by
``hetero.plan_cost`` and run as a fixed number of kernel calls whatever the number of relations
(without weights: one weighted SpMM). The stacked graph, its edge values and its index are built
once per graph.

A ``SAGEConv`` relation with the mean aggregator is the same product with ``norm="right"`` and
``W_r`` its ``fc_neigh``, plus ``X_d W_self,r + b_r``: summed over the relations, one GEMM of the
destination features with ``sum_r W_self,r``.

``GATConv`` relations (RGAT as users write it) attend per relation: a softmax over the in-edges
of each (destination, relation) pair. On the stacked graph that is one segment GEMM
``Z = X[(u, r) pairs] W_r``, scores per pair and head, and one fused GAT kernel on the graph
between (source, relation) and (destination, relation) pairs, then one scatter-add over the
relations (``gat_product``).

What takes the relation-by-relation route instead, with the reason in ``explain``: modules other
than ``GraphConv``, mean ``SAGEConv`` and ``GATConv`` (or subclasses), an activation,
normalisation or residual inside a relation's module, dropout in training, a GATConv with
separate source and destination weights, an ``edge_weight`` or positional arguments, GATConv
mixed with other modules into one type, sizes that differ between relations, weights on some
relations only,
``max``/``min``/``stack``/custom aggregation, features that are not float32 CPU matrices of the
sources' row counts.
"""
import functools

import torch

from . import hetero
from .select import TRIAL_MARGIN
from .kernels import typed

NORM_EXPONENTS = {"none": (0.0, 0.0), "right": (1.0, 0.0), "left": (0.0, 1.0),
                  "both": (0.5, 0.5)}


class StackedWeights:
    """The relations' ``W_r`` as ``hetero.run_plan`` reads a TypedLinear: ``get_weight()`` is
    ``(R, k_in, k_out)``, stacked at each call so that gradients reach each relation's tensor."""
    regularizer = None
    num_bases = 1

    def __init__(self, weights, k_in, k_out):
        self.weights, self.in_size, self.out_size = weights, k_in, k_out
        self._stacked = None

    def get_weight(self):
        if self._stacked is None:
            self._stacked = torch.stack(self.weights)
        return self._stacked

    def parameters(self):
        return [w for w in self.weights if isinstance(w, torch.Tensor)]


def _aggregation(layer):
    """``"sum"``, ``"mean"``, or ``None`` for any other cross-relation aggregation."""
    from dgl.nn.pytorch import hetero as dh
    agg = layer.agg_fn
    if isinstance(agg, functools.partial) and agg.func is dh._agg_func:
        fn = agg.keywords.get("fn")
        return {dh._sum_reduce_func: "sum", dh._mean_reduce_func: "mean"}.get(fn)
    return None


def _matrix_of(x, rows):
    return (isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.shape[0] == rows)


def relation_terms(mod, margs, mkw):
    """``(terms, reason)``: the relation's module as ``{"W": W_r or None, "norm": ...,
    "self": W_self or None, "bias": b_r or None}`` (``Y_r = D^-a A_r D^-b X_s W_r + X_d W_self
    + b_r``), or why it is not that."""
    from dgl.nn.pytorch import GATConv, GraphConv, SAGEConv
    if margs:
        return None, "positional arguments to the relation's module"
    allowed = {"weight"} if type(mod) is GraphConv else set()
    extra = set(mkw) - allowed
    if extra:
        return None, f"keyword arguments {sorted(extra)} to the relation's module"
    if type(mod) is GraphConv:
        if mod._activation is not None:
            return None, "an activation inside the relation's GraphConv"
        w = mkw.get("weight")
        if w is not None and mod.weight is not None:
            return None, "a weight passed to a GraphConv that has its own (DGL raises)"
        return {"W": mod.weight if w is None else w, "norm": mod._norm, "self": None,
                "bias": mod.bias}, None
    if type(mod) is SAGEConv:
        if mod._aggre_type != "mean":
            return None, f"SAGEConv with the '{mod._aggre_type}' aggregator"
        if mod.activation is not None or mod.norm is not None:
            return None, "an activation or normalisation inside the relation's SAGEConv"
        if mod.training and mod.feat_drop.p > 0:
            return None, "feature dropout inside the relation's SAGEConv in training"
        return {"W": mod.fc_neigh.weight.t(), "norm": "right", "self": mod.fc_self.weight,
                "bias": mod.fc_self.bias}, None
    if type(mod) is GATConv:
        if hasattr(mod, "fc_src"):
            return None, "GATConv with separate source and destination weights"
        if mod.res_fc is not None or mod.activation is not None:
            return None, "a residual or an activation inside the relation's GATConv"
        if mod.training and (mod.feat_drop.p > 0 or mod.attn_drop.p > 0):
            return None, "dropout inside the relation's GATConv in training"
        heads, f = mod._num_heads, mod._out_feats
        bias = mod.bias if getattr(mod, "has_explicit_bias", False) else None
        return {"gat": True, "W": mod.fc.weight.t(), "attn": (mod.attn_l, mod.attn_r),
                "heads": heads, "slope": float(mod.leaky_relu.negative_slope), "norm": "none",
                "self": None, "bias": bias}, None
    return None, f"a {type(mod).__name__}, not a GraphConv, a mean SAGEConv or a GATConv"


def groups(layer, g, src_inputs, dst_inputs, agg):
    """``({d: [canonical etype]}, reason)``: the relations into each destination type that
    DGL's forward calls, or the reason the container (aggregating by ``agg``) cannot run as
    typed products."""
    if agg is None:
        return None, "an aggregation across relations other than sum or mean"
    out = {}
    for cet in g.canonical_etypes:
        s, _, d = cet
        if s in src_inputs and d in dst_inputs:
            out.setdefault(d, []).append(cet)
    return out, None


def _check(layer, g, cets, src_inputs, dst_inputs, mod_args, mod_kwargs):
    """``(terms, k_in, k_out, reason)`` for the relations ``cets`` into one destination type
    (``terms``: ``relation_terms`` of each)."""
    terms, k_in, k_out = [], None, None
    fail = (None, None, None)
    for cet in cets:
        s, e, d = cet
        t, why = relation_terms(layer._get_module(cet), mod_args.get(e, ()), mod_kwargs.get(e, {}))
        if why:
            return (*fail, f"relation {cet}: {why}")
        x, w = src_inputs[s], t["W"]
        if not _matrix_of(x, g.num_src_nodes(s)):
            return (*fail, f"relation {cet}: source features that are not a float32 CPU matrix "
                           "of one row per source node")
        kin = x.shape[1]
        if w is not None and (w.dim() != 2 or w.shape[0] != kin or w.dtype != x.dtype):
            return (*fail, f"relation {cet}: a weight that does not fit the features")
        kout = kin if w is None else w.shape[1]
        if t["self"] is not None and not (
                _matrix_of(dst_inputs[d], g.num_dst_nodes(d))
                and t["self"].shape == (kout, dst_inputs[d].shape[1])):
            return (*fail, f"relation {cet}: destination features that do not fit its fc_self")
        if k_in is None:
            k_in, k_out = kin, kout
        if (kin, kout) != (k_in, k_out):
            return (*fail, "relations of different sizes into one destination type")
        terms.append(t)
    if len({t["W"] is None for t in terms}) > 1:
        return (*fail, "weights on some relations only")
    if any(t.get("gat") for t in terms):
        d = cets[0][2]
        if not all(t.get("gat") for t in terms):
            return (*fail, f"GATConv and other modules into '{d}'")
        if len({(t["heads"], t["slope"]) for t in terms}) > 1:
            return (*fail, f"GATConvs into '{d}' with different heads or slopes")
        if not (_matrix_of(dst_inputs[d], g.num_dst_nodes(d)) and dst_inputs[d].shape[1] == k_in):
            return (*fail, f"destination features of '{d}' that do not fit the GATConvs")
    return terms, k_in, k_out, None


class FlatIndex:
    """The stacked graph of the relations into one destination type (see the module doc):
    ``types`` the source types in ``X``'s order, ``idx`` its ``hetero.RelIndex``, ``norm`` the
    edge values ``(E, 1)`` (``None`` when every relation has ``norm="none"``)."""

    def __init__(self, g, cets, norms):
        import dgl
        self.types = list(dict.fromkeys(s for s, _, _ in cets))
        offset, n = {}, 0
        for s in self.types:
            offset[s], n = n, n + g.num_src_nodes(s)
        d = cets[0][2]
        nd = g.num_dst_nodes(d)
        us, vs, rs, vals = [], [], [], []
        for r, (cet, norm) in enumerate(zip(cets, norms)):
            u, v = g.edges(etype=cet, order="eid")
            u, v = u.long(), v.long()
            a, b = NORM_EXPONENTS[norm]
            val = torch.ones(u.numel())
            if a:
                val = val * torch.bincount(v, minlength=nd).float().clamp(min=1).pow(-a)[v]
            if b:
                ns = g.num_src_nodes(cet[0])
                val = val * torch.bincount(u, minlength=ns).float().clamp(min=1).pow(-b)[u]
            us.append(u + offset[cet[0]])
            vs.append(v)
            rs.append(torch.full((u.numel(),), r, dtype=torch.long))
            vals.append(val)
        u, v, r = torch.cat(us), torch.cat(vs), torch.cat(rs)
        stacked = dgl.create_block((u, v), num_src_nodes=n, num_dst_nodes=nd)
        self.idx = hetero.RelIndex(stacked, r, len(cets))
        self.norm = None if all(m == "none" for m in norms) else torch.cat(vals).reshape(-1, 1)
        self.decisions = {}

    def pairs_graph(self):
        """The graph of the edges between (source, relation) and (destination, relation)
        pairs (one edge per edge), its ``GraphInfo``: attention is a softmax per destination
        pair. Built on first use."""
        if not hasattr(self, "_pairs"):
            import dgl
            from .graph import graph_info
            b = dgl.create_block((self.idx.at["1"], self.idx.at["3"]),
                                 num_src_nodes=self.idx.size["1"],
                                 num_dst_nodes=self.idx.size["3"])
            self._pairs = (b, graph_info(b))
        return self._pairs[1]

    def features(self, src_inputs):
        xs = [src_inputs[s] for s in self.types]
        return xs[0] if len(xs) == 1 else torch.cat(xs)


def flat_index(cache, g, cets, norms):
    key = ("flat", tuple(cets), tuple(norms))
    fi = cache.get(key)
    if fi is None:
        fi = cache[key] = FlatIndex(g, cets, norms)
    return fi


def decide(fi, lin, x, mode, tune):
    """``(plan, ranking, timed)``: the cheapest plan by ``hetero.plan_cost``; in training, when
    the next one is predicted within ``TRIAL_MARGIN``, the two are timed forward + backward on
    this call's input and the faster kept (``timed``: their times)."""
    ranking = hetero.rank_plans(lin, fi.idx.sizes(), mode[0])
    if not ranking:
        return None, [], None
    best = ranking[0][0]
    close = len(ranking) > 1 and ranking[1][1] <= TRIAL_MARGIN * ranking[0][1]
    if not (tune and mode[0] and close):
        return best, ranking, None
    cands = [(hetero.plan_name(p), p) for p, _ in ranking[:2]]
    times = hetero.training_times(cands, fi.idx, lin, x, fi.norm)
    label = min(times, key=lambda t: t[1])[0]
    return next(p for lb, p in cands if lb == label), ranking, times


def gat_product(fi, terms, x, x_d):
    """``sum_r GATConv_r(A_r, (X_s, X_d))`` over the stacked graph, without biases::

        Z = X[(u, r) pairs] W_r               one segment GEMM over the source pairs
        el = <Z_h, a_l,r,h>,  er = X_d[(v, r) pairs] (W_r a_r,r)   (per head)
        O[(v, r)] = sum_{u} softmax_u(lrelu(el + er)) Z[(u, r)]      one fused GAT kernel on
                                                                   the pairs graph
        Y[v] = sum_r O[(v, r)]                one scatter-add

    Result ``(N_dst, H, F)``."""
    from .kernels import native_gat
    idx = fi.idx
    heads = terms[0]["heads"]
    R, k_in = len(terms), x.shape[1]
    w = torch.stack([t["W"] for t in terms])                                 # (R, k_in, H F)
    f = w.shape[2] // heads
    a_l = torch.stack([t["attn"][0].reshape(heads, f) for t in terms])      # (R, H, F)
    a_r = torch.stack([t["attn"][1].reshape(heads, f) for t in terms])
    z = typed.segment_gemm(x.index_select(0, idx.node["1"]), w, idx.seglen["1"])
    z3 = z.view(-1, heads, f)
    el = (z3 * a_l.index_select(0, idx.rel["1"])).sum(-1)                 # (P_src, H)
    w_er = (w.view(R, k_in, heads, f) * a_r.unsqueeze(1)).sum(-1)          # (R, k_in, H)
    er = typed.segment_gemm(x_d.index_select(0, idx.node["3"]), w_er, idx.seglen["3"])
    gat = native_gat.gat_fused_native if native_gat.available() else native_gat.gat_aggregate_dgl
    o = gat(fi.pairs_graph(), el, er, z3, terms[0]["slope"])                # (P_dst, H, F)
    y = typed.move(idx.move("3", "4"), o.reshape(o.shape[0], heads * f))
    return y.view(-1, heads, f)


def flat_call(state, layer, g, src_inputs, dst_inputs, mod_args, mod_kwargs, cache, tune):
    """The container's outputs by one typed product per destination type, or ``None`` (with
    ``state.flat_reason`` set) when the relation-by-relation route must run."""
    agg = _aggregation(layer)
    by_dst, why = groups(layer, g, src_inputs, dst_inputs, agg)
    checked = {}
    for d, cets in (by_dst or {}).items():
        if why:
            break
        terms, k_in, k_out, why = _check(layer, g, cets, src_inputs, dst_inputs, mod_args,
                                         mod_kwargs)
        checked[d] = (terms, k_in, k_out)
    if why:
        state.flat_reason = why
        return None
    state.flat_reason = None
    mean = agg == "mean"
    grad = torch.is_grad_enabled()
    outputs = {}
    for d, cets in by_dst.items():
        terms, k_in, k_out = checked[d]
        weights = [t["W"] for t in terms]
        fi = flat_index(cache, g, cets, [t["norm"] for t in terms])
        x = fi.features(src_inputs)
        if terms[0].get("gat"):
            h = gat_product(fi, terms, x, dst_inputs[d])
            plan = GAT_PLAN
            if d not in state.flat_info:
                state.flat_info[d] = (fi.idx.sizes(), (grad,), [], plan, None, len(cets))
        elif weights[0] is None:
            h = typed.move(fi.idx.move("0", "4"), x, fi.norm)
            plan = None
        else:
            lin = StackedWeights(weights, k_in, k_out)
            training = grad and any(w.requires_grad for w in lin.parameters())
            mode = (training, grad and x.requires_grad, torch.get_num_threads())
            key = (k_in, k_out) + mode
            hit = fi.decisions.get(key)
            if hit is None:
                hit = fi.decisions[key] = decide(fi, lin, x, mode, tune)
                state.flat_info[d] = (fi.idx.sizes(), mode, hit[1], hit[0], hit[2], len(cets))
            plan = hit[0]
            if plan is None:
                state.flat_reason = "no composition fits this machine's memory for this input"
                return None
            h = hetero.run_plan(plan, fi.idx, lin, x, fi.norm)
        selfs = [t["self"] for t in terms if t["self"] is not None]
        if selfs:         # SAGEConv's X_d W_self,r summed over relations: one GEMM
            w_self = selfs[0] if len(selfs) == 1 else torch.stack(selfs).sum(0)
            h = torch.addmm(h, dst_inputs[d], w_self.t())
        biases = [t["bias"] for t in terms if t["bias"] is not None]
        if biases:
            b = biases[0] if len(biases) == 1 else torch.stack(biases).sum(0)
            h = h + b.reshape(h.shape[1:])
        outputs[d] = h / len(cets) if mean else h
        for cet in cets:
            how = "" if plan is None else (
                f": {plan if plan == GAT_PLAN else hetero.plan_name(plan)}")
            state.routes[cet] = (f"one typed product with the {len(cets)} relation(s) into "
                                 f"'{d}'{how}")
    state.flat_calls += 1
    return outputs


GAT_PLAN = "W@(src, rel) pairs, attention per (dst, rel) pair (fused GAT kernel)"


def explain(state, p):
    """``explain``'s lines for the typed products of a container."""
    if state.flat_reason:
        p(f"  relations run one by one: {state.flat_reason}")
    for d, (sizes, mode, ranking, chosen, timed, n) in state.flat_info.items():
        p(f"  into '{d}': {n} relation(s) stacked, "
          + " ".join(f"{k}={v}" for k, v in sizes.items())
          + f"  mode: {'training' if mode[0] else 'inference'}")
        if isinstance(chosen, str):
            p(f"    {chosen}")
        for q, c in ranking:
            mark = "  <- chosen" if q == chosen else ""
            p(f"    {c * 1e3:9.3f} ms  {hetero.plan_name(q)}{mark}")
        if timed:
            p("    measured (forward + backward, on the first call; fastest run): "
              + ", ".join(f"{lb} {t * 1e3:.3f} ms" for lb, t in timed))


__all__ = ["flat_call", "groups", "FlatIndex", "StackedWeights", "explain"]
