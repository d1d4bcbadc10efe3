"""The matrix IR: a small tree of matrices and the operations between them.

Leaves are matrices with symbolic shapes and the attributes of the GRANII paper's Table I:

    dense  / data        node features ``H`` (N_src x k_in)
    dense  / weight      learnable weights ``W`` (k_in x k_out), biases (1 x k_out)
    sparse / unweighted  the adjacency ``A`` (N_dst x N_src), only the positions of its nonzeros
    sparse / weighted    ``A_w``: the adjacency with edge values (an input such as ``edge_weight``)
    sparse / diagonal    degree powers ``D_in^p`` (N_dst x N_dst), ``D_out^p`` (N_src x N_src)
    sparse / scalar      ``c I``, a scalar (GIN's ``1 + eps``) times the identity
    sparse / selection   ``S = [I 0]`` (N_dst x N_src): on a block, the destination rows of the sources
    dense  / weight      ``blockdiag(a_1 .. a_H)`` (H F x H) of GAT's attention vectors: the score
                         ``sum_f theta_hf a_hf`` is the product ``Theta . blockdiag(a)``

Inner nodes:

    MatMul(a, b, c, ...)   the n-ary, associative product ``a b c ...`` (all adjacent products at one
                           level: this is what the enumerator re-associates)
    RowBroadcast(d, x)     ``c_ij = d_i x_ij``; the rewrite pass turns it into ``MatMul(diag(d), x)``
    Add(a, b)              ``a + b`` (with row broadcasting of a 1 x k operand, as for a bias)
    Apply(ref, x)          a barrier: a non-linear function nothing re-associates across
    Aggregate(prim, x)     a barrier that needs the graph: a non-linear aggregation (max, min), or
                           a readout (``readout_sum``/``readout_mean``: one row per graph of a
                           batch, ``G`` rows, DGL's ``sum_nodes`` and its kin)
    Store(attr, x)         a barrier: ``x``, also kept on the module (``self.attr = x``)
    Cat(parts)             ``[X_0, X_1, ...]`` side by side (width ``k+k+...``), multiplied by a weight

Edge values (attention):

    EdgeScore(a, b)        ``e_uv = a_u + b_v`` for each edge u -> v (an SDDMM; GAT's el + er)
    EdgeSoftmax(e)         softmax of ``e`` over the in-edges of each destination
    EdgeScale(e, w)        ``e * w`` with a per-edge weight ``w`` (broadcast over heads)
    SparseEdges(e)         the sparse matrix with the pattern of ``A`` and values ``e``: a
                           sparse/weighted operand of a product (``heads`` values per edge)

Edge messages (PyG's ``message`` of rows and edge features):

    EdgeMessage(parts, sides, act)
                           ``m_e = act(sum_i P_i[side_i(e)])`` for each edge ``e = u -> v``: ``src``
                           reads row ``u``, ``dst`` row ``v``, ``edge`` row ``e`` of a matrix of
                           one row per edge; E x k, a dense operand (GATv2's per-head score is
                           the product ``M . blockdiag(a)``)
    EdgeSum(m)             ``y_v = sum_{e -> v} m_e``: the messages summed over each
                           destination's in-edges (GINE's ``sum relu(x_u + e_uv)``), N x k

Nodes are immutable and hashable, so equal sub-expressions compare equal (used for CSE and for the
keys of once-per-graph values). Shapes are symbols: ``N_src``, ``N_dst`` on a block (N_dst <= N_src:
the destinations are a prefix of the sources), ``N`` for both on a graph, ``k_in``, ``k_out``, ``1``.
"""
import sys
from dataclasses import dataclass, field, fields, is_dataclass, replace

DENSE, SPARSE = "dense", "sparse"
DATA, WEIGHT = "data", "weight"
UNWEIGHTED, WEIGHTED, DIAGONAL = "unweighted", "weighted", "diagonal"
SCALAR = "scalar"            # c I: a learnable or fixed scalar times the identity (GIN's 1 + eps)
SELECTION = "selection"      # S = [I 0]: the destination rows of a block's sources
HEADED = "headed"            # [A_1 X | .. | A_H X]: one block per attention head, each waiting for
                             # that head's block of the weight (an intermediate, never a leaf)


def cached_hash(cls):
    """Keep a frozen dataclass's structural hash after the first call: trees are dict keys all
    through enumeration and lowering, and hashing a deep tree anew each time is quadratic."""
    structural = cls.__hash__

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = structural(self)
            object.__setattr__(self, "_hash", h)
        return h
    cls.__hash__ = __hash__
    return cls


