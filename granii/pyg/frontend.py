"""Frontend for PyG layers: the installed source of a ``MessagePassing`` layer -> the matrix IR.

The interpreter is DGL's frontend (``granii.frontend.interp.Interpreter``) with PyG's calls added
as rules, not a table of layer classes:

    forward(x, edge_index, edge_weight=None, ...)   ``x`` is the features ``H`` (N x k_in),
                                                    ``edge_index`` the graph, a 1-D tensor of one
                                                    value per edge an edge-value argument, an
                                                    E x k tensor edge features (``edge_attr``: a
                                                    leaf of ``E`` rows; the plan holds while its
                                                    width is, or is not, the features')
    add_self_loops / add_remaining_self_loops       the graph with a self loop on every node
                                                    (``graph.derived``), edge values carried
    degree(index) / scatter(w, index, reduce='sum') per-node (weighted) edge counts
    deg.pow(p), deg[deg == inf] = 0, deg[row]       powers, masks and gathers per edge
    torch.ones((edge_index.size(1),))               ones per edge
    Linear (PyG's, as torch's nn.Linear)            ``x W^T + b``
    a torch_geometric function (``gcn_norm``)       its source, read like forward
    self.propagate(edge_index, **kwargs)            ``message`` read with ``x_j`` the rows of
                                                    ``x`` at the sources, then the aggregation
                                                    of ``self.aggr_module`` ('sum'/'add', 'mean',
                                                    'max'), then ``update`` if overridden; on a
                                                    sparse adjacency, ``message_and_aggregate``
                                                    as PyG runs it
    spmm(adj_t, x, reduce)                          ``A_w X`` (sum), ``D_in^-1 A_w X`` (mean),
                                                    the adjacency's values as ``w``
    remove_self_loops, then add_self_loops          the graph ``add_remaining_self_loops`` makes
                                                    (the other edges in order, one loop per node)
    lin(x).view(-1, H, C), (x * self.att).sum(-1)   features split into heads, scores per head
                                                    (``x W a_h``, as DGL's GATConv lowers)
    self.edge_updater(edge_index, alpha=...)        ``edge_update`` read with ``alpha_j`` /
                                                    ``alpha_i`` the rows at the sources / targets:
                                                    ``alpha_j + alpha_i`` an SDDMM, pure functions
                                                    (``F.leaky_relu``), ``softmax(alpha, index)``
                                                    over each target's in-edges, ``F.dropout``:
                                                    attention values, one per edge and head
    alpha.unsqueeze(-1) * x_j                       messages weighted per edge and head: the
                                                    sparse operand ``A[alpha]`` of the heads
    x_j + edge_attr, x_i + x_j (N x H x F rows),    per-edge features ``act(sum_i P_i[side_i])``
    .relu(), F.relu, F.leaky_relu(., slope)         (``values.EdgeFeat``): the IR's ``EdgeMessage``
    message returning edge features                 summed (or averaged) over each target's
                                                    in-edges: ``EdgeSum`` (GINEConv)
    (edge features * self.att).sum(-1)              per-head scores ``EdgeMessage . blockdiag(a)``;
                                                    ``softmax`` of them as of ``alpha`` (GATv2Conv)
    remove_self_loops / add_self_loops(edge_attr,   the edge features carried to the graph with
        fill_value)                                 one loop per node (``values.EdgeAttr``: the
                                                    kept edges' rows, then a number, or the mean /
                                                    sum of each node's in-edges' rows)
    a and b / a or b                                as Python: the first operand that decides
    x_j.size(-1) != edge_attr.size(-1)              widths as size symbols (``values.Width``)
    out.view(-1, H * C) / out.mean(dim=1)           heads side by side, or their mean (a pure
                                                    function of each row)

The messages ``c * w_e * prod_i d_i[side_i(e)] * x_j`` aggregate to a product of the IR:

    sum:  diag(d_dst) A_w diag(d_src) X      degree vectors as the IR's degree leaves when they
                                             are counts (unweighted) that are >= 1 wherever they
                                             are read; otherwise the per-edge values are
                                             computed at the call (``bind.edge_values``) and the
                                             product is ``A_v X`` with those values
    mean: D_in^-1 (the sum)                  (PyG divides by the number of messages, at least 1)
    max:  amax(A, X)                         (plain ``x_j`` messages only; ``kernels.py``)

Every propagate of a layer must run on one graph (the same self loops). Anything else raises
``FrontendError`` naming the construct (LSTM or multi aggregations, messages of ``x_i`` times
values, an MLP over message features, a max of edge-feature messages, edge dropout in training,
GATConv's scores of edge features added to its SDDMM, ``return_attention_weights``, ...): the
layer's own forward then runs.

Attention dropout draws as PyG draws it: one ``F.dropout`` on the (E', heads) values, E' in
PyG's edge order (the input's edges without loops, then one loop per node: the order of the
derived graph), at the place of the source; the fused plans draw the same mask on ones. On a
sparse adjacency with loops added PyG's order is the new matrix's, so dropout in training
there is refused.
"""
import ast
import dataclasses
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import ir
from ..kernels.dropout import is_dropout
from ..kernels.spmm import csr_tensor
from ..runtime.state import is_pyg_layer
from . import kernels  # noqa: F401  (registers spmm_amax)
from ..frontend import LayerIR, _check_complete
from ..frontend import rules, udf
from ..frontend.interp import _SYMBOLIC, Interpreter, forward_ast, source_segment
from ..frontend.ops import apply, linear
from ..frontend.values import FrontendError, GraphCondition, Method, RaisesForConfig, Tensor
from ..frontend.values import Degrees
from .values import (PYG_VALUES, Attention, DegVec, EdgeAttr, EdgeCount, EdgeFeat, EdgeVal,
                     EdgeW, Gathered, Message, NodeIndex, PygGraph, Width)

__all__ = ["PygIR", "lower_pyg", "is_pyg_layer", "FrontendError"]

_UNSET = object()


