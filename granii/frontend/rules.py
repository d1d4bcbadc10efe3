"""Lowering rules: DGL and torch calls to matrix-IR operations.

    update_all(copy_u(h), sum)          ->  A . H                (sparse/unweighted times dense)
    update_all(u_mul_e(h, w), sum)      ->  A_w . H              (sparse/weighted, values = w)
    update_all(copy_u(h), mean)         ->  D_in^-1 . A . H      (degrees clamped at 1: rows with no
                                                                  in-edge stay 0, as in DGL)
    graph.in_degrees() / out_degrees()  ->  degree vectors; powers and clamps fold into them
    x * deg (deg a column vector)       ->  row-broadcast, rewritten later to diag(deg) . x
    th.matmul(x, w), x @ w              ->  x . w                (the product is associative)
    linear(x) (nn.Linear)               ->  x . W^T + b
    x + y                               ->  Add(x, y)
    (x * self.attn).sum(-1)             ->  x . blockdiag(attn)  (attention scores: x split into heads
                                                                  (N, H, F), attn (1, H, F); or one
                                                                  head, x (N, F), attn[0] (1, F), ...)
    f(x, c) for a pure f, constants c   ->  Apply(f(., c), x), reusable per input (F.leaky_relu)
    helper(x, y) of the user's code     ->  its source, read like forward
    f(x) for any other callable f       ->  Apply(f, x): a barrier (activations, dropout, ...)
    update_all / apply_edges with Python (user-defined) functions: ``udf.py``
"""
import ast
import dataclasses
import inspect
import types
import weakref

import torch
from torch import nn

from .. import ir
from ..kernels.dropout import is_dropout
from . import udf
from .ops import (_SAME_VALUE_METHODS, _U, _frame_tensor, _known_pure, apply, edge_node, fail,
                  frame_get, linear, matmul, param_leaf, row_broadcast, scale)
from .values import (UDF_VALUES, Degrees, Edges, Frame, FrontendError, Graph, GraphCondition,
                     HeadProduct, LocalScope, Method, ParamItem, RaisesForConfig, Scalar, Shape,
                     Tensor)

_GRAPH_SCALARS = {"num_edges", "num_nodes", "number_of_edges", "number_of_nodes",
                  "num_src_nodes", "num_dst_nodes", "number_of_src_nodes", "number_of_dst_nodes"}
_PURE_MODULES = ("dgl.function",)


# -- attributes ----------------------------------------------------------------------------------
def module_attr(it, attr):
    """``self.<attr>``: configuration values as they are; tensors (parameters, buffers, cached
    values) as symbolic leaves read at run time, one-element ones as scalars."""
    value = it.module
    for part in attr.split("."):
        value = getattr(value, part)
    if inspect.ismethod(value) and value.__self__ is it.module and attr not in vars(it.module):
        return value             # a method of the layer's class (a message function, ...)
    it.config[attr] = config_summary(value)
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() <= 1:
            return Scalar(attr)
        if isinstance(value, nn.Parameter):
            return Tensor(param_leaf(it, attr, value), value.dim())
        if value.dim() != 2:
            fail(None, f"tensor attribute self.{attr} of {value.dim()} dimensions", "not lowered")
        leaf = it.leaf(attr, f"n{attr}", f"k{attr}", ir.DENSE, ir.DATA, ("attr", attr))
        return Tensor(leaf, 2)
    return value


