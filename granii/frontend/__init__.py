"""Frontend: the source of a layer's ``forward`` -> the matrix IR of one call signature.

``lower_layer(module, present, is_block)`` parses the installed source of ``type(module).forward``,
binds ``graph`` and the features symbolically, the module's configuration concretely, and each
optional argument as present or ``None`` (``present`` names those given), and returns a
``LayerIR``. The IR has its row-broadcasts already rewritten into diagonal products.
"""
import inspect
from dataclasses import dataclass

import torch

from .. import ir
from .interp import Interpreter, forward_ast
from .values import FrontendError, Graph, RaisesForConfig, Tensor

__all__ = ["FrontendError", "RaisesForConfig", "LayerIR", "lower_layer"]


@dataclass
class LayerIR:
    """The lowered forward of one layer for one call signature."""
    layer_type: str
    root: object                 # IR after the row-broadcast rewrite
    raw: object                  # IR as the frontend built it (with row-broadcasts)
    guards: list                 # (source text, names read): checks run at call time
    arg_names: tuple             # forward's parameters after self
    present: frozenset           # optional arguments given in this call signature
    source: str                  # the forward() source that was parsed
    spec: list                   # (condition, names, value): graph-dependent branches taken
    config: dict                 # module attribute -> summary of the value branched on
    heads: tuple = None          # (H, F): the output is (N, H, F), the IR's N x (H F) split
    udfs: tuple = ()             # the Python message, reduce and apply-edges functions read,
                                 # e.g. "reduce function 'gcn_reduce'" (DGL runs each once per
                                 # group of nodes of equal in-degree: its forward is slow)


def lower_layer(module, present=frozenset(), is_block=False, real=None):
    func_def, globals_, src = forward_ast(type(module))
    params = [a.arg for a in func_def.args.args][1:]
    if len(params) < 2:
        raise FrontendError("forward signature", "expected forward(self, graph, feat, ...)")
    if func_def.args.vararg or func_def.args.kwarg:
        raise FrontendError("forward(*args, **kwargs)", "variable arguments are not lowered")
    graph_name, feat_name = params[0], params[1]
    self_name = func_def.args.args[0].arg
    bound = {self_name: module, graph_name: Graph(is_block=is_block)}
    n_src = "N_src" if is_block else "N"
    bound[feat_name] = Tensor(ir.Leaf("H", n_src, "k_in", ir.DENSE, ir.DATA, ("arg", feat_name)))
    for name in params[2:]:
        value = (real or {}).get(name)
        if name in present:
            bound[name] = Tensor(ir.Leaf(name, None, None, ir.DENSE, ir.WEIGHT, ("arg", name)))
        elif value is not None and not isinstance(value, torch.Tensor):
            bound[name] = value          # configuration given per call (get_attention=False)
        else:
            bound[name] = None
    interp = Interpreter(module, func_def, globals_, src, is_block, real)
    try:
        out = interp.run(bound)
        if not isinstance(out, Tensor):
            raise FrontendError("return value", f"forward returns {type(out).__name__}, "
                                "not a tensor")
        _check_complete(out.node)
    except (FrontendError, RaisesForConfig) as e:
        e.spec, e.config = interp.spec, interp.config     # when this outcome holds again
        raise
    return LayerIR(type(module).__name__, ir.rewrite_row_broadcasts(out.node), out.node,
                   interp.guards, tuple(params), frozenset(present), src, interp.spec,
                   interp.config, interp.heads if out.ndim == 3 else None,
                   tuple(dict.fromkeys(interp.udfs)))


def _check_complete(node):
    for leaf in ir.leaves(node):
        if leaf.rows is None:
            raise FrontendError(f"tensor '{leaf.name}'", "used in a way the frontend cannot "
                                "give a shape (only products and sums are lowered)")