@dataclass
class PygIR:
    """A PyG layer lowered for one call signature: the frontend's ``LayerIR`` and what binding
    a call needs beyond it."""
    layer_ir: LayerIR
    feat: str                      # forward's feature parameter
    graph: str                     # forward's graph parameter
    kind: str                      # the graph input: edge_index, EdgeIndex, adj_t
    how: str                       # self loops the propagates' graph has (None, add, remaining)
    edge_values: dict = field(default_factory=dict)   # leaf argument name -> EdgeVal
    messages: tuple = ()           # widths (size symbols) of the messages PyG's own forward
                                   # writes, one row per edge, for each unfused propagate


def lower_pyg(module, values, kind):
    """The ``PygIR`` of ``module``'s forward called with ``values`` (parameter -> value, defaults
    filled); ``kind`` is the graph input's kind (``graph.input_kind``)."""
    func_def, globals_, src = forward_ast(type(module))
    params = [a.arg for a in func_def.args.args][1:]
    if len(params) < 2:
        raise FrontendError("forward signature", "expected forward(self, x, edge_index, ...)")
    if func_def.args.vararg or func_def.args.kwarg:
        raise FrontendError("forward(*args, **kwargs)", "variable arguments are not lowered")
    feat, gname = params[0], params[1]
    graph = PygGraph(kind)
    num_edges = values[gname].shape[1] if kind != "adj_t" else values[gname]._nnz()
    bound = {func_def.args.args[0].arg: module, gname: graph,
             feat: Tensor(ir.Leaf("H", "N", "k_in", ir.DENSE, ir.DATA, ("arg", feat)))}
    present, edge_feats = set(), []
    for name in params[2:]:
        v = values.get(name)
        if isinstance(v, torch.Tensor):
            if v.dim() in (1, 2) and v.shape[0] == num_edges and v.numel() == num_edges \
                    and kind != "adj_t":
                bound[name] = EdgeVal(graph, EdgeW(name))
            elif v.dim() == 2 and v.shape[0] == num_edges and kind != "adj_t":
                same = v.shape[1] == values[feat].shape[-1]
                bound[name] = Tensor(ir.Leaf(name, "E", "k_in" if same else "k_edge", ir.DENSE,
                                             ir.DATA, ("arg", name)))
                edge_feats.append((f"{name}.shape[-1] == {feat}.shape[-1]", sorted({name, feat}),
                                   same))
            else:
                raise FrontendError(f"tensor argument '{name}' of shape {tuple(v.shape)}",
                                    "only one value or one feature vector per edge (edge_weight, "
                                    "edge_attr) of an edge_index is lowered")
            present.add(name)
        else:
            bound[name] = v
    if values.get("return_attention_weights") is not None:
        # PyG returns them whenever the argument is set, even to False
        raise FrontendError("return_attention_weights", "the plans never materialise the "
                            "attention values per edge (the fused kernel keeps them per row)")
    interp = PygInterpreter(module, func_def, globals_, src, values, kind)
    interp.spec.extend(edge_feats)      # a plan holds while the edge features' width does
    for name in params[2:]:
        if isinstance(bound.get(name), Tensor):
            interp.edge_how[bound[name].node] = None
    try:
        out = interp.run(bound)
        if not isinstance(out, Tensor):
            raise FrontendError("return value", f"forward returns {type(out).__name__}, "
                                "not a tensor")
        if out.ndim != 2:
            raise FrontendError("output", "of more than 2 dimensions")
        _check_complete(out.node)
    except (FrontendError, RaisesForConfig) as e:
        e.spec, e.config = interp.spec, interp.config
        raise
    if interp.how is _UNSET:         # no propagate (SGConv reading its cache): no graph work
        interp.how = None
    lir = LayerIR(type(module).__name__, ir.rewrite_row_broadcasts(out.node), out.node,
                  interp.guards, tuple(params), frozenset(present), src, interp.spec,
                  interp.config, None, ())
    return PygIR(lir, feat, gname, kind, interp.how, interp.edge_values, tuple(interp.messages))