def config_summary(value):
    """What a compiled plan assumes of a module attribute: its value for plain configuration,
    only "a tensor" or ``None`` for tensors, identity for anything else (submodules, functions):
    a ``Same`` of the object."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, tuple) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return value
    return Same(value)


class Same:
    """That an attribute still holds one object (a submodule, a function). The object is held:
    by weak reference where it takes one (modules, Python functions: a plan then keeps no module
    alive), else strongly (builtins such as ``torch.relu``, small configuration objects). Its
    ``id`` alone would also match a new object made at the address of a freed one."""
    __slots__ = ("_ref", "_obj")

    def __init__(self, value):
        try:
            self._ref, self._obj = weakref.ref(value), None
        except TypeError:
            self._ref, self._obj = None, value

    def get(self):
        """The object, or ``None`` once a weakly held one is gone."""
        return self._obj if self._ref is None else self._ref()

    def holds(self, now):
        """``now`` is the object (never true once the object is gone)."""
        obj = self._obj if self._ref is None else self._ref()
        return obj is now and obj is not None

    def __eq__(self, other):
        return isinstance(other, Same) and self.holds(other.get())

    __hash__ = None

    def __repr__(self):
        obj = self.get()
        return f"Same({'<gone>' if obj is None else type(obj).__name__})"


def symbolic_attr(it, obj, attr, node):
    if isinstance(obj, UDF_VALUES):
        return udf.attr(it, obj, attr, node)
    if isinstance(obj, Frame):
        return Method(obj, attr)
    if isinstance(obj, Graph):
        if attr in ("srcdata", "dstdata", "edata", "ndata"):
            which = {"srcdata": "src", "dstdata": "dst", "edata": "edge", "ndata": "node"}[attr]
            return Frame(obj, which)
        if attr == "is_block":
            return obj.is_block
        return Method(obj, attr)
    if attr == "shape":
        return Shape(obj.ndim if isinstance(obj, Tensor) else 1)
    if isinstance(obj, (Tensor, Degrees, Edges, GraphCondition, Shape, HeadProduct)):
        return Method(obj, attr)
    fail(node, f"attribute '{attr}' of {type(obj).__name__}", "not understood")


def symbolic_index(it, obj, key, node):
    if isinstance(obj, (ParamItem, Tensor)) and isinstance(key, int) and not isinstance(key, bool):
        return param_item(it, obj, key, node)
    if isinstance(obj, Shape):
        if isinstance(key, slice):
            return Shape(len(range(obj.ndim)[key]))
        return obj[key] if isinstance(key, int) else GraphCondition("size")
    if (isinstance(obj, Tensor) and isinstance(key, slice) and key.start is None
            and key.step is None and isinstance(key.stop, GraphCondition)
            and key.stop.text in ("number_of_dst_nodes", "num_dst_nodes")):
        if it.n_src == it.n_dst:
            return obj
        sel = it.leaf("S_dst", it.n_dst, it.n_src, ir.SPARSE, ir.SELECTION, ("select",))
        return Tensor(ir.matmul(sel, obj.node), obj.ndim)
    if (isinstance(obj, Tensor) and isinstance(key, slice) and key.start is None
            and key.step is None and isinstance(key.stop, GraphCondition)
            and key.stop.text.startswith("rows:")):
        rows = key.stop.text[len("rows:"):]
        if obj.node.rows == rows:
            return obj             # x[:y.size(0)] with x and y of the same rows
        if _unshaped_arg(obj.node) is not None:
            return Tensor(shape_arg(it, obj.node, rows, node), 2)
    fail(node, "indexing of a tensor", "row slices and gathers are not lowered")


def param_item(it, obj, key, node):
    """``p[0]`` (or ``p[-1]``) of a parameter ``p`` whose first dimension is 1: the same values
    with one dimension fewer (``self.attn_l[0]``)."""
    leaf = obj.node if isinstance(obj, Tensor) else None
    if leaf is not None and not (_is_param(leaf) and not leaf.transposed):
        fail(node, "indexing of a tensor", "row slices and gathers are not lowered")
    attr = obj.attr if leaf is None else leaf.source[1]
    shape = param_shape(it, attr)
    lead = len(shape) - obj.ndim
    if obj.ndim < 2 or shape[lead] != 1 or key not in (0, -1):
        fail(node, f"self.{attr}[{key}] of a parameter of shape {tuple(shape)}", "only the "
             "index 0 of a dimension of size 1 is lowered (the values are then the "
             "parameter's)")
    return ParamItem(attr, obj.ndim - 1)


def param_shape(it, attr):
    value = it.module
    for part in attr.split("."):
        value = getattr(value, part)
    return tuple(value.shape)


# -- graph frames ----------------------------------------------------------------------------------
def frame_set(frame, key, value, it):
    frames = frame.graph.frames
    if isinstance(value, dict):
        for k, v in value.items():
            frame_set(frame, k, v, it)
        return
    if frame.which == "edge" and isinstance(value, Tensor) and _is_arg(value.node):
        value = Edges(arg=value.node.source[1])
    if frame.which == "node":
        if frame.graph.is_block:
            fail(None, "graph.ndata on a block", "use srcdata/dstdata")
        frames["src"][key] = value
    else:
        frames[frame.which][key] = value


def _is_param(node):
    return isinstance(node, ir.Leaf) and node.source[0] == "param"


def head_diag(it, hp):
    """``blockdiag(a_1, ..., a_H)`` (H F x H) of the attention parameter ``self.<attr>``."""
    return it.leaf(f"blockdiag({hp.attr})", hp.x.node.cols, "H", ir.DENSE,
                   ir.WEIGHT, ("headdiag", hp.attr))


def tensor_view(it, x, args, node):
    """``x.view(*prefix, H, F)``: features split into heads. The IR keeps them as the N x (H F)
    matrix; ``it.heads`` remembers (H, F) to give the output its shape."""
    args = [a for a in args if not isinstance(a, GraphCondition)]
    if len(args) == 3 and args[0] == -1 and all(isinstance(a, int) and a > 0 for a in args[1:]):
        args = args[1:]          # view(-1, H, F): the rows as they are
    if len(args) == 1 and args[0] == -1:
        return Tensor(x.node, 2)
    if len(args) == 2 and all(isinstance(a, int) for a in args):
        heads, width = args
        if heads != -1:
            it.heads = (heads, width)
        return Tensor(x.node, 3)
    if len(args) == 3 and all(isinstance(a, int) for a in args) and args[0] == 1:
        return Tensor(x.node, 3)       # a bias viewed as (1, H, F)
    fail(node, f"view{tuple(args)}", "only splitting features into (heads, width) is lowered")


def _is_arg(node):
    return isinstance(node, ir.Leaf) and node.source[0] == "arg" and node.rows is None


def update_all(it, graph, msg, red, node):
    """``graph.update_all(msg, reduce)`` with DGL's built-in message and reduce functions; with
    a Python function for either, ``udf.update_all``."""
    if not udf.is_builtin_message(msg) or not udf.is_builtin_reduce(red):
        return udf.update_all(it, graph, msg, red, node)
    if msg.name == "copy_u":
        x = _frame_tensor(it, graph, msg.in_field, node)
        adj = it.leaf("A", it.n_dst, it.n_src, ir.SPARSE, ir.UNWEIGHTED, ("graph",))
    elif msg.name in ("u_mul_e", "e_mul_u"):
        ufield, efield = ((msg.lhs_field, msg.rhs_field) if msg.lhs == _U
                          else (msg.rhs_field, msg.lhs_field))
        x = _frame_tensor(it, graph, ufield, node)
        w = frame_get(Frame(graph, "edge"), efield, it, node)
        if not isinstance(w, Edges):
            fail(node, f"u_mul_e with edge field '{efield}'", "the field holds no edge values")
        if w.scaled:
            d_dst, arg, d_src = w.scaled
            adj = ir.matmul(d_dst, it.leaf("A_w", it.n_dst, it.n_src, ir.SPARSE, ir.WEIGHTED,
                                           ("edge", arg)), d_src)
        elif w.ones:
            adj = it.leaf("A", it.n_dst, it.n_src, ir.SPARSE, ir.UNWEIGHTED, ("graph",))
        elif w.node is not None:
            heads = it.heads[0] if x.ndim == 3 and it.heads else 1
            adj = ir.SparseEdges(w.node, it.n_dst, it.n_src, heads, x.node.cols)
        else:
            adj = it.leaf("A_w", it.n_dst, it.n_src, ir.SPARSE, ir.WEIGHTED, ("edge", w.arg))
    else:
        fail(node, f"message function fn.{msg.name}", "not lowered yet")
    if msg.out_field != red.msg_field:
        fail(node, "update_all", "reduce reads a message field the message function did not write")
    if x.ndim != 2 and not (x.ndim == 3 and isinstance(adj, ir.SparseEdges)):
        fail(node, "update_all on features with more than 2 dimensions", "only attention "
             "(per-head edge values times (N, heads, F) features) is lowered")
    if red.name == "sum":
        out = ir.matmul(adj, x.node)
    elif red.name == "mean":
        out = ir.matmul(Degrees("in", -1.0, 1.0).leaf(it.n_dst), adj, x.node)
    elif red.name in ("max", "min") and msg.name == "copy_u":
        out = ir.Aggregate(f"spmm_{red.name}", x.node)
    else:
        fail(node, f"reduce function fn.{red.name} with fn.{msg.name}", "not lowered yet")
    graph.frames["dst"][red.out_field] = Tensor(out, x.ndim)


READOUTS = {"sum_nodes": "sum", "mean_nodes": "mean"}


def readout(it, op, args, kwargs, node):
    """DGL's ``sum_nodes(graph, feat)`` (and ``mean_nodes``): per graph of a batch, the sum
    (mean) of the node feature ``feat`` over its nodes, ``G`` rows. As a matrix, ``R H`` with
    ``R`` (G x N) one row per graph holding ones at its nodes (the mean divides by its node
    count, at least 1). Only node features of a whole graph, without ``weight``."""
    graph = args[0]
    extra = dict(zip(("feat", "weight"), args[1:]), **kwargs)
    if extra.get("weight") is not None or extra.get("ntype") is not None:
        fail(node, f"{op} readout with a weight or node type", "not lowered")
    if graph.is_block:
        fail(node, f"{op} readout of a block", "a readout reads whole graphs")
    x = graph.frames["src"].get(extra.get("feat"))
    if not isinstance(x, Tensor) or x.ndim != 2:
        fail(node, f"{op} readout", "only N x k node features are lowered")
    return Tensor(ir.Aggregate(f"readout_{op}", x.node, "G"), 2)


def edge_weight_norm(it, module, w, node):
    """DGL's ``EdgeWeightNorm(norm="both", eps)(graph, w)`` of an edge-weight argument:
    ``w_e d_in(v)^-1/2 d_out(u)^-1/2`` with ``d`` the weighted degrees (the sums of the weights
    into ``v`` and out of ``u``) plus ``eps``. As a matrix, ``D_in_w^-1/2 A_w D_out_w^-1/2``: two
    diagonal leaves made from the weights at run time (``plan.weighted_degree_power``, which
    raises DGL's error for a non-positive weight), so the scaling re-associates like the
    unweighted normalisation (precomputed edge values, or row scalings around the SpMM).
    ``norm="none"`` is the weights themselves."""
    norm = getattr(module, "_norm", None)
    if w.arg is None or w.ones or w.node is not None or w.scaled:
        fail(node, "EdgeWeightNorm of computed edge values", "only an edge-weight argument's "
             "normalisation is lowered")
    if norm == "none":
        return w
    if norm != "both":
        fail(node, f"EdgeWeightNorm(norm={norm!r})", "only 'both' and 'none' are lowered")
    eps = float(getattr(module, "_eps", 0.0))

    def degree(side, rows):
        return it.leaf(f"Dw_{side}^-0.5", rows, rows, ir.SPARSE, ir.DIAGONAL,
                       ("wdegree", side, -0.5, eps, w.arg))
    return Edges(scaled=(degree("in", it.n_dst), w.arg, degree("out", it.n_src)))


def apply_edges(it, graph, func, node):
    """``graph.apply_edges(fn.u_add_v(a, b, out))``: per-edge ``a_u + b_v`` (an SDDMM); with a
    Python function, ``udf.apply_edges``."""
    if not hasattr(func, "out_field"):
        return udf.apply_edges(it, graph, func, node)
    if getattr(func, "name", None) != "u_add_v":
        fail(node, f"apply_edges with {getattr(func, 'name', 'a Python function')}",
             "only fn.u_add_v is lowered")
    a = frame_get(Frame(graph, "src"), func.lhs_field, it, node)
    b = frame_get(Frame(graph, "dst"), func.rhs_field, it, node)
    graph.frames["edge"][func.out_field] = Edges(node=ir.EdgeScore(a.node, b.node))


# -- arithmetic ------------------------------------------------------------------------------------


def binop(it, op, a, b, node):
    if isinstance(a, UDF_VALUES) or isinstance(b, UDF_VALUES):
        return udf.binop(it, op, a, b, node)
    if op == "MatMult":
        return matmul(it, a, b, node)
    if isinstance(a, Degrees) or isinstance(b, Degrees):
        return degree_arith(it, op, a, b, node)
    if isinstance(a, Shape) and isinstance(b, tuple) and op == "Add":
        return Shape(a.ndim + len(b))
    if isinstance(a, tuple) and isinstance(b, Shape) and op == "Add":
        return Shape(len(a) + b.ndim)
    if isinstance(a, Scalar) or isinstance(b, Scalar):
        return scalar_arith(it, op, a, b, node)
    if isinstance(a, GraphCondition) or isinstance(b, GraphCondition):
        return GraphCondition("expression")
    if op == "Add" and isinstance(a, Tensor) and isinstance(b, Tensor):
        an, bn = a.node, b.node
        if _unshaped_arg(an) is not None and _unshaped_arg(bn) is None:
            an = _shape_for_add(it, an, bn, node)
        elif _unshaped_arg(bn) is not None:
            bn = _shape_for_add(it, bn, an, node)
        elif isinstance(bn, ir.Leaf) and bn.rows is None:
            bn = dataclasses.replace(bn, rows="1", cols=an.cols)
            it.leaves[bn.name] = bn
        return Tensor(ir.Add(an, bn), max(a.ndim, b.ndim))
    if op == "Mult":
        hp = head_product(it, a, b) or head_product(it, b, a)
        if hp is not None:
            return hp
    if isinstance(a, HeadProduct) or isinstance(b, HeadProduct):
        hp = a if isinstance(a, HeadProduct) else b
        fail(node, f"operator {op} on features * self.{hp.attr}", "an element-wise product with "
             "a parameter is lowered only when summed over the last dimension (attention scores)")
    if isinstance(a, ParamItem) or isinstance(b, ParamItem):
        item = a if isinstance(a, ParamItem) else b
        fail(node, f"self.{item.attr}[0] in operator {op}", "an indexed parameter is lowered "
             "only as attention vectors, (x * a).sum(-1)")
    if op == "Mult" and isinstance(a, Edges) and isinstance(b, Edges) and b.arg is not None:
        w = it.leaf(b.arg, "E", "1", ir.DENSE, ir.DATA, ("edge", b.arg))
        return Edges(node=ir.EdgeScale(edge_node(it, a, node), w))
    if op == "Mult" and isinstance(a, Tensor) and isinstance(b, (int, float)):
        return scale(it, a, float(b), node)
    if op == "Mult" and isinstance(b, Tensor) and isinstance(a, (int, float)):
        return scale(it, b, float(a), node)
    fail(node, f"operator {op} on {type(a).__name__} and {type(b).__name__}", "not lowered")


def head_product(it, x, a):
    """``x * a`` of features and attention vectors, to be summed over the last dimension, or
    ``None``: ``x`` split into heads (N, H, F) and ``a`` of shape (1, H, F); or ``x`` of shape
    (N, F) and ``a`` one vector (1, F) (or (1, 1, F), ``self.attn[0]``, ...): one head."""
    if not isinstance(x, Tensor) or isinstance(x.node, ir.Leaf) and _is_param(x.node):
        return None
    if isinstance(a, Tensor) and _is_param(a.node) and not a.node.transposed:
        attr, ndim = a.node.source[1], a.ndim
    elif isinstance(a, ParamItem):
        attr, ndim = a.attr, a.ndim
    else:
        return None
    shape = param_shape(it, attr)
    if len(shape) < 2 or any(n != 1 for n in shape[:-2]):
        return None
    if x.ndim == 3 and it.heads and 2 <= ndim <= 3 and shape[-2] == it.heads[0]:
        return HeadProduct(x, attr)
    if x.ndim == 2 and ndim == 2 and shape[-2] == 1:
        return HeadProduct(x, attr)
    return None


def head_sum(it, hp, args, kwargs, node):
    """``(x * a).sum(-1)``: the score of each head, ``x . blockdiag(a)`` (N x H)."""
    kw = dict(kwargs)
    dim = kw.pop("dim", args[0] if args else None)
    keepdim = kw.pop("keepdim", args[1] if len(args) > 1 else False)
    last = hp.x.ndim - 1
    if kw or len(args) > 2 or not isinstance(dim, int) or dim % hp.x.ndim != last:
        fail(node, "(features * attention).sum()", "only the sum over the last dimension is "
             "lowered")
    return Tensor(ir.matmul(hp.x.node, head_diag(it, hp)), hp.x.ndim - (0 if keepdim else 1))


def _unshaped_arg(n):
    """The forward() argument of unknown shape that ``n`` is, or scales; else ``None``."""
    while isinstance(n, ir.Apply) and n.ref[:1] == ("scale",):
        n = n.x
    if isinstance(n, ir.Leaf) and n.source[0] == "arg" and n.rows is None:
        return n
    return None


def _shape_for_add(it, n, other, node):
    """``n`` (an argument, maybe scaled) added to ``other``: node data shaped like ``other`` when
    the call's argument has more than one row (``GCN2Conv``'s ``feat_0``), else a broadcast row
    (a bias)."""
    leaf = _unshaped_arg(n)
    value = it.real.get(leaf.source[1])
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] != 1:
        return shape_arg(it, n, other.rows, node, other.cols)
    if n is not leaf:
        fail(node, f"sum with a scaled argument '{leaf.source[1]}'", "of unknown shape")
    fixed = dataclasses.replace(leaf, rows="1", cols=other.cols)
    it.leaves[fixed.name] = fixed
    return fixed


def shape_arg(it, n, rows, node, cols=None):
    """``n`` with its argument of unknown shape made ``rows`` x ``cols`` node data (``cols``:
    ``k_in`` when as wide as the features, else its own symbol). The plan holds for calls where
    the argument has one row per node of ``rows`` and that width (a specialisation); for this
    call's argument, if it has not, the frontend stops."""
    leaf = _unshaped_arg(n)
    name = leaf.source[1]
    if rows not in ("N", "N_src", "N_dst"):
        fail(node, f"tensor argument '{name}'", f"used with a tensor of {rows} rows")
    count = "num_dst_nodes" if rows == "N_dst" else "num_src_nodes"
    graph, feat = it.func.args.args[1].arg, it.func.args.args[2].arg
    text = f"{name}.dim() == 2 and {name}.shape[0] == {graph}.{count}()"
    if cols is not None:        # summed with a tensor of that width: no broadcast of one column
        text += f" and {name}.shape[1] != 1"
    else:
        value, x = it.real.get(name), it.real.get(feat)
        same = getattr(value, "shape", (0, 0))[-1:] == getattr(x, "shape", (0, 1))[-1:]
        cols = "k_in" if same else f"k_{name}"
        text += f" and {name}.shape[-1] {'==' if same else '!='} {feat}.shape[-1]"
    if not it.specialize(ast.parse(text, mode="eval").body):
        fail(node, f"tensor argument '{name}'", f"not of one row per node ({rows}) or of one "
             "column; row slices and broadcasts of it are not lowered")
    shaped = dataclasses.replace(leaf, rows=rows, cols=cols, sub=ir.DATA)
    it.leaves[shaped.name] = shaped
    return _with_leaf(n, leaf, shaped)