@cached_hash
@dataclass(frozen=True)
class Leaf:
    """A matrix of the IR.

    ``source`` says where its value comes from at run time:
    ``("arg", name)`` a forward() argument, ``("param", attr)`` a parameter of the module,
    ``("graph",)`` the adjacency, ``("edge", name)`` adjacency with edge values from argument
    ``name``, ``("degree", "in"|"out", power, clamp_min, shift)`` the power ``(max(deg + shift,
    clamp_min))^power``.
    ``transposed`` marks ``W^T`` of a stored ``W`` (``nn.Linear`` keeps ``W`` as out x in).
    """
    name: str
    rows: str
    cols: str
    kind: str
    sub: str
    source: tuple = field(compare=True)
    transposed: bool = False

    @property
    def graph_only(self):
        """Depends on the graph alone, so anything computed from it is computed once per graph."""
        return self.source[0] in ("graph", "degree", "select")

    def __str__(self):
        return self.name


class _Inner:
    """What every inner node shares: its value is a dense matrix shaped like its operand ``x``."""
    kind = DENSE
    sub = DATA
    graph_only = False

    @property
    def rows(self):
        return self.x.rows

    @property
    def cols(self):
        return self.x.cols


@cached_hash
@dataclass(frozen=True)
class MatMul(_Inner):
    args: tuple

    @property
    def rows(self):
        return self.args[0].rows

    @property
    def cols(self):
        return self.args[-1].cols

    def __str__(self):
        return "(" + " . ".join(str(a) for a in self.args) + ")"


@cached_hash
@dataclass(frozen=True)
class RowBroadcast(_Inner):
    vec: Leaf
    x: object

    def __str__(self):
        return f"({self.vec} (x) {self.x})"


@cached_hash
@dataclass(frozen=True)
class Add(_Inner):
    a: object
    b: object

    @property
    def rows(self):
        return self.a.rows if self.a.rows != "1" else self.b.rows

    @property
    def cols(self):
        return self.a.cols

    def __str__(self):
        return f"({self.a} + {self.b})"


@cached_hash
@dataclass(frozen=True)
class Apply(_Inner):
    """A barrier: a function applied element-wise (or row-wise); ``label`` is what a person reads.

    ``ref`` says where the function is found when the plan runs, so a plan always calls the
    function of the layer instance it runs for, never one captured from another layer:

        ("module", path)    a submodule of the layer (``activation``, ``apply_func.mlp.0``)
        ("attr", name)      a callable attribute of the layer that is not a module
        ("function", f)     a library function (``torch.relu``): the same object for every layer
        ("dropout", p)      ``F.dropout(x, p, training=True)``
        ("scale", c)        ``c * x``
        ("detach",)         ``x.detach()``

    ``pure``: known to read no parameter, buffer or random number, so work on its result may be
    reused across calls; anything else is a barrier to reuse. ``site`` numbers the call in the
    source: two calls of one random function are two draws, never merged into one.
    """
    label: str
    x: object
    ref: tuple = ()
    pure: bool = False
    site: int = 0

    def __str__(self):
        return f"{self.label}({self.x})"


@cached_hash
@dataclass(frozen=True)
class Aggregate(_Inner):
    prim: str
    x: object
    out_rows: str = None         # a readout's "G"; else the destinations of ``x``'s rows

    @property
    def rows(self):
        if self.out_rows is not None:
            return self.out_rows
        return "N_dst" if self.x.rows == "N_src" else self.x.rows

    @property
    def cols(self):
        return self.x.cols

    def __str__(self):
        if self.out_rows is not None:
            return f"{self.prim}({self.x})"
        return f"{self.prim}(A, {self.x})"


@cached_hash
@dataclass(frozen=True)
class Store(_Inner):
    """A barrier: ``x``, also stored on the module as ``self.<attr>`` (SGConv's cache)."""
    attr: str
    x: object

    def __str__(self):
        return f"store[self.{self.attr}]({self.x})"


@cached_hash
@dataclass(frozen=True)
class Cat(_Inner):
    """``[X_0, X_1, ...]`` concatenated along columns (TAGConv's hop stack), as the left operand of
    a product with a weight ``W``: one GEMM over the stacked width ``k+k+...``, or, after
    ``split_cat``, the sum ``sum_i X_i W_i`` with ``W_i`` the row blocks of ``W``."""
    parts: tuple

    @property
    def rows(self):
        return self.parts[0].rows

    @property
    def cols(self):
        return "+".join(p.cols for p in self.parts)

    def __str__(self):
        return "cat(" + ", ".join(str(p) for p in self.parts) + ")"


@cached_hash
@dataclass(frozen=True)
class EdgeScore:
    kind = "edges"
    sub = DATA
    graph_only = False
    a: object
    b: object

    def __str__(self):
        return f"sddmm_add({self.a}, {self.b})"