class PygInterpreter(Interpreter):
    """``Interpreter`` with PyG's calls (see the module docstring)."""

    def __init__(self, module, func_def, globals_, src, real, kind):
        super().__init__(module, func_def, globals_, src, False, real)
        self.kind = kind
        self.graph_name = [a.arg for a in func_def.args.args][2]
        self.how = _UNSET                 # self loops of the graph the propagates run on
        self.edge_values = {}
        self.head_means = set()           # Apply nodes of a mean over heads (N x C, not H C)
        self.edge_how = {}                # edge feature leaf -> the self loops of its graph
        self.messages = []                # widths of the messages unfused propagates write

    def _narrowed(self, n):
        """``n`` is a mean over heads, or a sum whose left operand is one."""
        while isinstance(n, ir.Add):
            n = n.a
        return n in self.head_means

    def edge_graph_how(self, node, e):
        """The self loops of the graph whose edges the rows of ``node`` (E x k) belong to."""
        hows = {self.edge_how[leaf] for leaf in ir.leaves(node) if leaf in self.edge_how}
        if len(hows) != 1:
            self.fail(e, "a tensor of one row per edge", "not computed from one edge feature "
                      "argument")
        return hows.pop()

    def is_edge_rows(self, v):
        return isinstance(v, Tensor) and v.node.rows == "E"

    def edge_feat_sum(self, a, b, e):
        """``a + b`` of per-edge features, node rows gathered at the edges (``x_j``, ``x_i``) and
        tensors of one row per edge: an ``EdgeFeat`` on the graph of the gathered rows."""
        terms = []
        for v in (a, b):
            if isinstance(v, EdgeFeat):
                if v.act is not None:
                    self.fail(e, "a sum of activated edge features", "not lowered")
                terms.append(v)
            elif isinstance(v, Gathered):
                terms.append(EdgeFeat(v.graph, ((v.x.node, v.side),), v.x.ndim))
            else:
                terms.append(None)
        graph = next(t.graph for t in terms if t is not None)
        parts = []
        for v, t in zip((a, b), terms):
            if t is not None:
                if t.graph is not graph:
                    self.fail(e, "a sum of edge features of two graphs", "not lowered")
                parts += t.parts
                continue
            if self.edge_graph_how(v.node, e) != graph.how:
                self.fail(e, "edge features of a graph with other self loops than the "
                          "propagation's", "not lowered")
            parts.append((v.node, "edge"))
        return EdgeFeat(graph, tuple(parts), max(t.ndim if t is not None else v.ndim
                                                 for v, t in zip((a, b), terms)))

    def expr_BoolOp(self, e):
        """``a and b`` / ``a or b`` as Python evaluates them: a known operand that decides is
        the value and the operands after it are not read (``self.lin is None and
        x_j.size(-1) != edge_attr.size(-1)``); after a symbolic one, a condition."""
        symbolic = False
        for v in e.values:
            val = self.eval(v)
            if isinstance(val, _SYMBOLIC) or isinstance(val, PYG_VALUES):
                symbolic = True
            elif not symbolic and (not val if isinstance(e.op, ast.And) else val):
                return val
        if symbolic:
            return GraphCondition(source_segment(self.src, e) or "condition")
        return val

    # -- expressions ---------------------------------------------------------------------------
    def call(self, func, args, kwargs, e):
        rule = _pyg_rule(self, func, args, kwargs)
        if rule is not None:
            return _call_rule(self, rule, func, args, kwargs, e)
        if isinstance(func, Method) and func.name == "size" and self.is_edge_rows(func.obj) \
                and list(args) in ([-1], [func.obj.ndim - 1]) and not kwargs:
            return Width(func.obj.node.cols)
        if isinstance(func, Method) and isinstance(func.obj, Tensor) and func.obj.ndim == 3 \
                and self.heads and func.name in ("view", "reshape", "mean"):
            return self.merge_heads(func.obj, func.name, args, kwargs, e)
        try:
            if isinstance(func, Method):
                return rules.call_method(self, func, args, kwargs, e)
            return rules.call_function(self, func, args, kwargs, e)
        except (TypeError, AttributeError, ValueError, RuntimeError, IndexError) as err:
            if not _holds_pyg(list(args) + list(kwargs.values())):
                raise
            self.fail(e, f"'{ast.unparse(e)}'", f"a call on PyG's per-edge or per-node values "
                      f"that is not lowered ({type(err).__name__})")

    def merge_heads(self, x, name, args, kwargs, node):
        """``out.view(-1, H * C)`` of (N, H, C) features: the IR's N x (H C) matrix as it is;
        ``out.mean(dim=1)``: the mean over the heads, a function of each row (N x C)."""
        heads, width = self.heads
        if name in ("view", "reshape"):
            shape = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) \
                else list(args)
            if len(shape) == 2 and shape[0] == -1 and shape[1] in (heads * width, -1):
                return Tensor(x.node, 2)
            return rules.tensor_view(self, x, args, node)
        dim = kwargs.get("dim", args[0] if args else None)
        if dim in (1, -2) and not kwargs.get("keepdim", args[1] if len(args) > 1 else False) \
                and set(kwargs) <= {"dim", "keepdim"} and len(args) <= 2:
            out = apply(self, f"mean_heads({heads})", x.node, ("function", HeadMean(heads)),
                        pure=True)
            self.head_means.add(out)
            return Tensor(out, 2)
        self.fail(node, f"(N, heads, C) features.mean({dim!r})", "only the mean over the heads "
                  "(dim=1) is lowered")

    def binop(self, op, a, b, node):
        if isinstance(op, ast.Add) and isinstance(a, Tensor) and isinstance(b, Tensor) and \
                self._narrowed(a.node) and isinstance(b.node, ir.Leaf) and b.node.rows is None:
            # the bias after a mean over heads: as wide as one head, its own size symbol
            used = {sym for leaf in self.leaves.values() for sym in (leaf.rows, leaf.cols)}
            cols = next(f"k_head{i or ''}" for i in range(99) if f"k_head{i or ''}" not in used)
            fixed = dataclasses.replace(b.node, rows="1", cols=cols)
            self.leaves[fixed.name] = fixed
            return Tensor(ir.Add(a.node, fixed), 2)
        if isinstance(op, ast.Add) and any(isinstance(v, (Gathered, EdgeFeat)) for v in (a, b)) \
                and all(isinstance(v, (Gathered, EdgeFeat)) or self.is_edge_rows(v)
                        for v in (a, b)) and not (isinstance(a, Gathered) and
                                                  isinstance(b, Gathered)):
            return self.edge_feat_sum(a, b, node)
        if isinstance(op, ast.Mult) and isinstance(a, EdgeFeat) and isinstance(b, Tensor):
            return rules.binop(self, "Mult", Tensor(a.node(), a.ndim), b, node)
        if isinstance(op, ast.Mult) and isinstance(b, EdgeFeat) and isinstance(a, Tensor):
            return rules.binop(self, "Mult", a, Tensor(b.node(), b.ndim), node)
        if isinstance(a, Attention) and self.is_edge_rows(b) or \
                isinstance(b, Attention) and self.is_edge_rows(a):
            self.fail(node, "attention scores plus scores of edge features (edge_attr with "
                      "edge_dim)", "a sum of an SDDMM and per-edge scores is not in the IR")
        if isinstance(a, PYG_VALUES) or isinstance(b, PYG_VALUES):
            try:
                return super().binop(op, a, b, node)
            except (TypeError, AttributeError) as err:
                self.fail(node, f"'{ast.unparse(node)}'", f"operator {type(op).__name__} on "
                          f"{type(a).__name__} and {type(b).__name__} is not lowered ({err})")
        return super().binop(op, a, b, node)

    def stmt_AnnAssign(self, s):          # ``res: Optional[Tensor] = None``
        if s.value is not None:
            self.assign(s.target, self.eval(s.value))

    def assign(self, target, value):
        if isinstance(target, ast.Attribute) and _holds_pyg([value]) and \
                self.eval(target.value) is self.module:
            # ``self._cached_edge_index = (edge_index, edge_weight)``: a cache of the normalised
            # graph; granii keeps its own per graph, and reads the graph given at each call
            return
        if isinstance(target, ast.Subscript):
            obj = self.eval(target.value)
            if isinstance(obj, DegVec):
                obj[self.eval(target.slice)] = value
                return
        super().assign(target, value)

    def expr_Attribute(self, e):
        obj = self.eval(e.value)
        if isinstance(obj, Tensor) and e.attr in ("dtype", "device"):
            return torch.float32 if e.attr == "dtype" else torch.device("cpu")
        if isinstance(obj, PYG_VALUES):
            try:
                return getattr(obj, e.attr)
            except AttributeError:
                self.fail(e, f"'{ast.unparse(e)}'", f"attribute of {type(obj).__name__} not "
                          "lowered")
        return super().expr_Attribute(e)