def _with_leaf(n, old, new):
    if n == old:
        return new
    return ir.with_children(n, [_with_leaf(c, old, new) for c in ir.children(n)])


def scalar_arith(it, op, a, b, node):
    """``c + s``, ``c * s`` of a number and a scalar; ``s * X`` is the product ``(s I) X``."""
    num = (int, float)
    if op == "Add" and isinstance(a, num):
        return dataclasses.replace(b, offset=b.offset + a * 1.0)
    if op == "Add" and isinstance(b, num):
        return dataclasses.replace(a, offset=a.offset + b * 1.0)
    if isinstance(a, Scalar) and isinstance(b, Tensor):
        a, b = b, a
    if op == "Add" and isinstance(a, Tensor) and isinstance(b, Scalar) \
            and (b.offset, b.factor) == (0.0, 1.0):
        # X + s with a one-element parameter (the bias of a layer with one output): a 1 x 1
        # operand broadcast over X, as torch adds it
        s = it.leaf(b.attr, "1", "1", ir.DENSE, ir.WEIGHT, ("param", b.attr))
        return Tensor(ir.Add(a.node, s), a.ndim)
    if op == "Mult" and isinstance(a, Tensor) and isinstance(b, Scalar):
        if a.ndim != 2:
            fail(node, "scalar times a tensor of more than 2 dimensions", "not lowered yet")
        return Tensor(ir.matmul(b.leaf(a.node.rows), a.node), a.ndim)
    fail(node, f"operator {op} on a scalar parameter and {type(b).__name__}", "not lowered")


