"""``HeteroGraphConv`` of ``GraphConv`` (and mean ``SAGEConv``) relations as one typed product
per destination type.

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

What takes the relation-by-relation route instead, with the reason in ``explain``: modules other
than ``GraphConv`` and mean ``SAGEConv`` (or subclasses), an activation or normalisation inside a
relation's module, feature dropout in training, an ``edge_weight`` or positional arguments, sizes that differ between relations, weights on some relations only,
``max``/``min``/``stack``/custom aggregation, features that are not float32 CPU matrices of the
sources' row counts.
"""
import functools

import torch

from . import hetero
from .dispatch import TRIAL_MARGIN
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
            and not x.is_cuda and x.shape[0] == rows)


def relation_terms(mod, margs, mkw):
    """``(terms, reason)``: the relation's module as ``{"W": W_r or None, "norm": ...,
    "self": W_self or None, "bias": b_r or None}`` (``Y_r = D^-a A_r D^-b X_s W_r + X_d W_self
    + b_r``), or why it is not that."""
    from dgl.nn.pytorch import GraphConv, SAGEConv
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
    return None, f"a {type(mod).__name__}, not a GraphConv or a mean SAGEConv"


def groups(layer, g, src_inputs, dst_inputs):
    """``({d: [canonical etype]}, reason)``: the relations into each destination type that
    DGL's forward calls, or the reason the container cannot run as typed products."""
    if _aggregation(layer) is None:
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
    sizes = fi.idx.sizes()
    kept = hetero.runnable(hetero.plans_for(None)[0], sizes, lin.in_size, lin.out_size, 1, None)
    if not kept:
        return None, [], None
    ranking = sorted(((p, hetero.plan_cost(p, sizes, lin.in_size, lin.out_size, 1, None,
                                           mode[0])) for p in kept), key=lambda t: t[1])
    best = ranking[0][0]
    if not (tune and mode[0] and len(ranking) > 1 and ranking[1][1] <= TRIAL_MARGIN * ranking[0][1]):
        return best, ranking, None
    cands = [(hetero.plan_name(p), p) for p, _ in ranking[:2]]
    times = hetero.training_times(cands, fi.idx, lin, x, fi.norm)
    label = min(times, key=lambda t: t[1])[0]
    return next(p for lb, p in cands if lb == label), ranking, times


def flat_call(state, layer, g, src_inputs, dst_inputs, mod_args, mod_kwargs, cache, tune):
    """The container's outputs by one typed product per destination type, or ``None`` (with
    ``state.flat_reason`` set) when the relation-by-relation route must run."""
    by_dst, why = groups(layer, g, src_inputs, dst_inputs)
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
    mean = _aggregation(layer) == "mean"
    grad = torch.is_grad_enabled()
    outputs = {}
    for d, cets in by_dst.items():
        terms, k_in, k_out = checked[d]
        weights = [t["W"] for t in terms]
        fi = flat_index(cache, g, cets, [t["norm"] for t in terms])
        x = fi.features(src_inputs)
        if weights[0] is None:
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
            h = h + (biases[0] if len(biases) == 1 else torch.stack(biases).sum(0))
        outputs[d] = h / len(cets) if mean else h
        for cet in cets:
            state.routes[cet] = (f"one typed product with the {len(cets)} relation(s) into "
                                 f"'{d}'" + ("" if plan is None else f": {hetero.plan_name(plan)}"))
    state.flat_calls += 1
    return outputs


def explain(state, p):
    """``explain``'s lines for the typed products of a container."""
    if state.flat_reason:
        p(f"  relations run one by one: {state.flat_reason}")
    for d, (sizes, mode, ranking, chosen, timed, n) in state.flat_info.items():
        p(f"  into '{d}': {n} relation(s) stacked, "
          + " ".join(f"{k}={v}" for k, v in sizes.items())
          + f"  mode: {'training' if mode[0] else 'inference'}")
        for q, c in ranking:
            p(f"    {c * 1e3:9.3f} ms  {hetero.plan_name(q)}" + ("  <- chosen" if q == chosen else ""))
        if timed:
            p("    measured (forward + backward, on the first call; fastest run): "
              + ", ".join(f"{lb} {t * 1e3:.3f} ms" for lb, t in timed))


__all__ = ["flat_call", "groups", "FlatIndex", "StackedWeights", "explain"]