class HeadMean:
    """``x.view(n, H, -1).mean(1)`` of an n x (H C) matrix: the mean over ``H`` heads (PyG's
    ``concat=False``); equal for equal ``H``, so equal code lowers to equal IR."""

    def __init__(self, heads):
        self.heads = heads

    def __call__(self, x):
        return x.view(x.shape[0], self.heads, -1).mean(1)

    def __eq__(self, other):
        return isinstance(other, HeadMean) and other.heads == self.heads

    def __hash__(self):
        return hash(("HeadMean", self.heads))

    def __repr__(self):
        return f"HeadMean({self.heads})"


def _attr_of(it, func):
    path = rules._module_path(it, func)
    return f"self.{path}" if path else type(func).__name__


def _holds_pyg(values):
    for v in values:
        if isinstance(v, PYG_VALUES):
            return True
        if isinstance(v, (list, tuple)) and _holds_pyg(v):
            return True
    return False


# -- rules ------------------------------------------------------------------------------------------
def _pyg_rule(it, func, args, kwargs):
    """The rule for a call, or ``None`` for the frontend's own rules."""
    if func is isinstance and args and isinstance(args[0], PygGraph):
        return "isinstance"
    if getattr(func, "__self__", None) is it.module and \
            getattr(func, "__name__", None) == "propagate":
        return "propagate"
    if getattr(func, "__self__", None) is it.module and \
            getattr(func, "__name__", None) == "edge_updater":
        return "edge_updater"
    if func is torch.ones and args and (isinstance(args[0], EdgeCount) or (
            isinstance(args[0], (tuple, list)) and args[0] and isinstance(args[0][0], EdgeCount))):
        return "ones"
    if isinstance(func, nn.Module) and type(func).__name__ == "Linear" and \
            type(func).__module__.startswith("torch_geometric") and args and \
            isinstance(args[0], Tensor):
        return "linear"
    if isinstance(func, nn.Module) and args and isinstance(args[0], (EdgeVal, Attention)):
        return "linear_of_edges"
    if is_dropout(func) and args and isinstance(args[0], Attention):
        return "dropout"
    if args and isinstance(args[0], Attention) and udf.pure_ref(func, args, kwargs):
        return "attention_function"            # F.leaky_relu(alpha, self.negative_slope)
    if args and isinstance(args[0], EdgeFeat):
        return "edge_feature_function"         # F.leaky_relu(x_i + x_j, self.negative_slope)
    mod = getattr(func, "__module__", "") or ""
    if mod.startswith("torch_geometric") and getattr(func, "__name__", None) in _UTILS:
        return func.__name__
    return None


def _call_rule(it, rule, func, args, kwargs, node):
    if rule == "isinstance":
        return _graph_isinstance(args[0], args[1])
    if rule == "propagate":
        return propagate(it, args, kwargs, node)
    if rule == "edge_updater":
        return edge_updater(it, args, kwargs, node)
    if rule == "dropout":
        return _attention_dropout(it, args, kwargs, node)
    if rule == "attention_function":
        ref = udf.pure_ref(func, args, kwargs)
        return Attention(args[0].graph, apply(it, ref[0], args[0].node, ref[1], pure=True))
    if rule == "edge_feature_function":
        return _edge_activation(it, func, args, kwargs, node)
    if rule == "linear_of_edges":
        it.fail(node, f"{_attr_of(it, func)}(edge_attr): a Linear of edge attributes "
                "(edge_dim)", "edge feature vectors are not in the IR (its edge values are one "
                "number per edge and head)")
    if rule == "ones":
        shape = args[0] if isinstance(args[0], EdgeCount) else args[0]
        if not isinstance(shape, EdgeCount) and tuple(shape[1:]) not in ((), (1,)):
            it.fail(node, "torch.ones of more than one value per edge", "not lowered")
        count = shape if isinstance(shape, EdgeCount) else shape[0]
        return EdgeVal(count.graph)
    if rule == "linear":
        w = getattr(func, "weight", None)
        if isinstance(w, nn.parameter.UninitializedParameter):
            it.fail(node, "a lazy Linear (in_channels=-1) not yet initialised", "run the model "
                    "once before granii")
        return linear(it, func, args[0], node)
    return _UTILS[rule](it, args, kwargs, node)


def _edge_activation(it, func, args, kwargs, node):
    """ReLU or leaky ReLU (constant slope) of per-edge features: the messages' activation."""
    ref = udf.pure_ref(func, args, kwargs)
    slope = udf.leaky_relu_slope(ref[1]) if ref else None
    if slope is not None:
        return args[0].activated(("leaky_relu", slope))
    if ref and ref[1] in (("function", torch.relu), ("function", torch.nn.functional.relu)):
        return args[0].activated("relu")
    it.fail(node, f"{getattr(func, '__name__', func)} of per-edge features", "only relu and "
            "leaky_relu are lowered")


def _graph_isinstance(g, cls):
    """``isinstance(edge_index, cls)`` for the kind of graph input this call has."""
    if g.kind == "adj_t":
        rep = csr_tensor(torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                         torch.zeros(0), (0, 0))
    else:
        rep = torch.zeros(2, 0, dtype=torch.long)
        if g.kind == "EdgeIndex":
            from torch_geometric import EdgeIndex
            rep = EdgeIndex(rep)
    return isinstance(rep, cls)


def _args(names, args, kwargs, defaults):
    given = dict(zip(names, args))
    given.update(kwargs)
    for n, d in defaults.items():
        given.setdefault(n, d)
    return given