def degree_arith(it, op, a, b, node):
    if op == "Mult" and isinstance(a, Tensor):
        return row_broadcast(it, a, b, node)
    if op == "Mult" and isinstance(b, Tensor):
        return row_broadcast(it, b, a, node)
    if op == "Div" and isinstance(a, Tensor):
        return row_broadcast(it, a, dataclasses.replace(b, power=-b.power), node)
    if op == "Div" and isinstance(a, (int, float)) and a == 1:
        return dataclasses.replace(b, power=-b.power)
    if op == "Pow" and isinstance(a, Degrees) and isinstance(b, (int, float)):
        return dataclasses.replace(a, power=a.power * b)
    if op in ("Add", "Sub") and isinstance(a if isinstance(b, Degrees) else b, (int, float)):
        d, c = (b, a) if isinstance(b, Degrees) else (a, b)
        if op == "Sub" and d is b:
            fail(node, "a number minus degrees", "only degrees plus or minus a number are lowered")
        if d.power != 1 or d.clamp is not None:
            fail(node, "a number added to a power or a clamp of degrees",
                 "the IR's degree leaves are (max(deg + s, c))^p: the shift comes first")
        return dataclasses.replace(d, shift=d.shift + (c if op == "Add" else -c) * 1.0)
    fail(node, f"operator {op} on degrees", "not lowered")