@cached_hash
@dataclass(frozen=True)
class EdgeSoftmax:
    kind = "edges"
    sub = DATA
    graph_only = False
    e: object

    def __str__(self):
        return f"edge_softmax({self.e})"


@cached_hash
@dataclass(frozen=True)
class EdgeScale:
    kind = "edges"
    sub = DATA
    graph_only = False
    e: object
    w: object

    def __str__(self):
        return f"({self.e} * {self.w})"


@cached_hash
@dataclass(frozen=True)
class SparseEdges:
    """The adjacency pattern with values ``e``; ``heads`` values per edge. With several heads it
    only multiplies a matrix whose columns are the heads' blocks (``head_cols``)."""
    kind = SPARSE
    sub = WEIGHTED
    graph_only = False
    e: object
    rows: str
    cols: str
    heads: int = 1
    head_cols: str = None

    def __str__(self):
        return f"A[{self.e}]"


@cached_hash
@dataclass(frozen=True)
class EdgeMessage:
    """``m_e = act(sum_i parts[i][sides[i](e)])`` per edge (see the module docstring); ``act``
    is ``None``, ``"relu"`` or ``("leaky_relu", slope)``."""
    kind = DENSE
    sub = DATA
    graph_only = False
    rows = "E"
    parts: tuple
    sides: tuple
    act: object = None

    @property
    def cols(self):
        return self.parts[0].cols

    def operand(self, side):
        """The part read at ``side`` (``src``, ``dst``, ``edge``), or ``None``."""
        return next((p for p, s in zip(self.parts, self.sides) if s == side), None)

    def __str__(self):
        terms = " + ".join(f"{p}[{s}]" for p, s in zip(self.parts, self.sides))
        act = self.act if not isinstance(self.act, tuple) else f"{self.act[0]}({self.act[1]:g})"
        return f"{act}({terms})" if act else f"({terms})"


@cached_hash
@dataclass(frozen=True)
class EdgeSum(_Inner):
    """``y_v = sum_{e -> v} m_e`` of edge messages ``m`` (N x k)."""
    m: object
    rows = "N"

    @property
    def cols(self):
        return self.m.cols

    def __str__(self):
        return f"edge_sum({self.m})"


_CHILDREN = {MatMul: ("args",), RowBroadcast: ("vec", "x"), Add: ("a", "b"), Apply: ("x",),
             Aggregate: ("x",), Store: ("x",), EdgeScore: ("a", "b"), EdgeSoftmax: ("e",),
             EdgeScale: ("e", "w"), SparseEdges: ("e",), Cat: ("parts",),
             EdgeMessage: ("parts",), EdgeSum: ("m",)}


def is_diag(m):
    return isinstance(m, Leaf) and m.sub == DIAGONAL


def children(node):
    """The operands of an inner node (empty for a leaf)."""
    out = []
    for f in _CHILDREN.get(type(node), ()):
        v = getattr(node, f)
        out.extend(v if isinstance(v, tuple) else (v,))
    return tuple(out)


def with_children(node, new):
    """``node`` with its operands replaced by ``new`` (in ``children`` order)."""
    if isinstance(node, MatMul):
        return matmul(*new)
    if isinstance(node, Cat):
        return Cat(tuple(new))
    if isinstance(node, EdgeMessage):
        return replace(node, parts=tuple(new))
    fields = _CHILDREN[type(node)]
    return replace(node, **dict(zip(fields, new)))


def leaves(node):
    """All leaves under ``node``, left to right."""
    if isinstance(node, Leaf):
        return [node]
    return [leaf for c in children(node) for leaf in leaves(c)]


def matmul(*factors):
    """The product of ``factors``, flattened so that nested products sit at one level."""
    flat = []
    for f in factors:
        flat.extend(f.args if isinstance(f, MatMul) else (f,))
    for a, b in zip(flat, flat[1:]):
        if a.cols != b.rows:
            raise ValueError(f"shape mismatch in product: {a} is ?x{a.cols}, {b} is {b.rows}x?")
    return flat[0] if len(flat) == 1 else MatMul(tuple(flat))


def rewrite_row_broadcasts(node):
    """The rewrite pass: ``RowBroadcast(d, x)`` becomes ``MatMul(diag(d), x)``.

    ``c_ij = d_i x_ij`` is the product ``diag(d) X``; as a product it can re-associate with its
    neighbours (paper, Appendix C), while a row-broadcast is a barrier.
    """
    if isinstance(node, Leaf):
        return node
    new = [rewrite_row_broadcasts(c) for c in children(node)]
    if isinstance(node, RowBroadcast):
        return matmul(*new)
    return with_children(node, new)