def _loops(how):
    def rule(it, args, kwargs, node):
        a = _args(("edge_index", "edge_attr", "fill_value", "num_nodes"), args, kwargs,
                  {"edge_attr": None, "fill_value": None, "num_nodes": None})
        g, attr, fill = a["edge_index"], a["edge_attr"], a["fill_value"]
        name = "add_self_loops" if how == "add" else "add_remaining_self_loops"
        if not isinstance(g, PygGraph):
            it.fail(node, f"{name} of a graph that is not the call's", "not lowered")
        if isinstance(attr, Tensor) and g.how == "removed" and how == "add":
            # remove_self_loops, then add_self_loops of edge features (GATv2's edge_attr)
            new = PygGraph(g.kind, "remaining")
            return new, _edge_features(it, attr, new, _fill(it, fill, node), node)
        if g.how == "removed" and attr is None:
            # remove_self_loops, then add_self_loops (GATConv): every edge that is not a loop,
            # in order, then one loop per node: the graph add_remaining_self_loops makes
            return PygGraph(g.kind, "remaining"), None
        if g.kind == "adj_t":
            it.fail(node, f"{name} of a sparse adjacency", "not lowered")
        if g.how is not None:
            it.fail(node, f"{name} on a graph that has self loops added or removed",
                    "not lowered")
        new = PygGraph(g.kind, how)
        if attr is None:                  # fill_value only fills edge values
            return new, None
        if fill is None:
            fill = 1.0
        if not isinstance(fill, (int, float)) or isinstance(fill, bool):
            it.fail(node, f"{name} with fill_value={fill!r}", "only a number is lowered")
        if not isinstance(attr, EdgeVal) or attr.gathers or attr.const != 1 or \
                attr.weight is None:
            it.fail(node, f"{name} of computed edge values", "only of an edge-weight argument")
        return new, EdgeVal(new, EdgeW(attr.weight.arg, how, float(fill)))
    return rule


def _remove_loops(it, args, kwargs, node):
    """``remove_self_loops(edge_index, edge_attr=None)``: the graph without its self loops (the
    other edges in order); ``add_self_loops`` of it is the graph with one loop per node."""
    a = _args(("edge_index", "edge_attr"), args, kwargs, {"edge_attr": None})
    g, attr = a["edge_index"], a["edge_attr"]
    if not isinstance(g, PygGraph) or g.how is not None:
        it.fail(node, "remove_self_loops of a graph that is not the call's", "not lowered")
    if isinstance(attr, Tensor) and g.kind != "adj_t":
        new = PygGraph(g.kind, "removed")
        return new, _edge_features(it, attr, new, None, node)
    if attr is not None:
        it.fail(node, "remove_self_loops of edge values", "only of the graph alone (GATConv "
                "reads its edge_attr only with edge_dim, which is not lowered)")
    return PygGraph(g.kind, "removed"), None


def _fill(it, fill, node):
    """``fill_value`` of self loops' edge features: a number, or the reduction of each node's
    in-edges' features PyG names ('mean', 'add'/'sum')."""
    if fill is None:
        return 1.0
    if isinstance(fill, (int, float)) and not isinstance(fill, bool):
        return float(fill)
    if fill in ("mean", "add", "sum"):
        return fill
    it.fail(node, f"add_self_loops of edge features with fill_value={fill!r}", "only a number, "
            "'mean', 'add' or 'sum' is lowered")


def _edge_features(it, attr, graph, fill, node):
    """The edge feature argument ``attr`` (E x k) carried to ``graph`` (self loops removed, then
    one loop per node with ``fill``): a leaf computed at each call (``bind.edge_features``)."""
    leaf = attr.node
    arg = None
    if isinstance(leaf, ir.Leaf) and leaf.rows == "E" and leaf.source[0] == "arg":
        arg = leaf.source[1]
    elif isinstance(leaf, ir.Leaf) and leaf.source[0] == "edge" and \
            isinstance(it.edge_values.get(leaf.source[1]), EdgeAttr):
        arg = it.edge_values[leaf.source[1]].arg         # self loops removed, now added
    if arg is None:
        it.fail(node, "self loops of computed edge features", "only of an edge feature "
                "argument")
    spec = EdgeAttr(arg, graph.how, fill)
    key = f"{spec.arg}_{graph.how}" + (f"_{fill}" if graph.how == "remaining" else "")
    key = key.replace(".", "_").replace("-", "m")
    it.edge_values[key] = spec
    new = it.leaf(key, "E", leaf.cols, ir.DENSE, ir.DATA, ("edge", key))
    it.edge_how[new] = graph.how
    return Tensor(new, 2)


def _softmax(it, args, kwargs, node):
    """PyG's ``softmax(src, index, ptr, num_nodes)`` of attention values over the edges of each
    target (``index`` = ``edge_index[1]``, or the CSR ``ptr`` of the same grouping): the IR's
    ``EdgeSoftmax``. (PyG adds 1e-16 to the sum, granii's kernels do not: a relative
    difference of 1e-16.)"""
    a = _args(("src", "index", "ptr", "num_nodes", "dim"), args, kwargs,
              {"index": None, "ptr": None, "num_nodes": None, "dim": 0})
    src, index = a["src"], a["index"]
    if it.is_edge_rows(src) and isinstance(index, NodeIndex) and src.ndim == 2:
        src = Attention(index.graph, src.node)     # scores of edge features (GATv2's)
    if not isinstance(src, Attention):
        it.fail(node, "softmax of values that are not attention scores of edges", "not lowered")
    if not isinstance(index, NodeIndex) or index.side != "dst" or \
            index.graph.how != src.graph.how or a["dim"] not in (0, -2):
        it.fail(node, "softmax grouped by anything but each edge's target", "not lowered")
    return Attention(src.graph, ir.EdgeSoftmax(src.node))