# -- calls -----------------------------------------------------------------------------------------
def call_method(it, m, args, kwargs, node):
    obj, name = m.obj, m.name
    if isinstance(obj, UDF_VALUES):
        return udf.call_method(it, obj, name, args, kwargs, node)
    if isinstance(obj, Graph):
        if name == "local_scope":
            return LocalScope()
        if name in ("in_degrees", "out_degrees"):
            if args or kwargs:
                fail(node, f"graph.{name} of some nodes", "only all degrees are lowered")
            return Degrees("in" if name == "in_degrees" else "out")
        if name in _GRAPH_SCALARS:
            return GraphCondition(name)
        if name == "update_all":
            return update_all(it, obj, *_update_all_args(args, kwargs, node), node)
        if name == "apply_edges" and len(args) == 1 and not kwargs:
            return apply_edges(it, obj, args[0], node)
        fail(node, f"graph.{name}", "not lowered")
    if isinstance(obj, GraphCondition):
        return GraphCondition(name)
    if isinstance(obj, Degrees):
        return degree_method(obj, name, args, kwargs, node)
    if isinstance(obj, HeadProduct):
        if name == "sum":
            return head_sum(it, obj, args, kwargs, node)
        fail(node, f"(features * attention).{name}()", "only .sum(dim=-1) is lowered")
    if isinstance(obj, Tensor):
        if name == "detach":
            return Tensor(apply(it, "detach", obj.node, ("detach",), pure=True), obj.ndim)
        if name in _SAME_VALUE_METHODS:
            return obj
        if name == "dim":
            return obj.ndim
        if name in _PURE_METHODS and not args and not kwargs:      # x.relu(): torch.relu(x)
            func = getattr(torch, name)
            return Tensor(apply(it, name, obj.node, ("function", func), pure=True), obj.ndim)
        if name in ("view", "reshape"):
            return tensor_view(it, obj, args, node)
        if name == "unsqueeze" and args and args[0] == -1:
            return Tensor(obj.node, obj.ndim + 1)
        if name in ("tile", "transpose") and _is_arg(obj.node):
            return Edges(arg=obj.node.source[1])
        if (name == "t" and not args or name == "transpose" and sorted(args) == [0, 1]) \
                and _is_param(obj.node):
            return Tensor(param_leaf(it, obj.node.source[1], None, not obj.node.transposed), 2)
        if name == "size":
            if args == [0] and obj.node.rows is not None:
                return GraphCondition(f"rows:{obj.node.rows}")
            return GraphCondition("size")
    if isinstance(obj, Edges) and name == "detach":
        if obj.node is None:
            fail(node, "detach of edge values given as an argument", "not lowered")
        return Edges(node=apply(it, "detach", obj.node, ("detach",), pure=True))
    if isinstance(obj, Edges) and name in _SAME_VALUE_METHODS:
        return obj
    if isinstance(obj, Edges) and name == "unsqueeze" and args and args[0] == -1:
        return obj
    if isinstance(obj, Edges) and obj.arg is not None and name in ("tile", "transpose"):
        return obj      # a per-edge weight broadcast over heads: (E,) -> (E, H, 1)
    if isinstance(obj, Frame):
        if name == "pop" or name == "__getitem__":
            return frame_get(obj, args[0], it, node)
        if name == "update":
            return frame_set(obj, None, args[0], it)
    fail(node, f".{name}() on {type(obj).__name__}", "not lowered")


