"""Symbolic values of PyG's graph-side code: the edge index, its rows, per-edge and per-node values.

The interpreter (``granii.frontend.interp``) evaluates objects it does not know as ordinary Python
objects: these classes implement the operators and methods PyG code applies to them, so ``row,
col = edge_index``, ``deg.pow_(-0.5)``, ``deg_inv_sqrt[row] * edge_weight * deg_inv_sqrt[col]``
and ``norm.view(-1, 1) * x_j`` compute symbolically what they compute on tensors. Anything else
raises ``FrontendError`` naming the construct.

    PygGraph          ``edge_index``, maybe with self loops added (``how``: "add", "remaining")
    NodeIndex         ``edge_index[0]`` (the sources, ``side="src"``) or ``edge_index[1]`` ("dst")
    EdgeCount         ``edge_index.size(1)``
    EdgeAttr          an edge feature argument carried through ``remove_self_loops`` /
                      ``add_self_loops`` (what binding computes for that graph's edges)
    EdgeVal           a value per edge: ``const * w_e * prod_i vec_i[side_i(e)]``, ``w`` the
                      forward's edge-weight argument (``EdgeW``) or none (ones)
    DegVec            ``scatter(w, index, reduce='sum')`` / ``degree(index)``: the (weighted)
                      count of edges per node on one side, raised to ``power``, with ``inf``
                      replaced by 0 when ``masked`` (``deg_inv_sqrt.masked_fill_(... == inf, 0)``)
    Gathered          ``x_j`` (rows of ``x`` at each edge's source) or ``x_i`` (at its target)
    EdgeFeat          per-edge feature vectors ``act(sum_i P_i[side_i(e)])`` of node rows
                      (``x_j``, ``x_i``) and edge features (a tensor of one row per edge,
                      ``edge_attr`` or ``lin(edge_attr)``), ``act`` ReLU or leaky ReLU: the IR's
                      ``EdgeMessage`` (GINE's ``(x_j + edge_attr).relu()``, GATv2's
                      ``leaky_relu(x_i + x_j [+ edge_attr])``)
    Width             ``x_j.size(-1)`` / ``edge_attr.size(-1)``: a width symbol; two are equal
                      when they are one symbol (both are checked at every call)
    Attention         per-edge, per-head values computed from node features (an IR edge node:
                      ``alpha_j + alpha_i`` is ``EdgeScore``, then ``leaky_relu``, ``softmax``
                      over each target's in-edges, dropout), as an ``edge_update`` makes them
    Message           ``coef * x_j``: what a message function returns
"""
import dataclasses
import math
from dataclasses import dataclass, field

from ..frontend.values import FrontendError

_SAME = ("view", "reshape", "to", "float", "contiguous", "type_as", "unsqueeze", "squeeze",
         "flatten", "type")


def fail(construct, reason):
    raise FrontendError(construct, reason)


def _same(self, *args, **kwargs):
    return self


@dataclass(eq=False)
class PygGraph:
    """The graph argument (``edge_index``) after the code's transforms: ``how`` is ``None``, or
    ``"add"`` / ``"remaining"`` once ``add_self_loops`` / ``add_remaining_self_loops`` ran."""
    kind: str = "edge_index"
    how: str = None
    device = "cpu"

    def __iter__(self):
        if self.kind == "adj_t":
            fail("iterating over a sparse adjacency", "not lowered")
        return iter((NodeIndex(self, "src"), NodeIndex(self, "dst")))

    def __len__(self):
        return 2

    def __getitem__(self, key):
        if self.kind != "adj_t" and key in (0, 1, -1, -2) and not isinstance(key, bool):
            return NodeIndex(self, "src" if key in (0, -2) else "dst")
        fail(f"edge_index[{key!r}]", "only edge_index[0] and edge_index[1] are lowered (a "
             "subset of the edges is another graph)")

    @property
    def layout(self):
        import torch
        return torch.sparse_csr if self.kind == "adj_t" else torch.strided

    def size(self, dim=None):
        if self.kind == "adj_t" and dim in (0, 1, -1, -2):
            return NODES
        if dim in (1, -1):
            return EdgeCount(self)
        if dim in (0, -2):
            return 2
        fail(f"edge_index.size({dim!r})", "only the number of edges, size(1), is lowered")

    def dim(self):
        return 2

    def __repr__(self):
        return f"{self.kind}" + (f"+loops({self.how})" if self.how else "")


class _Nodes:
    """The number of nodes (a sparse adjacency's ``size(0)`` and ``size(1)``)."""

    def __repr__(self):
        return "N"


NODES = _Nodes()


@dataclass(eq=False)
class NodeIndex:
    graph: PygGraph
    side: str

    view = reshape = to = contiguous = _same

    def numel(self):
        return EdgeCount(self.graph)


