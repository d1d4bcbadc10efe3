"""Symbolic values the frontend's interpreter computes with.

Anything that depends on the module's configuration is an ordinary Python value; anything that
depends on the graph or on tensors is one of these. ``Tensor`` wraps an IR expression.
"""
from dataclasses import dataclass, field

from .. import ir


class FrontendError(Exception):
    """The frontend met a construct it does not lower; ``construct`` names it for ``explain``."""

    def __init__(self, construct, reason, lineno=None, where=None):
        if lineno:
            at = f" (line {lineno} of {where or 'forward'})"
        else:
            at = f" (in {where})" if where else ""
        super().__init__(f"{construct}{at}: {reason}")
        self.construct = construct
        self.reason = reason
        self.lineno = lineno
        self.where = where      # the user-defined function it was met in, None for forward

    def __reduce__(self):       # copies and pickles of a model keep the reason of a fallback
        return type(self), (self.construct, self.reason, self.lineno, self.where), self.__dict__


class RaisesForConfig(Exception):
    """The original code raises for this configuration: the original forward must run (and raise)."""


@dataclass
class Tensor:
    """A dense tensor whose value is the IR expression ``node`` (``ndim`` as torch would see it)."""
    node: object
    ndim: int = 2


@dataclass
class Edges:
    """Per-edge values: the forward() argument ``arg``, scores ``node`` computed from features,
    or ``ones`` (``torch.ones(graph.num_edges(), 1)``: a product by them is the adjacency), or
    ``scaled = (d_dst, arg, d_src)``: the argument's values scaled by two degree leaves
    (``EdgeWeightNorm``), the sparse product ``d_dst A_w d_src`` (only a product reads them)."""
    arg: str = None
    node: object = None
    ones: bool = False
    scaled: tuple = None


@dataclass
class Degrees:
    """The degree vector ``(max(deg + shift, clamp))^power``: degrees shifted by a number, then
    clamped below at ``clamp``, then raised; ``side`` is ``"in"`` (destinations) or ``"out"``
    (sources). SAGEConv's ``gcn`` aggregator divides by ``deg + 1``: ``shift=1, power=-1``."""
    side: str
    power: float = 1.0
    clamp: float = None
    shift: float = 0.0

    def leaf(self, rows):
        p = self.power
        ptxt = "" if p == 1 else f"^{p:g}"
        base = f"D_{self.side}" if not self.shift else f"(D_{self.side}{self.shift:+g})"
        return ir.Leaf(f"{base}{ptxt}", rows, rows, ir.SPARSE, ir.DIAGONAL,
                       ("degree", self.side, float(p), self.clamp, float(self.shift)))


@dataclass
class Scalar:
    """``offset + factor * self.<attr>`` for a one-element parameter or buffer (GIN's eps)."""
    attr: str
    offset: float = 0.0
    factor: float = 1.0

    def leaf(self, rows):
        text = f"{self.offset:g}+{self.attr}" if self.offset else self.attr
        if self.factor != 1:
            text = f"{self.factor:g}*({text})"
        return ir.Leaf(f"({text})I", rows, rows, ir.SPARSE, ir.SCALAR,
                       ("scalar", self.attr, self.offset, self.factor))


@dataclass
class Shape:
    """``x.shape`` of a symbolic tensor with ``ndim`` dimensions (only its length is known); a
    mailbox's dimension ``degree_dim`` is the in-degree of the nodes the reduce function sees."""
    ndim: int
    degree_dim: int = None

    def __iter__(self):
        return iter([self[i] for i in range(self.ndim)])

    def __getitem__(self, i):
        if self.degree_dim is not None and i % self.ndim == self.degree_dim:
            return Degrees("in", 1.0, 1.0)   # at least 1 on every node DGL calls it on
        return GraphCondition("size")

    def __len__(self):
        return self.ndim


@dataclass
class HeadProduct:
    """``x * a`` of head-shaped features (N, H, F) and an attention vector (1, H, F), waiting for
    the ``.sum(-1)`` that makes it the product ``x . blockdiag(a)``."""
    x: object
    attr: str


@dataclass
class ParamItem:
    """``self.<attr>[0]`` of a parameter whose first dimension is 1 (``ndim``: its dimensions
    after indexing): the parameter's values with a leading dimension fewer. Lowered as the
    attention vectors of ``(x * a).sum(-1)``, which read the values whatever their leading
    dimensions."""
    attr: str
    ndim: int


@dataclass
class GraphCondition:
    """A condition that depends on the graph or tensors: only allowed to guard a ``raise``."""
    text: str


@dataclass
class Graph:
    """The ``graph`` argument, with the node/edge frames written by the code so far."""
    is_block: bool = False
    frames: dict = None

    def __post_init__(self):
        # on a graph, srcdata, dstdata and ndata are one frame, as in DGL
        src = {}
        self.frames = {"src": src, "dst": {} if self.is_block else src, "edge": {}}


@dataclass
class Frame:
    graph: Graph
    which: str


@dataclass
class Method:
    """``obj.name`` of a symbolic object, waiting to be called."""
    obj: object
    name: str


class LocalScope:
    """``graph.local_scope()``: a context manager with no effect on the IR."""


# -- inside user-defined message, reduce and apply-edges functions ---------------------------------
@dataclass
class EdgeBatch:
    """The ``edges`` argument of a message or apply-edges function."""
    graph: Graph


@dataclass
class NodeBatch:
    """The ``nodes`` argument of a reduce function; ``mailbox`` maps fields to ``Message``s."""
    graph: Graph
    mailbox: dict


@dataclass
class BatchFrame:
    """``edges.src``, ``edges.dst``, ``edges.data``, ``nodes.data`` or ``nodes.mailbox``."""
    batch: object
    which: str


@dataclass
class Message:
    """Per-edge values ``c * w_e * x_u`` of each edge ``e = u -> v``: the rows of ``x`` (a
    ``Tensor``, or ``Degrees`` alone until it scales one) gathered at the sources, times the
    edge values ``w`` (``Edges`` or ``None``) and the number ``c``."""
    x: object
    w: object = None
    c: float = 1.0


@dataclass
class DstValue:
    """``edges.dst[k]``: the rows of ``x`` gathered at the destinations of the edges."""
    x: object


@dataclass
class Mailbox:
    """``nodes.mailbox[k]``: the messages ``msg`` of each node's in-edges, (nodes, degree, ...)."""
    msg: Message

    @property
    def ndim(self):
        return self.msg.x.ndim + 1 if isinstance(self.msg.x, Tensor) else 3


@dataclass
class Opaque:
    """A value the frontend can name but not compute with (``argmax`` indices of a mailbox)."""
    text: str


UDF_VALUES = (EdgeBatch, NodeBatch, BatchFrame, Message, DstValue, Mailbox, Opaque)