# tensor methods that are the pure function of ``torch`` of the same name (``ops.PURE_FUNCTIONS``)
_PURE_METHODS = ("relu", "tanh", "sigmoid", "exp", "abs", "square", "neg")


def _is_param(n):
    """A weight leaf read from a parameter (``self.w``, ``self.lin.weight``), as written or
    transposed."""
    return isinstance(n, ir.Leaf) and n.source[:1] == ("param",)


def _update_all_args(args, kwargs, node):
    """``(message_func, reduce_func)`` of an ``update_all`` call without ``apply_node_func``."""
    given = dict(zip(("message_func", "reduce_func", "apply_node_func", "etype"), args))
    given.update(kwargs)
    if given.get("apply_node_func") is not None or given.get("etype") is not None \
            or set(given) - {"message_func", "reduce_func", "apply_node_func", "etype"}:
        fail(node, "update_all with apply_node_func or etype", "not lowered")
    if "message_func" not in given or "reduce_func" not in given:
        fail(node, "update_all", "without a message and a reduce function")
    return given["message_func"], given["reduce_func"]


def degree_method(d, name, args, kwargs, node):
    if name in _SAME_VALUE_METHODS or name in ("unsqueeze", "view", "reshape"):
        return d
    if name == "clamp":
        lo = kwargs.get("min", args[0] if args else None)
        if d.power != 1 or kwargs.get("max") is not None or lo is None:
            fail(node, "degrees.clamp", "only clamp(min=c) before any power is lowered")
        return dataclasses.replace(d, clamp=float(lo))
    if name == "pow":
        return dataclasses.replace(d, power=d.power * float(args[0]))
    if name == "__eq__":
        return GraphCondition("degree comparison")
    fail(node, f"degrees.{name}()", "not lowered")