@dataclass(eq=False)
class EdgeCount:
    """``edge_index.size(1)``. Compared with 0 (``if index.numel() == 0: return alpha`` in an
    ``edge_update``) it is taken as not 0: on a graph without edges the other branch computes
    the same empty values (functions of an empty tensor), so the plan holds for both."""
    graph: PygGraph

    def __eq__(self, other):
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return False
        fail("a comparison of the number of edges", "only with 0 is lowered")

    __hash__ = object.__hash__


@dataclass(frozen=True)
class EdgeW:
    """The forward argument ``arg`` (one value per edge of the input graph), carried through
    ``how`` (self loops added: new loops get ``fill``, as PyG's functions give them)."""
    arg: str
    how: str = None
    fill: float = 1.0

    def key(self):
        return f"{self.arg}" + (f"|{self.how}:{self.fill:g}" if self.how else "")


@dataclass(frozen=True)
class EdgeAttr:
    """The edge feature argument ``arg`` (E x k) on the graph with self loops ``how``:
    ``"removed"`` (the rows of the edges that are not loops), ``"remaining"`` (those, then one row
    per node: ``fill``, a number or the mean / sum of the node's remaining in-edges' rows, as
    ``add_self_loops`` fills them)."""
    arg: str
    how: str
    fill: object = None

    def key(self):
        return f"attr:{self.arg}|{self.how}:{self.fill}"


@dataclass(eq=False)
class DegVec:
    graph: PygGraph
    side: str                       # the side whose index the edges were counted on
    weight: object = None           # EdgeVal counted (None: each edge counts 1)
    power: float = 1.0
    masked: bool = False

    to = float = contiguous = view = reshape = _same

    def copy(self, **kw):
        return dataclasses.replace(self, **kw)

    def pow(self, p):
        if not isinstance(p, (int, float)) or isinstance(p, bool):
            fail("degrees.pow of a tensor", "only a number power is lowered")
        return self.copy(power=self.power * p)

    def pow_(self, p):
        self.power = self.pow(p).power
        return self

    def __pow__(self, p):
        return self.pow(p)

    def sqrt(self):
        return self.pow(0.5)

    def rsqrt(self):
        return self.pow(-0.5)

    def reciprocal(self):
        return self.pow(-1)

    def __rtruediv__(self, c):
        if c == 1:
            return self.pow(-1)
        fail("a number divided by degrees", "only 1 / deg is lowered")

    def __eq__(self, other):
        if isinstance(other, float) and math.isinf(other) and other > 0:
            return InfMask(self)
        fail("a comparison of degrees", "only deg == float('inf') (to mask it) is lowered")

    __hash__ = object.__hash__

    def masked_fill(self, mask, value):
        if not isinstance(mask, InfMask) or mask.vec is not self or value != 0:
            fail("masked_fill of degrees", "only deg.masked_fill(deg == inf, 0) is lowered")
        return self.copy(masked=True)

    def masked_fill_(self, mask, value):
        self.masked = self.masked_fill(mask, value).masked
        return self

    def __setitem__(self, key, value):          # deg_inv_sqrt[deg_inv_sqrt == inf] = 0
        self.masked_fill_(key, value)

    def __getitem__(self, idx):
        if not isinstance(idx, NodeIndex):
            fail("indexing of degrees", "only by edge_index[0] or edge_index[1] is lowered")
        if idx.graph.how != self.graph.how:
            fail("degrees of one graph read on the edges of another",
                 "self loops were added between the two")
        return EdgeVal(self.graph, gathers=((self, idx.side),))

    def key(self):
        w = self.weight.key() if self.weight is not None else "1"
        return f"deg[{self.side};{w};^{self.power:g};{'m' if self.masked else ''}]"


@dataclass(eq=False)
class InfMask:
    vec: DegVec


@dataclass(eq=False)
class EdgeVal:
    """``const * w_e * prod (vec[side])``: one value per edge of ``graph``."""
    graph: PygGraph
    weight: EdgeW = None
    gathers: tuple = ()
    const: float = 1.0

    view = reshape = to = float = contiguous = unsqueeze = squeeze = flatten = type_as = _same

    @property
    def ones(self):
        return self.weight is None and not self.gathers and self.const == 1.0

    def _join(self, other, node_op):
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return dataclasses.replace(self, const=self.const * other)
        if isinstance(other, EdgeVal):
            if other.graph.how != self.graph.how:
                fail("a product of values of the edges of two graphs", "self loops were added "
                     "between the two")
            if self.weight is not None and other.weight is not None:
                fail("a product of two edge-weight arguments", "not lowered")
            return EdgeVal(self.graph, self.weight or other.weight, self.gathers + other.gathers,
                           self.const * other.const)
        if isinstance(other, Gathered):
            return Message(self, other)
        fail(f"{node_op} of per-edge values and {type(other).__name__}", "not lowered")

    def __mul__(self, other):
        return self._join(other, "product")

    __rmul__ = __mul__

    def key(self):
        w = self.weight.key() if self.weight is not None else "1"
        return f"{self.const!r}*{w}*" + "*".join(f"{v.key()}[{s}]" for v, s in self.gathers)


