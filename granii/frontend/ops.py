"""IR-building operations that both the built-in rules (``rules.py``) and the lowering of
user-defined functions (``udf.py``) use: frame fields, products, row scaling, ``Apply`` nodes,
``nn.Linear``. ``rules`` dispatches to ``udf`` for Python message and reduce functions; both read
these, so neither imports the other for them.
"""
import dataclasses

import torch

from .. import ir
from .values import Edges, Frame, FrontendError, Tensor

_U, _V, _E = 0, 1, 2
_SAME_VALUE_METHODS = {"to", "float", "contiguous", "type_as", "detach"}


def fail(node, construct, reason):
    raise FrontendError(construct, reason, getattr(node, "lineno", None))


def param_leaf(it, attr, value, transposed=False):
    """A weight leaf; its shape symbols are fixed when a product or sum first uses it."""
    return it.leaf(attr + ("^T" if transposed else ""), None, None, ir.DENSE, ir.WEIGHT,
                   ("param", attr), transposed)


def frame_get(frame, key, it, node):
    """A field of a graph frame: the value the code wrote, or data the graph carries (read at
    run time from the graph, like an argument)."""
    which = "src" if frame.which == "node" else frame.which
    frames = frame.graph.frames
    if key in frames[which]:
        return frames[which][key]
    if not isinstance(key, str):
        fail(node, f"graph.{frame.which}data[{key!r}]", "only string keys are lowered")
    if which == "edge":
        value = Edges(arg=f"edata:{key}")
    else:
        rows = it.n_src if which == "src" else it.n_dst
        name = f"{which}data:{key}"
        value = Tensor(it.leaf(name, rows, f"k_{key}", ir.DENSE, ir.DATA, ("arg", name)), 2)
    frames[which][key] = value
    return value


def _frame_tensor(it, graph, key, node):
    x = frame_get(Frame(graph, "src"), key, it, node)
    if not isinstance(x, Tensor):
        fail(node, f"srcdata['{key}']", "the message function reads a field that holds no tensor")
    return x


def edge_node(it, e, node):
    if e.ones:
        fail(node, "a function of per-edge ones (edge dropout of them in training)", "the IR "
             "has no leaf of ones to apply it to")
    if e.node is None:
        fail(node, "arithmetic on edge values given as an argument", "not lowered")
    return e.node


def matmul(it, a, b, node):
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        fail(node, "matmul", "of a value that is not a tensor expression")
    if isinstance(a.node, ir.Cat):
        return cat_matmul(it, a.node, b, node)
    if a.ndim != 2 or b.ndim != 2:
        fail(node, "matmul of tensors with more than 2 dimensions", "not lowered yet")
    w = b.node
    if isinstance(w, ir.Leaf) and w.rows is None:
        w = fix_shape(it, w, a.node.cols)
    return Tensor(ir.matmul(a.node, w), 2)


def cat_matmul(it, cat, w, node):
    """``cat(X_0, ..., X_m) W``, kept whole: ``ir.split_cat`` adds the sum of block
    products ``X_0 W_0 + ... + X_m W_m`` (``W_i`` the i-th block of rows of ``W``) as a variant."""
    leaf = w.node
    if not (isinstance(leaf, ir.Leaf) and leaf.source[0] == "param" and leaf.rows is None):
        fail(node, "product of a concatenation", "only with a weight parameter")
    widths = {p.cols for p in cat.parts}
    if len(widths) != 1:
        fail(node, "product of a concatenation", "of parts of different widths")
    return Tensor(ir.matmul(cat, fix_shape(it, leaf, cat.cols)), 2)


def fix_shape(it, leaf, rows):
    used = {s for l in it.leaves.values() for s in (l.rows, l.cols)}
    cols = "k_out" if "k_out" not in used else next(f"k_{i}" for i in range(2, 99)
                                                     if f"k_{i}" not in used)
    fixed = dataclasses.replace(leaf, rows=rows, cols=cols)
    it.leaves[leaf.name] = fixed
    return fixed


def row_broadcast(it, x, deg, node):
    rows = it.n_dst if deg.side == "in" else it.n_src
    if x.node.rows != rows:
        fail(node, f"scaling by {deg.side}-degrees", f"of a tensor whose rows are {x.node.rows}")
    return Tensor(ir.RowBroadcast(deg.leaf(rows), x.node), x.ndim)


def scale(it, x, c, node):
    return Tensor(apply(it, f"mul({c:g})", x.node, ("scale", c), pure=True), x.ndim)


def apply(it, label, x, ref, pure=False):
    """``Apply`` of the function ``ref`` to ``x``, numbered by its place in the source."""
    it.sites += 1
    return ir.Apply(label, x, ref, pure, 0 if pure else it.sites)


def linear(it, mod, x, node):
    attr = _attr_name(it.module, mod)
    w = param_leaf(it, attr + ".weight", mod.weight, transposed=True)
    w = dataclasses.replace(w, source=("param", attr + ".weight"))
    out = matmul(it, x, Tensor(w, 2), node)
    if mod.bias is not None:
        b = it.leaf(attr + ".bias", "1", out.node.cols, ir.DENSE, ir.WEIGHT,
                    ("param", attr + ".bias"))
        out = Tensor(ir.Add(out.node, b), 2)
    return out


def _attr_name(module, sub):
    for name, m in module.named_modules():
        if m is sub:
            return name
    raise FrontendError("nn.Linear", "that is not a submodule of the layer")


def _known_pure(func):
    try:
        return func in PURE_FUNCTIONS
    except TypeError:           # unhashable callable
        return False


_F = torch.nn.functional
# functions of one tensor with no parameters, buffers or randomness
PURE_FUNCTIONS = frozenset(f for f in (
    torch.relu, _F.relu, torch.tanh, _F.tanh, torch.sigmoid, _F.sigmoid, _F.elu, _F.leaky_relu,
    _F.gelu, _F.silu, _F.softplus, _F.relu6, _F.selu, _F.celu, _F.mish, _F.hardtanh,
    _F.logsigmoid, torch.exp, torch.abs, torch.square, torch.neg, _F.normalize,
    _F.log_softmax, _F.softmax) if f is not None)