def call_function(it, func, args, kwargs, node):
    if isinstance(func, udf.UserFunction):
        return it.call_user(func, args, kwargs, func.name, node)
    if any(udf._holds_udf(a) for a in list(args) + list(kwargs.values())) or (
            args and isinstance(args[0], Edges) and udf.pure_ref(func, args, kwargs)):
        return udf.call_function(it, func, args, kwargs, node)
    if func is torch.cat and args and isinstance(args[0], (list, tuple)) \
            and any(isinstance(p, Tensor) for p in args[0]):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        parts = args[0]
        if dim not in (-1, 1) or not all(isinstance(p, Tensor) and p.ndim == 2 for p in parts):
            fail(node, "torch.cat", "only concatenating N x k features along columns is lowered")
        return Tensor(ir.Cat(tuple(p.node for p in parts)), 2)
    if func is torch.sum and args and isinstance(args[0], HeadProduct):
        return head_sum(it, args[0], args[1:], kwargs, node)
    symbolic = [a for a in list(args) + list(kwargs.values()) if _holds_symbolic(a)]
    if func in _CONTAINER_BUILTINS:
        return func(*args, **kwargs)          # len(hs), zip(hs, ws): containers of values
    if not symbolic:
        return func(*args, **kwargs)
    name = getattr(func, "__name__", type(func).__name__)
    modname = getattr(func, "__module__", "") or ""
    owner = getattr(func, "__self__", None)
    if isinstance(owner, (list, dict)) and not isinstance(owner, Frame):
        return func(*args, **kwargs)          # list.append(x) and friends hold symbolic values
    if func is len and isinstance(args[0], Shape):
        return args[0].ndim
    if name in READOUTS and modname == "dgl.readout" and args and isinstance(args[0], Graph):
        return readout(it, READOUTS[name], args, kwargs, node)
    if name == "edge_softmax" and modname.startswith("dgl") and isinstance(args[1], Edges):
        return Edges(node=ir.EdgeSoftmax(edge_node(it, args[1], node)))
    if isinstance(func, nn.Module) and len(args) == 1 and isinstance(args[0], Edges):
        if _is_identity_dropout(it, func):
            return args[0]
        label, ref = _callable_ref(it, func)
        return Edges(node=apply(it, label, edge_node(it, args[0], node), ref))
    if func is isinstance and len(args) == 2:
        return isinstance(args[0], Tensor) and issubclass(torch.Tensor, args[1])
    if type(func).__name__ == "EdgeWeightNorm" and type(func).__module__.startswith("dgl") \
            and len(args) == 2 and isinstance(args[0], Graph):
        w = args[1]
        if isinstance(w, Tensor) and _is_arg(w.node):
            w = Edges(arg=w.node.source[1])
        if isinstance(w, Edges):
            return edge_weight_norm(it, func, w, node)
    if isinstance(func, nn.Module) and any(isinstance(a, Graph) for a in args):
        fail(node, f"call of {type(func).__name__} with the graph", "a nested graph module is "
             "not lowered inside a layer")
    if isinstance(func, nn.Sequential) and len(args) == 1 and isinstance(args[0], Tensor):
        x = args[0]
        for sub in func:
            x = call_function(it, sub, [x], {}, node)
        return x
    name = getattr(func, "__name__", type(func).__name__)
    modname = getattr(func, "__module__", "") or ""
    if func in (torch.matmul, torch.mm):
        return matmul(it, args[0], args[1], node)
    if func is torch.pow and isinstance(args[0], Degrees):
        return degree_arith(it, "Pow", args[0], args[1], node)
    if func is torch.reshape and isinstance(args[0], Degrees):
        return args[0]
    if name == "expand_as_pair" and modname.startswith("dgl"):
        return expand_as_pair(it, args[0], args[1], node)
    if isinstance(func, nn.Linear) and isinstance(args[0], Tensor):
        for site in it.inline_inputs:            # the first map of a submodule read inline
            if site[0] is args[0] and site[1] is None:
                site[1] = (func.in_features, func.out_features)
        return linear(it, func, args[0], node)
    if isinstance(func, nn.Identity) or _is_identity_dropout(it, func):
        return args[0]
    if is_dropout(func) and isinstance(args[0], Tensor):
        return functional_dropout(it, args, kwargs, node)
    if isinstance(func, nn.Module) and len(args) == 1 and isinstance(args[0], Tensor) \
            and not kwargs:
        inlined = inline_submodule(it, func, args[0], node)
        if inlined is not None:
            return inlined
    if callable(func) and len(args) == 1 and isinstance(args[0], Tensor) and not kwargs:
        label, ref = _callable_ref(it, func)
        pure = ref[0] in ("function", "attr") and _known_pure(func)
        return Tensor(apply(it, label, args[0].node, ref, pure), args[0].ndim)
    ref = udf.pure_ref(func, args, kwargs) if args and isinstance(args[0], Tensor) else None
    if ref is not None:          # F.leaky_relu(x, 0.2): a pure function with constants
        return Tensor(apply(it, ref[0], args[0].node, ref[1], pure=True), args[0].ndim)
    if func is torch.ones and _per_edge(args) and not kwargs:
        return Edges(ones=True)
    if isinstance(args[0], GraphCondition):
        return GraphCondition(name)
    if isinstance(func, (types.FunctionType, types.MethodType)) and udf._own_code(func):
        # a helper of the user's code (self.attend(z, a)): read like forward
        return it.call_user(udf.user_function(func, node, "helper function"), args, kwargs,
                            name, node)
    fail(node, f"call of {modname}.{name}", "with symbolic arguments; not lowered")


def _per_edge(shape):
    """``shape`` is ``(graph.num_edges(),)`` or ``(graph.num_edges(), 1)``."""
    return (len(shape) in (1, 2) and isinstance(shape[0], GraphCondition)
            and shape[0].text in ("num_edges", "number_of_edges") and tuple(shape[1:]) in ((), (1,)))


_CONTAINER_BUILTINS = (len, list, tuple, zip, enumerate, reversed, range, dict)
_SYMBOLIC_TYPES = (Tensor, Degrees, Edges, Graph, Shape, GraphCondition, Scalar,
                   HeadProduct, ParamItem) + UDF_VALUES


def _holds_symbolic(a):
    """``a`` is symbolic, or a list, tuple or dict holding a symbolic value (``torch.stack([h, ...])``)."""
    if isinstance(a, _SYMBOLIC_TYPES):
        return True
    if isinstance(a, (list, tuple)) and not isinstance(a, Frame):
        return any(_holds_symbolic(x) for x in a)
    if isinstance(a, dict):
        return any(_holds_symbolic(x) for x in a.values())
    return False