def _attention_dropout(it, args, kwargs, node):
    """``F.dropout(alpha, p, training)`` of attention values: the identity when not training
    or ``p == 0``, else one draw on the (E', heads) values in the graph's edge order (the plans
    keep PyG's: the input's edges, then the added loops). On a sparse adjacency with self loops
    added PyG's order is that of the new sparse matrix, which granii's graph does not keep:
    refused, so that a seeded run draws PyG's mask."""
    given = _args(("input", "p", "training", "inplace"), args, kwargs,
                  {"p": 0.5, "training": True, "inplace": False})
    x, p, training = given["input"], given["p"], given["training"]
    if given["inplace"] or not isinstance(p, (int, float)) or not isinstance(training, bool):
        it.fail(node, "F.dropout of attention values", "only with a known p and training flag")
    if p == 0 or not training:
        return x
    if x.graph.kind == "adj_t" and x.graph.how is not None:
        it.fail(node, "attention dropout in training on a sparse adjacency with self loops "
                "added", "PyG draws the mask in the entry order of the new sparse matrix, "
                "which granii's graph does not keep")
    return Attention(x.graph, apply(it, f"dropout({p:g})", x.node, ("dropout", float(p))))


def _scatter(it, args, kwargs, node):
    a = _args(("src", "index", "dim", "dim_size", "reduce"), args, kwargs,
              {"dim": 0, "dim_size": None, "reduce": "sum"})
    src, index = a["src"], a["index"]
    if a["reduce"] not in ("sum", "add") or a["dim"] not in (0, -1) or \
            not isinstance(src, EdgeVal) or not isinstance(index, NodeIndex):
        it.fail(node, f"scatter(..., reduce={a['reduce']!r})", "only the sum of per-edge values "
                "at edge_index[0] or edge_index[1] is lowered (a degree)")
    if src.graph.how != index.graph.how:
        it.fail(node, "scatter of the values of one graph at the nodes of another", "not lowered")
    return DegVec(index.graph, index.side, None if src.ones else src)


def _degree(it, args, kwargs, node):
    index = args[0] if args else kwargs.get("index")
    if not isinstance(index, NodeIndex):
        it.fail(node, "degree of a tensor", "only of edge_index[0] or edge_index[1]")
    return DegVec(index.graph, index.side)


def _maybe_num_nodes(it, args, kwargs, node):
    n = args[1] if len(args) > 1 else kwargs.get("num_nodes")
    return n if n is not None else GraphCondition("num_nodes")


def _is_sparse(it, args, kwargs, node):
    x = args[0]
    return isinstance(x, PygGraph) and x.kind == "adj_t"


def _spmm(it, args, kwargs, node):
    """``spmm(adj_t, x, reduce)`` of the sparse adjacency (its values as edge weights): sum
    ``A_w X``, mean ``D_in^-1 A_w X`` (torch's CSR mean: the weighted sum over the row's
    entries, divided by their number)."""
    a = _args(("src", "other", "reduce"), args, kwargs, {"reduce": "sum"})
    g, x, reduce = a["src"], a["other"], a["reduce"]
    if not isinstance(g, PygGraph) or g.kind != "adj_t" or g.how is not None or \
            not isinstance(x, Tensor) or x.ndim != 2 or x.node.rows != "N":
        it.fail(node, "spmm", "only of the sparse adjacency argument and N x k features")
    if reduce not in ("sum", "add", "mean"):
        it.fail(node, f"spmm(..., reduce={reduce!r}) of a sparse adjacency", "only sum and mean "
                "are lowered")
    if it.how is _UNSET:
        it.how = None
    adj = _edge_leaf(it, EdgeVal(g, EdgeW(it.graph_name)))
    factors = [adj] if reduce != "mean" else [Degrees("in", -1.0, 1.0).leaf("N"), adj]
    return Tensor(ir.matmul(*factors, x.node), 2)


def _unsupported(what):
    def rule(it, args, kwargs, node):
        it.fail(node, what, "not lowered")
    return rule


_UTILS = {
    "add_self_loops": _loops("add"),
    "add_remaining_self_loops": _loops("remaining"),
    "scatter": _scatter,
    "degree": _degree,
    "maybe_num_nodes": _maybe_num_nodes,
    "is_torch_sparse_tensor": _is_sparse,
    "is_sparse": _is_sparse,
    "spmm": _spmm,
    "to_edge_index": _unsupported("to_edge_index of a sparse adjacency"),
    "set_sparse_value": _unsupported("set_sparse_value of a sparse adjacency"),
    "softmax": _softmax,
    "remove_self_loops": _remove_loops,
    "dropout_edge": _unsupported("dropout_edge"),
}


# -- propagate ----------------------------------------------------------------------------------------
_INDEX_ARGS = ("index", "ptr", "size", "size_i", "size_j", "dim_size", "edge_index_i",
               "edge_index_j")


def _base_class(module):
    return next(c for c in type(module).__mro__ if c.__name__ == "MessagePassing"
                and c.__module__.startswith("torch_geometric"))


def _call_graph(it, what, args, kwargs, node, not_the_calls):
    """The graph of ``self.propagate(edge_index, size=None, **kwargs)`` (or ``edge_updater``),
    taken out of ``kwargs`` with ``size``: the call's own graph, square (``size=None``)."""
    if len(args) > 2:
        it.fail(node, f"{what} with more than two positional arguments", "not lowered")
    g = args[0] if args else kwargs.pop("edge_index", None)
    size = args[1] if len(args) > 1 else kwargs.pop("size", None)
    if size is not None:
        it.fail(node, f"{what} with a size", "only square graphs (size=None) are lowered")
    if not isinstance(g, PygGraph):
        it.fail(node, f"{what} over a graph that is not the call's", not_the_calls)
    return g