@dataclass(eq=False)
class Gathered:
    """``x_j`` (``side="src"``) or ``x_i`` (``"dst"``): rows of the node tensor ``x`` (a
    ``frontend.values.Tensor``) at each edge's source or target."""
    x: object
    side: str
    graph: PygGraph = None          # the graph an ``edge_update`` reads it on (else unknown)

    view = reshape = to = float = contiguous = _same

    def __add__(self, other):
        """``alpha_j + alpha_i``: per-edge scores ``e_uv = a_u + b_v`` (an SDDMM), of one value
        per edge and head (``a``, ``b`` N x H); of per-head feature vectors (N x H x F, GATv2's
        ``x_i + x_j``), per-edge features (``EdgeFeat``)."""
        from .. import ir
        if not isinstance(other, Gathered) or other.side == self.side or \
                self.graph is None or other.graph is not self.graph:
            fail("a sum of gathered rows", "only alpha_j + alpha_i of one graph is lowered")
        src, dst = (self, other) if self.side == "src" else (other, self)
        if src.x.ndim == 3 and dst.x.ndim == 3:
            return EdgeFeat(self.graph, ((self.x.node, self.side), (other.x.node, other.side)),
                            3)
        if src.x.ndim != 2 or dst.x.ndim != 2:
            fail("x_i + x_j of rows of different shapes", "not lowered")
        return Attention(self.graph, ir.EdgeScore(src.x.node, dst.x.node))

    __radd__ = __add__

    def size(self, dim=None):
        if dim in (-1, self.x.ndim - 1):
            return Width(self.x.node.cols)
        fail(f"x_{'j' if self.side == 'src' else 'i'}.size({dim!r})", "only the width, "
             "size(-1), is lowered")

    def __mul__(self, other):
        if isinstance(other, Attention):
            return Message(other, self)
        if isinstance(other, EdgeVal):
            return Message(other, self)
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Message(None, self, float(other))
        fail(f"a product of x_{'j' if self.side == 'src' else 'i'} and "
             f"{type(other).__name__}", "only per-edge values times x_j are lowered")

    __rmul__ = __mul__


@dataclass(eq=False)
class EdgeFeat:
    """``act(sum_i node_i[side_i(e)])`` per edge of ``graph``: ``parts`` are ``(IR node,
    side)`` with side ``src`` / ``dst`` (N-row matrices read at each edge's source / target) or
    ``edge`` (a matrix of one row per edge); ``ndim`` 3 when split in heads."""
    graph: PygGraph
    parts: tuple
    ndim: int = 2
    act: object = None

    view = reshape = to = float = contiguous = _same

    def relu(self):
        return self.activated("relu")

    def activated(self, act):
        if self.act is not None:
            fail("an activation of activated edge features", "only one activation is lowered")
        return dataclasses.replace(self, act=act)

    def node(self):
        """The IR's ``EdgeMessage`` of these features."""
        from .. import ir
        nodes, sides = zip(*self.parts)
        if len(set(sides)) != len(sides):
            fail("edge features of two terms read at one side", "not lowered")
        return ir.EdgeMessage(nodes, sides, self.act)


@dataclass(frozen=True)
class Width:
    """The width (a size symbol) of per-edge or gathered features, ``x.size(-1)``."""
    sym: str

    def __eq__(self, other):
        if isinstance(other, Width) and other.sym == self.sym:
            return True
        fail("a comparison of feature widths", "only of widths known to be equal is lowered")

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = object.__hash__


@dataclass(eq=False)
class Attention:
    """Values per edge and head of ``graph``, the IR edge node ``node`` (``EdgeScore``,
    ``Apply`` of it, ``EdgeSoftmax``): what GATConv's ``edge_update`` returns."""
    graph: PygGraph
    node: object

    view = reshape = to = float = contiguous = unsqueeze = squeeze = type_as = _same

    def __mul__(self, other):
        if isinstance(other, Gathered):
            return Message(self, other)
        fail(f"a product of attention values and {type(other).__name__}", "only with x_j is "
             "lowered")

    __rmul__ = __mul__


@dataclass(eq=False)
class Message:
    """``coef * c * x_j``: the messages of a message function (``coef`` ``None``: ones)."""
    coef: EdgeVal
    x: Gathered
    c: float = 1.0

    view = reshape = to = float = contiguous = _same

    def __mul__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return dataclasses.replace(self, c=self.c * other)
        if isinstance(other, EdgeVal) and self.coef is None:
            return Message(other, self.x, self.c)
        if isinstance(other, EdgeVal):
            return Message(self.coef * other, self.x, self.c)
        fail(f"a product of messages and {type(other).__name__}", "not lowered")

    __rmul__ = __mul__


PYG_VALUES = (PygGraph, NodeIndex, EdgeCount, EdgeVal, DegVec, InfMask, Gathered, Attention,
              Message, EdgeFeat, Width)

__all__ = [c.__name__ for c in PYG_VALUES] + ["EdgeAttr", "EdgeW", "field"]