def expand_as_pair(it, feat, graph, node):
    if isinstance(feat, tuple):
        fail(node, "a pair of feature tensors", "bipartite (src, dst) input is not lowered yet")
    if not isinstance(graph, Graph):
        fail(node, "expand_as_pair", "second argument is not the graph")
    if not graph.is_block:
        return feat, feat
    dst = it.leaf(feat.node.name + "_dst", it.n_dst, feat.node.cols, ir.DENSE, ir.DATA,
                  ("arg_dst", feat.node.source[1]))
    return feat, Tensor(dst, feat.ndim)


def inline_submodule(it, module, x, node):
    """``module(x)`` for a submodule of the layer from the user's code, read as its forward:
    ``GINConv``'s ``apply_func`` is an MLP whose first step is a linear map, and read inline
    ``MLP(A' H) = lin2(relu(norm((A' H) W1)))`` re-associates to ``A' (H W1)``: the aggregation
    at the hidden width instead of the input's. Its ``self.x`` reads are the layer's
    ``path.x`` (``module_attr``: what the plan assumes of them is checked as for the layer's
    own). Only when that first step is an ``nn.Linear`` that narrows the features: otherwise
    nothing can move before the aggregation that pays (a plan would aggregate at the input's
    width anyway), and the module's own call costs less than its steps run one by one (GIN on
    batches of small graphs, 7 -> 16 features: 5% slower inline). ``None``, with nothing of the
    attempt kept, when the call stays one ``Apply``: such a module, a module of a library
    (torch's own are lowered by their rules), one with hooks or its own ``__call__``, or a
    forward the frontend does not lower."""
    cls = type(module)
    path = _module_path(it, module)
    if (path is None or id(module) in it.inlined or not udf._own_code(cls.forward)
            or cls.__call__ is not nn.Module.__call__ or _has_hooks(module)):
        return None
    snap = it.snapshot()
    it.inlined[id(module)] = path
    frame = [x, None]                            # the input, and (in, out) of its first map
    it.inline_inputs.append(frame)
    try:
        fn = udf.user_function(module.forward, node, "submodule")
        out = it.call_user(fn, [x], {}, f"{path}:{cls.__name__}", node)
    except (FrontendError, RaisesForConfig):
        out = None
    finally:
        del it.inlined[id(module)]
        it.inline_inputs.remove(frame)
    narrows = frame[1] is not None and frame[1][1] < frame[1][0]
    if not isinstance(out, Tensor) or out.ndim != 2 or not narrows:
        it.restore(snap)
        return None
    it.config[path] = config_summary(module)
    return out


def _has_hooks(module):
    """Hooks that a call of ``module`` would run (its own or every module's)."""
    from torch.nn.modules import module as nn_module
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
           getattr(module, "_backward_pre_hooks", {}))
    every = (getattr(nn_module, "_global_forward_hooks", {}),
             getattr(nn_module, "_global_forward_pre_hooks", {}),
             getattr(nn_module, "_global_backward_hooks", {}),
             getattr(nn_module, "_global_backward_pre_hooks", {}))
    return any(len(h) for h in own + every)


def _module_path(it, mod):
    """The dotted name of ``mod`` among the layer's submodules, or ``None``."""
    for name, m in it.module.named_modules():
        if m is mod and name:
            return name
    return None


def _callable_ref(it, func):
    """``(label, ref)`` of a callable applied to a tensor (see ``ir.Apply``): bound by name to
    the layer when it is one of its submodules or attributes, so each instance calls its own."""
    if isinstance(func, nn.Module):
        path = _module_path(it, func)
        if path is not None:
            return f"{path}:{type(func).__name__}", ("module", path)
        return type(func).__name__, ("function", func)
    name = getattr(func, "__name__", type(func).__name__)
    for attr, value in vars(it.module).items():
        if value is func and not attr.startswith("__"):
            it.config[attr] = config_summary(value)
            # a known function is part of the ref (fusion passes read it); the plan still
            # calls the attribute, and is reused only while it holds the same object
            return f"{attr}:{name}", ("attr", attr) + ((func,) if _known_pure(func) else ())
    return name, ("function", func)


def _is_identity_dropout(it, func):
    """A dropout submodule that is the identity now (``p == 0`` or eval mode): it lowers to its
    input, and the plan is only reused while that stays so (its ``p`` and ``training`` are part
    of the configuration the plan assumes)."""
    if not isinstance(func, nn.Dropout):
        return False
    path = _module_path(it, func)
    if path is None:
        return False
    it.config[path + ".p"] = func.p
    it.config[path + ".training"] = func.training
    return func.p == 0 or not func.training


def functional_dropout(it, args, kwargs, node):
    """``F.dropout(x, p, training)``: the identity when not training or ``p == 0``, else one draw."""
    names = ("input", "p", "training", "inplace")
    given = dict(zip(names, args), **kwargs)
    p, training = given.get("p", 0.5), given.get("training", True)
    if given.get("inplace") or not isinstance(p, (int, float)) or not isinstance(training, bool):
        fail(node, "F.dropout", "only dropout with a known p and training flag is lowered")
    x = given["input"]
    if p == 0 or not training:
        return x
    return Tensor(apply(it, f"dropout({p:g})", x.node, ("dropout", float(p))), x.ndim)


__all__ = ["RaisesForConfig"]