def describe(node, indent=0):
    """A multi-line rendering of the tree, one node per line, leaves with their attributes."""
    pad = "  " * indent
    if isinstance(node, Leaf):
        t = "^T" if node.transposed else ""
        return f"{pad}{node.name}{t}  [{node.rows} x {node.cols}] {node.kind}/{node.sub}"
    head = type(node).__name__.lower()
    lines = [f"{pad}{head}"] + [describe(c, indent + 1) for c in children(node)]
    return "\n".join(lines)


def split_cat(prod):
    """``prod = (..., cat(X_0, ..., X_m), W, ...)`` as the sum of the products of the parts with
    the weight's row blocks, or ``None`` when it has no stacked operand times a weight:

        cat(X_0, ..., X_m) W  =  X_0 W_0 + (X_1 W_1 + (... + X_m W_m))

    The first is one GEMM over the stacked width (DGL's TAGConv; best when the output is wide);
    the second lets the sums factor (Horner's rule, best when it is narrow).
    """
    return _split_cat(prod) if isinstance(prod, MatMul) else None


def _split_cat(prod):
    """The sum of block products of ``prod = (..., cat(X_i), W, ...)``, or ``None``."""
    args = prod.args
    for i, (c, w) in enumerate(zip(args, args[1:])):
        if isinstance(c, Cat) and isinstance(w, Leaf) and w.source[0] == "param":
            m = len(c.parts)
            terms = [matmul(*args[:i], part,
                            Leaf(f"{w.name}[{j}/{m}]", part.cols, w.cols, DENSE, WEIGHT,
                                 ("param_block", w.source[1], j, m, w.transposed)),
                            *args[i + 2:])
                     for j, part in enumerate(c.parts)]
            out = terms[-1]
            for t in reversed(terms[:-1]):
                out = Add(t, out)
            return out
    return None


def size_value(sym, symbols):
    """The value of a size symbol; a concatenation's width ``k_in+k_in`` is the sum of its parts."""
    if sym in symbols or "+" not in sym:
        return symbols[sym]
    return sum(symbols[s] for s in sym.split("+"))


def factor_common_prefix(a, b):
    """``P (X + Y)`` for ``a = P X``, ``b = P Y`` with ``P`` their longest common left factor (both
    ``X`` and ``Y`` non-empty), or ``None`` when they have none.

    TAGConv's ``N H W_1 + N N H W_2`` becomes ``N (H W_1 + N H W_2)`` (Horner's rule): each
    hop's aggregation then runs once, at the output width. Only the longest prefix: a shorter
    cut ``P_1 (P_2 X + P_2 Y)`` computes ``P_2`` twice, and its own factoring is this one.
    """
    fa = a.args if isinstance(a, MatMul) else (a,)
    fb = b.args if isinstance(b, MatMul) else (b,)
    n = 0
    while n < min(len(fa), len(fb)) - 1 and fa[n] == fb[n]:
        n += 1
    if n == 0:
        return None
    return matmul(*fa[:n], Add(matmul(*fa[n:]), matmul(*fb[n:])))


class Unstable(ValueError):
    """A value with no text that names it the same way in every process (a lambda, a closure, an
    object of no known structure)."""


def stable_text(value):
    """Text that names ``value`` (an IR tree, with the sizes and functions it holds) the same way
    in every process, and names two values alike only when they compare equal: an IR node by its
    class and the fields it compares by; a function or class by the module and qualified name
    that find it again; an object whose class lists ``stable_fields`` by those attributes.
    ``Unstable`` for anything else: such a tree is never looked up across processes."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ",".join(stable_text(v) for v in value) + ")"
    cls = type(value)
    if is_dataclass(value) and not isinstance(value, type):
        parts = (f"{f.name}={stable_text(getattr(value, f.name))}" for f in fields(value)
                 if f.compare)
        return f"{_qualified(cls)}(" + ",".join(parts) + ")"
    names = getattr(cls, "stable_fields", None)
    if names is not None:
        return f"{_qualified(cls)}(" + ",".join(stable_text(getattr(value, n)) for n in names) + ")"
    if callable(value):
        return "fn:" + _qualified(value)
    raise Unstable(f"{cls.__name__} has no stable text")


def _qualified(obj):
    """``module:name`` of a function or class that this name finds again (its qualified name, or
    for a builtin such as ``torch.relu`` its plain name in its module), else ``Unstable``."""
    module = getattr(obj, "__module__", None)
    for name in (getattr(obj, "__qualname__", None), getattr(obj, "__name__", None)):
        found = sys.modules.get(module) if isinstance(module, str) and name else None
        for part in (name or "<").split("."):
            found = None if part.startswith("<") else getattr(found, part, None)
        if found is obj:
            return f"{module}:{name}"
    raise Unstable(f"{obj!r} cannot be found again by its name")