def propagate(it, args, kwargs, node):
    """``self.propagate(edge_index, size=None, **kwargs)``: messages, aggregation, update."""
    mod, kwargs = it.module, dict(kwargs)
    g = _call_graph(it, "propagate", args, kwargs, node, "a graph the layer cached in an "
                    "earlier call of its own forward (cached=True) is not lowered")
    for hooks in ("_propagate_forward_pre_hooks", "_propagate_forward_hooks",
                  "_message_forward_pre_hooks", "_message_forward_hooks",
                  "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
                  "_message_and_aggregate_forward_pre_hooks",
                  "_message_and_aggregate_forward_hooks"):
        if getattr(mod, hooks, None):
            it.fail(node, f"propagate with {hooks.strip('_').replace('_', ' ')}", "not lowered")
    if getattr(mod, "explain", None):
        it.fail(node, "propagate in explain mode", "not lowered")
    if getattr(mod, "decomposed_layers", 1) != 1:
        it.fail(node, "propagate with decomposed_layers > 1", "not lowered")
    if getattr(mod, "flow", "source_to_target") != "source_to_target":
        it.fail(node, f"flow='{mod.flow}'", "only source_to_target is lowered")
    if it.how is _UNSET:
        it.how = g.how
    elif it.how != g.how:
        it.fail(node, "propagates over two graphs (with and without self loops)", "not lowered")
    base = _base_class(mod)
    cls = type(mod)
    if cls.aggregate is not base.aggregate:
        it.fail(node, f"{cls.__name__}.aggregate", "a user-defined aggregate is not lowered")
    if g.kind == "adj_t" and getattr(mod, "fuse", False):
        # PyG runs message_and_aggregate on a sparse adjacency
        fn = udf.user_function(mod.message_and_aggregate, node, "message_and_aggregate")
        out = it.call_user(fn, [], _collect(it, fn, g, kwargs, node), "message_and_aggregate",
                           node)
        if not isinstance(out, Tensor):
            it.fail(node, "message_and_aggregate", f"returns {type(out).__name__}")
    else:
        out = aggregate(it, _message(it, g, kwargs, node), node)
    if cls.update is not base.update:
        fn = udf.user_function(mod.update, node, "update function")
        out = it.call_user(fn, [out], _collect(it, fn, g, kwargs, node, skip=1), "update", node)
        if not isinstance(out, Tensor):
            it.fail(node, "update", f"returns {type(out).__name__}, not a tensor")
    return out


def edge_updater(it, args, kwargs, node):
    """``self.edge_updater(edge_index, size=None, **kwargs)``: ``edge_update`` read with its
    arguments as PyG collects them (``alpha_j`` / ``alpha_i`` the rows of ``alpha[0]`` /
    ``alpha[1]`` at each edge's source / target, ``index`` the targets, ``ptr`` ``None`` (PyG's
    CSR pointer of a sparse adjacency groups the edges the same way), ``dim_size`` the number
    of nodes); it must return attention values, one per edge and head."""
    mod, kwargs = it.module, dict(kwargs)
    g = _call_graph(it, "edge_updater", args, kwargs, node, "not lowered")
    for hooks in ("_edge_update_forward_pre_hooks", "_edge_update_forward_hooks"):
        if getattr(mod, hooks, None):
            it.fail(node, f"edge_updater with {hooks.strip('_').replace('_', ' ')}",
                    "not lowered")
    if getattr(mod, "flow", "source_to_target") != "source_to_target":
        it.fail(node, f"flow='{mod.flow}'", "only source_to_target is lowered")
    if it.how is _UNSET:
        it.how = g.how
    elif it.how != g.how:
        it.fail(node, "edge updates and propagates over two graphs", "not lowered")
    fn = udf.user_function(mod.edge_update, node, "edge_update")
    names = [p.arg for p in fn.node.args.args][1:]
    given = {}
    for n in names:
        if n in kwargs:
            given[n] = kwargs[n]
        elif n[-2:] in ("_i", "_j") and n[:-2] in kwargs:
            given[n] = _rows_at_side(it, n, kwargs, g, node, lambda v: v.ndim in (2, 3),
                                     "edge_update argument")
        elif n in ("index", "edge_index_i"):
            given[n] = NodeIndex(g, "dst")
        elif n == "edge_index_j":
            given[n] = NodeIndex(g, "src")
        elif n == "ptr":
            given[n] = None
        elif n in ("dim_size", "size_i", "size_j"):
            given[n] = GraphCondition("num_nodes")
        elif n in ("edge_index", "adj_t"):
            given[n] = g
        else:
            given[n] = None           # PyG passes None for a name it was not given
    it.udfs.append(f"edge update '{type(mod).__name__}.edge_update'")
    out = it.call_user(fn, [], given, "edge_update", node)
    if not isinstance(out, Attention):
        it.fail(node, "edge_update", f"returns {type(out).__name__}: only attention values "
                "(alpha_j + alpha_i, functions of them, softmax, dropout) are lowered")
    return out


def _rows_at_side(it, name, kwargs, g, node, shaped, role):
    """``x_j`` / ``x_i`` as PyG collects it from ``propagate``'s keyword ``x``: the rows of ``x``
    (of ``x[0]`` / ``x[1]`` for a pair) at the sources / targets, ``None`` for ``None``; only
    an N-row tensor that is ``shaped`` is lowered."""
    v = kwargs[name[:-2]]
    side = "src" if name[-2:] == "_j" else "dst"
    if isinstance(v, (tuple, list)):
        v = v[0] if side == "src" else v[1]
    if v is None:
        return None
    if not isinstance(v, Tensor):
        it.fail(node, f"{role} '{name}' of {type(v).__name__}", "not lowered")
    if v.node.rows != "N" or not shaped(v):
        it.fail(node, f"{role} '{name}'", "rows of a tensor that is not N x k (or N x heads x k)")
    return Gathered(v, side, g)


def _collect(it, fn, g, kwargs, node, skip=0):
    """The arguments of ``message`` (or ``update``) as PyG collects them from ``propagate``'s
    keyword arguments: ``x_j`` / ``x_i`` the rows of ``x`` (or of ``x[0]`` / ``x[1]``) at the
    sources / targets, other names as given."""
    a = fn.node.args
    names = [p.arg for p in a.args][1 + skip:]      # after self (and update's inputs)
    out = {}
    for n in names:
        if n in kwargs:
            out[n] = kwargs[n]
        elif n[-2:] in ("_i", "_j") and n[:-2] in kwargs:
            out[n] = _rows_at_side(it, n, kwargs, g, node,
                                   lambda v: v.ndim == 2 or v.ndim == 3 and it.heads, "argument")
        elif n in ("edge_index", "adj_t"):
            out[n] = g
        elif n in _INDEX_ARGS:
            it.fail(node, f"message argument '{n}'", "graph indices inside message are not "
                    "lowered")
    return out


def _message(it, g, kwargs, node):
    mod = it.module
    fn = udf.user_function(mod.message, node, "message function")
    args = _collect(it, fn, g, kwargs, node)
    it.udfs.append(f"message function '{type(mod).__name__}.message'")
    msg = it.call_user(fn, [], args, "message", node)
    if isinstance(msg, EdgeFeat):
        if msg.graph.how != g.how or msg.ndim != 2:
            it.fail(node, "messages of per-edge features of another graph or split in heads",
                    "not lowered")
        return msg
    if isinstance(msg, Gathered):
        msg = Message(None, msg)
    if not isinstance(msg, Message):
        it.fail(node, "message", f"returns {type(msg).__name__}: only x_j times per-edge "
                "values is lowered")
    if msg.x.side != "src":
        it.fail(node, "message of x_i", "only messages of the sources' rows (x_j) are lowered")
    if msg.coef is not None and msg.coef.graph.how != g.how:
        it.fail(node, "messages scaled by the values of another graph", "not lowered")
    if msg.x.x.ndim == 3 and not isinstance(msg.coef, Attention):
        it.fail(node, "messages of per-head features", "only scaled by attention values "
                "(one per edge and head) are lowered")
    return msg


def aggregate(it, msg, node):
    """The aggregation of ``self.aggr_module`` of the messages ``msg``, as an IR product."""
    mod = it.module
    aggr = type(getattr(mod, "aggr_module", None)).__name__
    it.config["aggr_module"] = rules.config_summary(getattr(mod, "aggr_module", None))
    kind = {"SumAggregation": "sum", "MeanAggregation": "mean",
            "MaxAggregation": "max"}.get(aggr)
    if kind is None:
        it.fail(node, f"aggregation {aggr} (aggr={getattr(mod, 'aggr', None)!r})",
                "only sum, mean and max aggregations are lowered")
    # PyG's propagate writes the messages, one row per edge, before it aggregates them
    it.messages.append(msg.node().cols if isinstance(msg, EdgeFeat) else msg.x.x.node.cols)
    if isinstance(msg, EdgeFeat):
        return _edge_aggregate(it, msg, kind, node)
    x = msg.x.x.node
    coef = msg.coef
    if isinstance(coef, Attention):
        if kind == "max":
            it.fail(node, "max of attention-weighted messages", "not in the IR")
        heads = it.heads[0] if msg.x.x.ndim == 3 and it.heads else 1
        factors = [ir.SparseEdges(coef.node, "N", "N", heads, x.cols)]
        if kind == "mean":
            factors = [Degrees("in", -1.0, 1.0).leaf("N")] + factors
        out = ir.matmul(*factors, x)
        if msg.c != 1:
            out = ir.Apply(f"mul({msg.c:g})", out, ("scale", msg.c), True, 0)
        return Tensor(out, msg.x.x.ndim)
    c = msg.c * (coef.const if coef is not None else 1.0)
    if kind == "max":
        if (coef is not None and not coef.ones) or c != 1:
            it.fail(node, "max of scaled messages", "only max of x_j is lowered")
        return Tensor(ir.Aggregate("spmm_amax", x), 2)
    factors = _adjacency(it, coef)
    if kind == "mean":
        factors = [Degrees("in", -1.0, 1.0).leaf("N")] + factors
    out = ir.matmul(*factors, x)
    if c != 1:
        out = ir.Apply(f"mul({c:g})", out, ("scale", c), True, 0)
    return Tensor(out, 2)


def _edge_aggregate(it, msg, kind, node):
    """Sum (or mean) over each destination's in-edges of per-edge features: ``EdgeSum``."""
    if kind == "max":
        it.fail(node, "max of per-edge feature messages", "only sum and mean are lowered")
    out = ir.EdgeSum(msg.node())
    if kind == "mean":
        out = ir.matmul(Degrees("in", -1.0, 1.0).leaf("N"), out)
    return Tensor(out, 2)


def _adjacency(it, coef):
    """The factors of the sparse matrix with the values ``coef`` per edge (``None``: ones)."""
    a = it.leaf("A", "N", "N", ir.SPARSE, ir.UNWEIGHTED, ("graph",))
    if coef is None or (coef.weight is None and not coef.gathers):
        return [a]
    left, right = [], []
    for vec, side in coef.gathers:
        leaf = _degree_leaf(vec, side)
        if leaf is None:          # weighted or possibly 0: the values are computed per call
            whole = EdgeVal(coef.graph, coef.weight, coef.gathers)
            return [_edge_leaf(it, whole)]
        (left if side == "dst" else right).append(leaf)
    mid = a if coef.weight is None else _edge_leaf(it, EdgeVal(coef.graph, coef.weight))
    return left + [mid] + right


def _degree_leaf(vec, side):
    """The IR's degree leaf equal to ``vec`` read at the ``side`` of every edge, or ``None``.

    The IR's leaf is ``max(deg, 1)^p`` of counts: equal to PyG's values where the count read is
    at least 1, which holds where it is read at the side it counts (an edge into ``v`` makes
    ``v``'s in-count >= 1) or on a graph with a self loop on every node."""
    if vec.weight is not None:
        return None
    if vec.side != side and vec.graph.how is None:
        return None
    return Degrees("in" if vec.side == "dst" else "out", vec.power, 1.0).leaf("N")


def _edge_leaf(it, ev):
    key = next((k for k, v in it.edge_values.items() if v.key() == ev.key()), None)
    if key is None:
        key = f"pyg_values{len(it.edge_values)}"
        it.edge_values[key] = ev
    name = "A_w" if ev.weight is not None and not ev.gathers else f"A[{key}]"
    return it.leaf(name, "N", "N", ir.SPARSE, ir.WEIGHTED, ("edge", key))


__all__ += ["PygInterpreter", "inspect"]
